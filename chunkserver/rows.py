"""The row store of one storage target: ``chunks.sqlite``, which names every version's slot (see the engine).

Tables: ``target`` (format, block size, a flush counter under the key ``syncs``), ``versions`` (one row per
committed, pending or kept version: ``pending`` is 0, 1 or 2; ``cls, slot`` its base and ``overrides`` its
block slots, see the engine's "Block-level copy-on-write") and ``unsynced`` (with write-back, the unflushed
versions: every one staged since the last flush). The on-disk names predate the word "flush" and stay.
The engine builds a transaction from the statements below and runs it with :meth:`RowStore.execute`; this
module holds all of the SQL and none of the engine's state.
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from kvfs.crc import BLOCK
from kvfs.errors import KvfsError
from kvfs.kv.sqlite import WalCheckpointer

#: 2: rows carry ``overrides``. A format-1 target gains the column (empty: every version is its base) at open;
#: an older engine refuses a format-2 target rather than read bases without their overrides.
_FORMAT = 2
SQL_BATCH = 500  # inodes or indexes per DELETE (SQLite allows 32766 parameters)

Statement = tuple[str, tuple]
Key = tuple[int, int]  # (inode, idx) of a chunk's rows

#: A statement that always changes a page, so a durable transaction with it fsyncs the WAL even when idle.
COUNT_FLUSH: Statement = ("UPDATE target SET value = value + 1 WHERE key = 'syncs'", ())


def put_pending(key: Key, version: int, length: int, crc: int, blocks: bytes, cls: int, slot: int,
                aux: bytes, overrides: bytes) -> Statement:
    """The chunk's pending version is this one (replacing any other)."""
    return ("INSERT OR REPLACE INTO versions VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*key, version, length, crc, blocks, cls, slot, aux, overrides))


def list_unflushed(seq: int, key: Key, version: int) -> Statement:
    return ("INSERT INTO unsynced VALUES (?, ?, ?, ?)", (seq, *key, version))


def forget_flushed(upto: int) -> Statement:
    """A flush covered the stagings up to ``upto``."""
    return ("DELETE FROM unsynced WHERE seq <= ?", (upto,))


#: After recovery from a crash: no version is kept or listed as unsynced any more.
FORGET_KEPT: Statement = ("DELETE FROM versions WHERE pending=2", ())
FORGET_ALL_UNFLUSHED: Statement = ("DELETE FROM unsynced", ())


def delete_current(key: Key) -> Statement:
    """Drop the chunk's committed and pending rows (not a kept one)."""
    return ("DELETE FROM versions WHERE inode=? AND idx=? AND pending<2", key)


def delete(key: Key, pending: int) -> Statement:
    """Drop the chunk's committed (0), pending (1) or kept (2) row."""
    return ("DELETE FROM versions WHERE inode=? AND idx=? AND pending=?", (*key, pending))


def move(key: Key, src: int, dst: int) -> Statement:
    """The chunk's row in state ``src`` (0, 1, 2 as in :func:`delete`) is now in state ``dst``."""
    return ("UPDATE versions SET pending=? WHERE inode=? AND idx=? AND pending=?", (dst, *key, src))


def delete_inodes(inodes: list[int]) -> Statement:
    """Drop every row of these inodes (at most ``SQL_BATCH``)."""
    return (f"DELETE FROM versions WHERE inode IN ({','.join('?' * len(inodes))})", tuple(inodes))


def delete_indexes(inode: int, indexes: list[int]) -> Statement:
    """Drop every row of these chunks of ``inode`` (at most ``SQL_BATCH``)."""
    return (f"DELETE FROM versions WHERE inode=? AND idx IN ({','.join('?' * len(indexes))})", (inode, *indexes))


DB_NAME = "chunks.sqlite"


class RowStore:
    """``root/chunks.sqlite``: WAL mode, synchronous=FULL for durable transactions (OFF when ``fsync=False``)."""

    def __init__(self, root: Path, *, fsync: bool) -> None:
        self.root = root
        self._fsync = fsync
        self.dirty = False  # a transaction since the last fsync'ed one
        self._db = sqlite3.connect(root / DB_NAME, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._synchronous = "FULL" if fsync else "OFF"
        self._db.execute(f"PRAGMA synchronous={self._synchronous}")
        self._db.executescript(
            """
            CREATE TABLE IF NOT EXISTS target(key TEXT PRIMARY KEY, value INTEGER NOT NULL);
            CREATE TABLE IF NOT EXISTS versions(
                inode INTEGER NOT NULL, idx INTEGER NOT NULL, pending INTEGER NOT NULL,
                version INTEGER NOT NULL, length INTEGER NOT NULL, crc INTEGER NOT NULL,
                block_crcs BLOB NOT NULL, cls INTEGER NOT NULL, slot INTEGER NOT NULL, aux BLOB NOT NULL,
                overrides BLOB NOT NULL DEFAULT x'',
                PRIMARY KEY (inode, idx, pending)) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS unsynced(
                seq INTEGER PRIMARY KEY, inode INTEGER NOT NULL, idx INTEGER NOT NULL, version INTEGER NOT NULL);
            INSERT OR IGNORE INTO target VALUES ('format', 2), ('block', 65536), ('syncs', 0);
            """
        )
        fmt = dict(self._db.execute("SELECT key, value FROM target"))
        if fmt.get("format") == 1:
            self._db.executescript(
                "BEGIN; ALTER TABLE versions ADD COLUMN overrides BLOB NOT NULL DEFAULT x'';"
                " UPDATE target SET value = 2 WHERE key = 'format'; COMMIT;")
            fmt["format"] = 2
        if (fmt.get("format"), fmt.get("block")) != (_FORMAT, BLOCK):
            raise KvfsError(f"target {root} has unsupported format {fmt}", errno.EINVAL)
        # checkpoints fsync; run in a commit they would hold the engine's row lock, and every writer, meanwhile
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._checkpoints = WalCheckpointer(root / DB_NAME, synchronous=self._synchronous)

    def close(self) -> None:
        self._checkpoints.close()
        self._db.close()

    def versions(self) -> Iterator[tuple]:
        """Every row: (inode, idx, pending, version, length, crc, block_crcs, cls, slot, aux, overrides)."""
        return self._db.execute(
            "SELECT inode, idx, pending, version, length, crc, block_crcs, cls, slot, aux, overrides FROM versions")

    def unflushed_versions(self) -> list[tuple]:
        """After a crash in write-back mode: the versions listed as unflushed and the kept ones, as (inode, idx,
        pending, version, length, crc, block_crcs, cls, slot, overrides); [] after a clean close."""
        leftovers = "SELECT 1 FROM unsynced UNION ALL SELECT 1 FROM versions WHERE pending=2"
        if self._db.execute(leftovers).fetchone() is None:
            return []
        return self._db.execute(
            "SELECT v.inode, v.idx, v.pending, v.version, v.length, v.crc, v.block_crcs, v.cls, v.slot, v.overrides"
            " FROM unsynced u JOIN versions v ON v.inode=u.inode AND v.idx=u.idx AND v.version=u.version"
            " AND v.pending < 2 UNION SELECT inode, idx, pending, version, length, crc, block_crcs, cls, slot,"
            " overrides FROM versions WHERE pending=2"
        ).fetchall()

    def execute(self, *statements: Statement, durable: bool) -> bool:
        """Run statements as one transaction (the caller serialises writers); a full disk becomes ENOSPC with
        nothing changed. ``durable=False`` leaves out its fsync (see the engine's "Crash safety"); a durable one
        also makes every earlier one durable. Returns whether it is durable (always, without fsync: nothing
        survives a power loss then anyway)."""
        lazy = self._fsync and not durable
        try:
            if self._fsync and self._synchronous != ("NORMAL" if lazy else "FULL"):
                self._synchronous = "NORMAL" if lazy else "FULL"
                self._db.execute(f"PRAGMA synchronous={self._synchronous}")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as e:
            if "full" in str(e):
                raise KvfsError(f"metadata of target {self.root}: {e}", errno.ENOSPC) from e
            raise KvfsError(f"metadata of target {self.root}: {e}", errno.EIO) from e
        self._checkpoints.committed(len(statements))  # about a page a statement
        self.dirty = lazy
        return not lazy
