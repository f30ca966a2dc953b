"""SQLite engine: one file in WAL mode, optimistic transactions over SQLite snapshots.

How a transaction maps onto SQLite:

* The first non-snapshot read opens a deferred read transaction; in WAL mode that pins a
  snapshot, so every later read sees the same version (repeatable, serializable reads).
* Writes are buffered in a :class:`WriteBuffer` (read-your-writes) and applied at commit.
* Commit upgrades the read transaction to a write transaction.  If any other connection
  committed since the snapshot was taken, SQLite refuses with SQLITE_BUSY_SNAPSHOT; that is
  :class:`TransactionConflict` and the retry helper runs the function again.  While another
  writer merely holds the lock (plain SQLITE_BUSY) the upgrade is retried until
  ``busy_timeout``: either the lock frees with the snapshot still current, or it became stale.
* A transaction that read only with ``snapshot=True`` (or not at all) cannot conflict: its
  writes are applied in a fresh ``BEGIN IMMEDIATE``, like FoundationDB's snapshot reads.
* Atomic add/max read the stored value under the write lock at commit, so they never conflict.
* Stamped keys (:meth:`Transaction.set_stamped`) take the next value of a counter kept under
  ``_STAMP_KEY`` while the write lock is held, so stamps grow in commit order like versionstamps.
* Checkpoints run in a thread of their own (:class:`WalCheckpointer`), not in the commits.

Conflicts are detected at database granularity: any commit by anyone invalidates every open
snapshot.  That gives false conflicts (retried, harmless) but never misses a real one.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence

from kvfs.errors import KvfsError, TransactionConflict, TransactionTooLarge, TransactionTooOld

from .base import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES, STAMP_BYTES, Database, KeyValue, Transaction
from .buffer import Atomic, WriteBuffer

SQLITE_BUSY = 5
SQLITE_BUSY_SNAPSHOT = 517
_STAMP_KEY = b"\xff/kvfs/stamp"  # outside every tuple-packed key space, like FoundationDB's system keys
#: Keys per ``IN (...)`` of a batched read: under SQLite's smallest bound-parameter limit (999 before 3.32).
_MAX_PARAMS = 500
_SCHEMA = "CREATE TABLE IF NOT EXISTS kv (k BLOB PRIMARY KEY, v BLOB NOT NULL) WITHOUT ROWID"
#: How often a checkpoint thread looks whether the WAL has grown by CHECKPOINT_PAGES since its last checkpoint.
CHECKPOINT_INTERVAL_S = 0.5
#: SQLite's own autocheckpoint threshold, kept: each checkpoint costs two fsyncs, which a disk shared with chunk
#: servers pays for in their flushes.
CHECKPOINT_PAGES = 1000
_PAGE = 4096

log = logging.getLogger(__name__)


class WalCheckpointer:
    """PASSIVE checkpoints of one SQLite database in WAL mode, from a thread and a connection of their own.

    SQLite's autocheckpoint runs in whichever commit crosses 1,000 WAL pages, and a checkpoint fsyncs the WAL and
    the database file: on a disk that other processes write to (chunk servers), that can take hundreds of
    milliseconds, while meta's event loop, or every writer waiting for a chunk server's row lock, stands still. A
    PASSIVE checkpoint waits for no reader or writer. The owner opens every other connection
    with ``PRAGMA wal_autocheckpoint=0`` and reports each commit to :meth:`committed`; ``synchronous`` is how the
    checkpoint syncs (OFF: not at all, like the owner's commits)."""

    def __init__(self, path: str | os.PathLike[str], *, synchronous: str,
                 interval_s: float = CHECKPOINT_INTERVAL_S) -> None:
        self.path = path
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        conn.execute(f"PRAGMA synchronous={synchronous}")
        self._pages = 0  # estimated WAL pages since the last checkpoint
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(conn, interval_s), name="kvfs-sqlite-checkpoint",
                                        daemon=True)
        self._thread.start()

    def committed(self, pages: int) -> None:
        """A commit wrote about ``pages`` WAL pages (at least one)."""
        with self._lock:
            self._pages += pages

    def _loop(self, conn: sqlite3.Connection, interval_s: float) -> None:
        try:
            while not self._closed.wait(interval_s):
                with self._lock:
                    if self._pages < CHECKPOINT_PAGES:
                        continue
                    pages, self._pages = self._pages, 0
                try:
                    _, wal_pages, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error as exc:  # e.g. a full disk: commits go on into the WAL; try again next time
                    log.warning("sqlite checkpoint of %s failed: %s", self.path, exc)
                    left = pages
                else:  # a reader's snapshot keeps the frames after it in the WAL: the next look copies them
                    left = max(0, wal_pages - copied)
                with self._lock:
                    self._pages += left
        finally:
            conn.close()

    def close(self) -> None:
        """Stop the thread (before the owner closes its connections: the last one checkpoints what is left)."""
        self._closed.set()
        self._thread.join()


class SqliteDatabase(Database):
    """The embedded default engine; several processes may open the same file."""

    inline = True  # WAL: readers never wait; a writer waits only while another process commits

    def __init__(
        self,
        path: str,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        busy_timeout_s: float = 10.0,
        synchronous: str = "NORMAL",
        checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S,
    ) -> None:
        """``synchronous=NORMAL`` in WAL mode never corrupts the file; a power loss may drop the
        last commits.  Pass ``"FULL"`` to fsync every commit."""
        self.path = path
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.busy_timeout_s = busy_timeout_s
        self._synchronous = synchronous
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        conn = self._connect()
        conn.execute(_SCHEMA)
        self._release(conn)
        self._checkpoints = WalCheckpointer(path, synchronous=synchronous, interval_s=checkpoint_interval_s)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        conn.execute(f"PRAGMA mmap_size={MMAP_BYTES}")  # reads without a read(2) per page (~20% per change)
        conn.execute("PRAGMA wal_autocheckpoint=0")  # WalCheckpointer's job
        return conn

    def _acquire(self) -> sqlite3.Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _release(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        with self._lock:
            self._idle.append(conn)

    def create_transaction(self) -> "SqliteTransaction":
        return SqliteTransaction(self)

    def close(self) -> None:
        self._checkpoints.close()
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


MMAP_BYTES = 512 << 20


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    return getattr(exc, "sqlite_errorcode", None) == SQLITE_BUSY


class SqliteTransaction(Transaction):
    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db
        self._conn: sqlite3.Connection | None = None
        self.reset()

    # -- lifecycle -------------------------------------------------------------------------
    def reset(self) -> None:
        self._end_connection()
        self._buf = WriteBuffer()
        self._stamped: tuple[bytes, bytes] | None = None
        self._conflicting_reads = False
        self._started = time.monotonic()

    def _end_connection(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._db._release(conn)

    def _check_age(self) -> None:
        if time.monotonic() - self._started > self._db.max_age_s:
            raise TransactionTooOld(f"transaction older than {self._db.max_age_s} s")

    def _read_conn(self, snapshot: bool) -> sqlite3.Connection:
        """The connection holding this transaction's snapshot, opened on first read."""
        self._check_age()
        if not snapshot:
            self._conflicting_reads = True
        if self._conn is None:
            self._conn = self._db._acquire()
            self._conn.execute("BEGIN DEFERRED")
        return self._conn

    # -- reads -----------------------------------------------------------------------------
    def _stored_get(self, key: bytes, snapshot: bool) -> bytes | None:
        row = self._read_conn(snapshot).execute("SELECT v FROM kv WHERE k = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def _stored_range(self, begin: bytes, end: bytes, reverse: bool, snapshot: bool) -> Iterator[KeyValue]:
        order = "DESC" if reverse else "ASC"
        cur = self._read_conn(snapshot).execute(
            f"SELECT k, v FROM kv WHERE k >= ? AND k < ? ORDER BY k {order}", (begin, end)
        )
        return ((bytes(k), bytes(v)) for k, v in cur)

    def get(self, key: bytes, snapshot: bool = False) -> bytes | None:
        return self._buf.overlay_get(key, lambda: self._stored_get(key, snapshot))

    def get_many(self, keys: Sequence[bytes], snapshot: bool = False) -> list[bytes | None]:
        stored: dict[bytes, bytes] = {}
        wanted = list(dict.fromkeys(keys))
        if wanted:
            conn = self._read_conn(snapshot)
            for at in range(0, len(wanted), _MAX_PARAMS):
                part = wanted[at : at + _MAX_PARAMS]
                marks = ",".join("?" * len(part))
                stored.update((bytes(k), bytes(v)) for k, v in
                              conn.execute(f"SELECT k, v FROM kv WHERE k IN ({marks})", part))
        return [self._buf.overlay_get(key, lambda key=key: stored.get(key)) for key in keys]

    def get_range(
        self, begin: bytes, end: bytes, limit: int = 0, reverse: bool = False, snapshot: bool = False
    ) -> list[KeyValue]:
        if begin >= end:
            self._check_age()
            return []
        rows = self._buf.overlay_range(
            begin,
            end,
            reverse,
            self._stored_range(begin, end, reverse, snapshot),
            lambda k: self._stored_get(k, snapshot),
        )
        out: list[KeyValue] = []
        for kv in rows:
            out.append(kv)
            if limit and len(out) >= limit:
                break
        return out

    # -- writes ----------------------------------------------------------------------------
    def set(self, key: bytes, value: bytes) -> None:
        self._buf.set(bytes(key), bytes(value))

    def clear(self, key: bytes) -> None:
        self._buf.clear(bytes(key))

    def clear_range(self, begin: bytes, end: bytes) -> None:
        self._buf.clear_range(bytes(begin), bytes(end))

    def add(self, key: bytes, delta: int) -> None:
        self._buf.atomic("add", bytes(key), delta)

    def max(self, key: bytes, value: int) -> None:
        self._buf.atomic("max", bytes(key), value)

    def set_stamped(self, prefix: bytes, value: bytes) -> None:
        if self._stamped is not None:
            raise ValueError("one stamped key per transaction")
        self._stamped = (bytes(prefix), bytes(value))
        self._buf.size += len(prefix) + STAMP_BYTES + len(value)

    # -- commit ----------------------------------------------------------------------------
    def commit(self) -> None:
        self._check_age()
        if self._buf.size > self._db.max_bytes:
            raise TransactionTooLarge(f"transaction writes {self._buf.size} bytes > {self._db.max_bytes}")
        try:
            if self._buf or self._stamped is not None:
                conn = self._begin_write()
                self._apply(conn)
                conn.execute("COMMIT")
                self._db._checkpoints.committed(1 + self._buf.size // _PAGE)
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) in (SQLITE_BUSY, SQLITE_BUSY_SNAPSHOT):
                raise TransactionConflict(f"sqlite: {exc}") from exc
            raise KvfsError(f"sqlite commit failed: {exc}") from exc
        finally:
            self.reset()

    def _begin_write(self) -> sqlite3.Connection:
        """Take the write lock, keeping the snapshot if reads must be validated against it."""
        if not self._conflicting_reads:
            self._end_connection()  # snapshot reads only: no need to keep their version
            self._conn = self._db._acquire()
            self._conn.execute("BEGIN IMMEDIATE")  # waits up to busy_timeout for the lock
            return self._conn
        conn = self._conn
        assert conn is not None
        deadline = time.monotonic() + self._db.busy_timeout_s
        delay = 0.0005
        while True:
            try:
                # Upgrading a read transaction does not wait in SQLite's busy handler; the
                # first write statement either takes the lock or reports BUSY / BUSY_SNAPSHOT.
                conn.execute("INSERT INTO kv (k, v) SELECT k, v FROM kv WHERE 0")
                return conn
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.01)

    def _apply(self, conn: sqlite3.Connection) -> None:
        for begin, end in self._buf.cleared:
            conn.execute("DELETE FROM kv WHERE k >= ? AND k < ?", (begin, end))
        upserts, deletes = [], []
        for key, w in self._buf.writes.items():
            if isinstance(w, Atomic):
                row = conn.execute("SELECT v FROM kv WHERE k = ?", (key,)).fetchone()
                w = w.apply(None if row is None else bytes(row[0]))
            if w is None:
                deletes.append((key,))
            else:
                upserts.append((key, w))
        if self._stamped is not None:
            row = conn.execute("SELECT v FROM kv WHERE k = ?", (_STAMP_KEY,)).fetchone()
            stamp = (int.from_bytes(row[0], "big") if row else 0) + 1
            upserts.append((_STAMP_KEY, stamp.to_bytes(8, "big")))
            prefix, value = self._stamped
            upserts.append((prefix + stamp.to_bytes(8, "big") + bytes(STAMP_BYTES - 8), value))
        conn.executemany("DELETE FROM kv WHERE k = ?", deletes)
        conn.executemany("INSERT OR REPLACE INTO kv (k, v) VALUES (?, ?)", upserts)
