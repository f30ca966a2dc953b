"""Chunk engine: the local, synchronous store of one storage target (one disk or directory).

Theory of operation
-------------------
The replication layer (CRAQ) decides versions; this module only keeps them safe. Every chunk has a
*committed* version (version 0 = empty, when nothing was ever committed) and at most one *pending*
version. Writes are copy-on-write: a pending version is a complete new copy of the chunk, written
into a free *slot* beside the committed one, and ``commit`` only flips metadata.

On-disk format (under ``root``)::

    LOCK                 flock()ed while an engine has the target open (one engine per target)
    chunks.sqlite        SQLite, WAL mode, synchronous=FULL (OFF when fsync=False)
    data/NN.dat          slot file of size class 2**NN bytes (NN = 16 .. 26, i.e. 64 KiB .. 64 MiB);
                         slot s occupies bytes [s * 2**NN, (s + 1) * 2**NN)

A version of length L lives in one slot of the smallest class >= max(L, 64 KiB). Slot files are
preallocated with ``posix_fallocate`` and slots are reused, so a write never creates a file (a
file create costs up to ~1 ms, PERFORMANCE.md). Table ``versions`` has one row per committed or
pending version: (inode, idx, pending, version, length, crc, block_crcs, cls, slot). The free
list is *not* stored: at open every slot not named by a row is free, so a crash can leak nothing.

Checksums: one CRC32C per 64 KiB block (``BLOCK``), stored as a little array in the row, so a
range read verifies only the blocks it touches. 64 KiB rather than 4 KiB because the block list
is rewritten with every version: a 64 MiB chunk carries 4 KiB of CRCs instead of 64 KiB, while a
4 KiB random read pays one 64 KiB read (~50 us on these disks) plus ~3 us of CRC. The whole-chunk
CRC (compared along the chain) is derived from the block CRCs without rereading data, using
linearity: crc(A+B) = M(crc(A)) ^ crc(B), M a fixed linear map on 32 bits for len(B) = BLOCK (four
table lookups). A write's CRC is checked the same way, from the block CRCs it stores, so the engine
reads a written byte once.

Crash safety (write-through)
----------------------------
A version's data is written into a slot no row names and fdatasync'ed *before* the row that
names it is committed to SQLite (one atomic, fsync'ed transaction). ``commit`` is one transaction
that deletes the old committed row and turns the pending row into the committed one. A slot is
reused only after the transaction that dropped its row is durable. Hence after kill -9 (or, with
fsync=True, power loss) each chunk is at its old or new committed version, and every row points
at complete, checksummed data. Pending versions survive a restart and are reported by
``meta().pending_version``: the replication layer commits or aborts them.

``commit(..., durable=False)`` (what the chain uses) skips the fsync of its transaction: one fsync
fewer per write and replica. It is written to the WAL (the page cache), so a kill -9 loses nothing;
a power loss may undo it, but SQLite recovers a prefix of the WAL's transactions, so it is undone
only together with everything after it, and the chunk is back at its old committed version with
the new one pending and complete (its data and row were fsync'ed before the commit): the state
of a crash just before the commit, which the replication layer already finishes (it re-commits a
persisted pending version, or resyncs the replica). The old committed version's slot stays out of
use until a durable transaction (every ``write_pending`` is one) has made the commit durable, so a
row that may come back never names reused space.

Direct I/O
----------
Slot data is written around the page cache (``O_DIRECT``): every page-aligned run of a write whose buffer is
page-aligned (a chunk server's received chunks are: they land in pooled page-aligned memory), and the rest (an
unaligned tail, blocks assembled from old and new bytes) through it. The chunk server's own buffers already
stage the data, so the page cache would only add a copy and memory per byte written: on a VM whose fresh
memory costs a host fault per page, a fresh target's writes took ~1.1-1.4 sys CPU-s per GiB buffered against
~0.15 direct (chunkserver/README.md, "Direct I/O"). Large reads (:meth:`ChunkEngine.lend`) come straight from
the disk the same way, into pooled page-aligned buffers; small ones through the page cache. Linux keeps the two
paths coherent (a direct write drops cached pages of its range, a direct read first writes back dirty ones). A
file system that refuses ``O_DIRECT`` (at open, or on a write or read) gets buffered writes and mapped loans,
with one log line.
Durability is unchanged: a direct write may still sit in the disk's cache, and the same fdatasync flushes it.

Write-back
----------
With ``write_through=False`` nothing is flushed before a write is acknowledged: :meth:`sync` flushes (the
slot files written since, then one fsync'ed transaction), and callers decide when (a client's fsync, a
timer, ``close``). A kill -9 still loses nothing. For a power loss, two records keep what a sync covered:
table ``unsynced`` lists every version staged since (in the transaction that publishes it), and a commit
keeps the newest synced committed version as a ``pending = 2`` row, slot included, until the next sync.
On open, every listed and every kept version is checked block by block: a torn pending version is dropped,
a torn committed one gives way to the kept one (and a pending one newer than that goes too), and the
replication layer resyncs the replica. Slots of rows dropped by a transaction not yet durable stay out of
use until a durable one; a write that would otherwise grow the slot file makes one (an fsync of the WAL).
Except the slot of a version no sync has covered (a commit drops one whenever a chunk is written twice between
syncs): should a power loss undo the drop, the row comes back listed in ``unsynced``, is found torn and gives
way, and a power loss may take such a version anyway. Its slot is reused at once, which spares a chain's
sequential writes the WAL fsync that every fifth chunk write or so needed (873 fdatasyncs in the first 12 s on
``kvfs up``, 71 since).

Held writes
-----------
With write-back and ``hold_bytes``, a write that is a whole new version (a full chunk, the way the mount flushes
a file written in order) is not written at all at first: the engine keeps the received buffer it arrived in
until a sync writes it out. If the chunk is written again before that, the new version's commit frees the old
one's slot and the held bytes are dropped: they never reach the disk. A program that rewrites a file within a
sync interval (a checkpoint saved every few seconds, fio's write job over one 256 MiB file) costs the disk one
copy per sync instead of one per write; on ``kvfs up`` that job wrote about 21 GiB to the disk in 12 s before,
1.7 GiB with held writes. Anything that reads a held version's slot (a read, a loan, a partial write's old blocks, a
short-circuit reader) writes it out first; past ``hold_bytes`` the oldest held versions are written out by the
writer that went past it.

What it costs: a kill -9 now loses what the target holds, as a power loss loses unflushed writes in plain
write-back. The versions were staged (their rows name slots the bytes never reached) and listed as unsynced,
so the reopened engine finds them torn and falls back to the synced ones, exactly as after a power loss, and the
chain resyncs the replica from its peers, which hold the same versions. Acknowledged writes are lost only if
every replica's process dies before a sync (or the host loses power), as with any page cache. ``hold_bytes = 0``
writes every version at once.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import sqlite3
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgspec
import prometheus_client
from crc32c import crc32c

from kvfs.crc import BLOCK, block_crcs, fold_crc
from kvfs.errors import ChecksumMismatch, KvfsError
from kvfs.pool import RECEIVED, page_aligned
from kvfs.transport.buffers import buffer_address

log = logging.getLogger("kvfs.chunkserver.engine")

HELD_BYTES = prometheus_client.Counter(
    "kvfs_chunk_held_bytes", "Bytes of whole-chunk writes held in memory for a sync, by what became of them: "
    "written (by a sync, a read, or to stay within hold_bytes) or dropped (superseded or removed first)", ["fate"])
HELD_NOW = prometheus_client.Gauge("kvfs_chunk_held_bytes_now", "Bytes of chunk writes held in memory now")

MIN_CLASS_LOG2 = 16
MAX_CLASS_LOG2 = 26
_FORMAT = 1


class ChunkId(NamedTuple):
    inode: int
    index: int


class ChunkMeta(msgspec.Struct, frozen=True):
    """One version of a chunk (``version``, ``length``, ``crc``) and where the chunk stands."""

    chunk_id: ChunkId
    version: int
    length: int
    crc: int
    committed_version: int
    pending_version: int | None = None


class Lent(NamedTuple):
    """Stored bytes lent without a copy (:meth:`ChunkEngine.lend`); ``release`` ends the loan."""

    data: memoryview
    release: Callable[[], None]


class VersionInfo(NamedTuple):
    version: int
    length: int
    crc: int
    aux: bytes


class StaleVersion(KvfsError):
    """A write names a version that is not newer than the committed one."""

    default_errno = errno.EALREADY


@dataclass(slots=True)
class _Version:
    version: int
    length: int
    crc: int
    blocks: array  # array('I') of per-BLOCK CRC32Cs
    cls: int  # log2 of the slot size; -1 only for the virtual empty version 0
    slot: int
    origin: tuple | None = None  # (offset, len, crc, new_len) of the write that made it, for retransmits
    aux: bytes = b""  # the replication layer's record for this version (e.g. its idempotency table)
    seq: int = 0  # write-back: its number in table unsynced; synced once a sync has covered it (0: synced)


_EMPTY = _Version(0, 0, 0, array("I"), -1, -1)


@dataclass(slots=True)
class _Entry:
    committed: _Version | None = None
    pending: _Version | None = None


@dataclass(slots=True)
class _SlotFile:
    path: Path
    fd: int
    size: int
    total: int
    free: list[int]
    direct: int = -1  # the same file opened O_DIRECT, or -1: writes go through the page cache


_GROW_BYTES = 256 << 20  # the most a slot file grows by at once (see ChunkEngine._grow)
#: What O_DIRECT needs aligned (buffer address, file offset, length): the page, which covers any disk's logical
#: block (512 B, or 4 KiB on 4Kn disks) without asking each file system.
DIRECT_ALIGN = mmap.PAGESIZE


def _class_for(length: int) -> int:
    return max(MIN_CLASS_LOG2, (max(length, 1) - 1).bit_length())


def _nblocks(length: int) -> int:
    return -(-length // BLOCK)


def _nothing() -> None:
    pass


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _direct_length(data: memoryview, offset: int) -> int:
    """How many leading bytes of ``data`` can be written at ``offset`` with ``O_DIRECT``: whole pages from a
    page-aligned, writable buffer (a read-only one has no address to check) to a page-aligned offset, else 0."""
    n = len(data) // DIRECT_ALIGN * DIRECT_ALIGN
    if not n or offset % DIRECT_ALIGN or data.readonly:
        return 0
    return n if buffer_address(data) % DIRECT_ALIGN == 0 else 0


def _checked_block_crcs(what: str, data: memoryview, crc: int, blocks: list[int] | None = None) -> list[int]:
    """CRCs of ``data``'s BLOCK-sized pieces, after checking that together they make ``crc``: one pass over the
    data serves both the check and the stored block CRCs. ``blocks``: those CRCs as the caller computed them
    (the chain member, which checks every write it accepts), so the data is not read again; only their count
    and their fold into ``crc`` are checked."""
    if blocks is None:
        blocks = block_crcs(data)
    elif len(blocks) != _nblocks(len(data)):
        raise KvfsError(f"{what}: {len(blocks)} block CRCs for {len(data)} bytes", errno.EINVAL)
    if fold_crc(blocks, len(data)) != crc:
        raise ChecksumMismatch(f"{what}: data does not match its CRC32C")
    return blocks


#: A statement that always changes a page, so a durable transaction with it fsyncs the WAL even when idle.
_COUNT_SYNC = ("UPDATE target SET value = value + 1 WHERE key = 'syncs'", ())

_SQL_BATCH = 500  # inodes per DELETE (SQLite allows 32766 parameters)


def _enospc(what: str) -> KvfsError:
    return KvfsError(what, errno.ENOSPC)


class ChunkEngine:
    """Chunk versions of one storage target. Thread-safe: big calls may run in worker threads while
    small cached ones (``meta``, ``list_chunks``, ``space``; ``local_location`` unless the version is held) run
    inline."""

    def __init__(
        self, root: Path, *, fsync: bool = True, write_through: bool = True, capacity_bytes: int | None = None,
        direct_io: bool = True, hold_bytes: int = 0,
    ) -> None:
        """``fsync=False`` never flushes (tests, scratch space). ``write_through=False`` acknowledges writes
        from the page cache and makes them durable at :meth:`sync` (see "Write-back" above). ``direct_io=False``
        writes slot data through the page cache too (see "Direct I/O"). ``hold_bytes``: with write-back, up to
        this many bytes of whole-version writes wait in memory for a sync (see "Held writes")."""
        self.root = Path(root)
        self._direct_io = direct_io
        self._refused_fds: list[int] = []
        self._fsync = fsync
        self._write_through = write_through
        self._write_back = fsync and not write_through  # tracks unsynced versions and keeps superseded ones
        self._hold_limit = hold_bytes if self._write_back else 0
        self._capacity = capacity_bytes
        self._lock = threading.Lock()  # in-memory state; never held across disk I/O except fallocate
        self._db_lock = threading.Lock()  # serialises metadata writers; held across the SQLite commit
        self._chunks: dict[int, dict[int, _Entry]] = {}
        self._pins: Counter[tuple[int, int]] = Counter()
        self._deferred: set[tuple[int, int]] = set()
        self._mappings: dict[int, memoryview] = {}  # size class -> read-only mapping of its slot file (lend)
        self._undurable_frees: list[tuple[int, int]] = []  # slots whose rows' removal is not yet fsync'ed
        self._superseded: dict[ChunkId, _Version] = {}  # write-back: the last synced committed version, until sync
        self._last_seq: dict[ChunkId, int] = {}  # write-back: each chunk's newest unsynced staging
        self._dirty_classes: set[int] = set()  # write-back: slot files written since the last sync
        self._db_dirty = False  # a transaction since the last fsync'ed one
        self._seq = 0  # the last unsynced staging's number
        self._covered_upto = 0  # stagings up to this number are covered by the latest sync begun (durable at its end)
        self._sync_lock = threading.Lock()  # one sync at a time; a caller's sync starts after its call
        self._held: dict[tuple[int, int], memoryview] = {}  # slot -> its version's unwritten bytes, oldest first
        self._held_bytes = 0
        self._writing: dict[tuple[int, int], bool] = {}  # slot being written out from _held -> freed meanwhile
        self._written = threading.Condition(self._lock)  # a write-out ended
        self._used = 0
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        self._lockfd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lockfd)
            raise KvfsError(f"target {self.root} is open in another engine", errno.EBUSY) from None
        self._db = sqlite3.connect(self.root / "chunks.sqlite", check_same_thread=False, isolation_level=None)
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
                PRIMARY KEY (inode, idx, pending)) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS unsynced(
                seq INTEGER PRIMARY KEY, inode INTEGER NOT NULL, idx INTEGER NOT NULL, version INTEGER NOT NULL);
            INSERT OR IGNORE INTO target VALUES ('format', 1), ('block', 65536), ('syncs', 0);
            """
        )
        fmt = dict(self._db.execute("SELECT key, value FROM target"))
        if (fmt.get("format"), fmt.get("block")) != (_FORMAT, BLOCK):
            raise KvfsError(f"target {self.root} has unsupported format {fmt}", errno.EINVAL)
        self._files = {c: self._open_slot_file(c) for c in range(MIN_CLASS_LOG2, MAX_CLASS_LOG2 + 1)}
        if direct_io and any(f.direct < 0 for f in self._files.values()):
            log.warning("target %s: its file system refuses O_DIRECT; slot data is written through the page cache",
                        self.root)
        self._drop_torn_versions()
        self._load()
        if fsync:
            for d in (self.root, self.root / "data"):
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)

    def _open_slot_file(self, cls: int) -> _SlotFile:
        path = self.root / "data" / f"{cls:02d}.dat"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        size = 1 << cls
        direct = -1
        if self._direct_io:
            try:
                direct = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    os.close(fd)
                    raise
        return _SlotFile(path, fd, size, os.fstat(fd).st_size // size, [], direct)

    def _drop_torn_versions(self) -> None:
        """After a crash in write-back mode, check every version staged since the last sync: a power loss may
        have kept its row but not all of its data. A torn committed version gives way to the synced one it
        superseded (a torn pending one, or one newer than a restored one, is dropped: the chain resyncs it), so
        nothing a sync covered is lost. Then everything is synced and no superseded version is needed."""
        leftovers = "SELECT 1 FROM unsynced UNION ALL SELECT 1 FROM versions WHERE pending=2"
        if self._db.execute(leftovers).fetchone() is None:
            return
        rows = self._db.execute(
            "SELECT v.inode, v.idx, v.pending, v.version, v.length, v.crc, v.block_crcs, v.cls, v.slot"
            " FROM unsynced u JOIN versions v ON v.inode=u.inode AND v.idx=u.idx AND v.version=u.version"
            " AND v.pending < 2 UNION SELECT inode, idx, pending, version, length, crc, block_crcs, cls, slot"
            " FROM versions WHERE pending=2"
        ).fetchall()
        torn: dict[tuple[int, int], dict[int, int]] = {}  # chunk -> {pending state: version} of its torn versions
        for inode, idx, pending, version, length, crc, blob, cls, slot in rows:
            try:
                self._read_verified(_Version(version, length, crc, array("I", blob), cls, slot), 0,
                                    memoryview(bytearray(length)))
            except ChecksumMismatch:
                torn.setdefault((inode, idx), {})[pending] = version
        statements: list[tuple[str, tuple]] = []
        for chunk, states in torn.items():
            if 0 in states:  # back to the superseded version, if it is whole; what was newer goes too
                statements.append(("DELETE FROM versions WHERE inode=? AND idx=? AND pending<2", chunk))
                if 2 in states:
                    fallback = "its superseded version was torn too: gone from this replica"
                else:
                    fallback = "back at the version the last sync made durable, if any"
                    statements.append(("UPDATE versions SET pending=0 WHERE inode=? AND idx=? AND pending=2", chunk))
                log.warning("target %s: chunk %s v%d was torn by a crash before a sync; %s (the chain resyncs the"
                            " replica)", self.root, chunk, states[0], fallback)
            elif 1 in states:
                statements.append(("DELETE FROM versions WHERE inode=? AND idx=? AND pending=1", chunk))
                log.warning("target %s: pending chunk %s v%d was torn by a crash before a sync; dropped it",
                            self.root, chunk, states[1])
        if self._fsync:
            for f in self._files.values():  # what was checked came from the page cache: make it what the disk holds
                os.fdatasync(f.fd)
        self._execute(*statements, ("DELETE FROM versions WHERE pending=2", ()), ("DELETE FROM unsynced", ()),
                      durable=True)

    def _load(self) -> None:
        """Rebuild the index from the rows; every slot no row names is free."""
        used: set[tuple[int, int]] = set()
        for inode, idx, pending, version, length, crc, blob, cls, slot, aux in self._db.execute(
            "SELECT inode, idx, pending, version, length, crc, block_crcs, cls, slot, aux FROM versions"
        ):
            v = _Version(version, length, crc, array("I", blob), cls, slot, aux=aux)
            entry = self._chunks.setdefault(inode, {}).setdefault(idx, _Entry())
            if pending:
                entry.pending = v
            else:
                entry.committed = v
            used.add((cls, slot))
            self._used += 1 << cls
        for cls, f in self._files.items():
            f.free = [s for s in range(f.total - 1, -1, -1) if (cls, s) not in used]

    def close(self) -> None:
        """Sync, then release files and the target lock; the engine is unusable afterwards."""
        try:
            self.sync()
        finally:
            self._close_files()

    def _close_files(self) -> None:
        self._db.close()
        self._mappings.clear()  # each mapping goes when the last view of it does
        for f in self._files.values():
            os.close(f.fd)
            if f.direct >= 0:
                os.close(f.direct)
        for fd in self._refused_fds:
            os.close(fd)
        os.close(self._lockfd)

    def __enter__(self) -> ChunkEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- slots and pins (hold _lock)

    def _alloc(self, length: int, *, grow: bool = True) -> tuple[int, int] | None:
        """A free slot for ``length`` bytes; without one, a new slot at the end of the file, or None if not ``grow``."""
        cls = _class_for(length)
        if cls > MAX_CLASS_LOG2:
            raise KvfsError(f"chunk length {length} exceeds {1 << MAX_CLASS_LOG2}", errno.EINVAL)
        f = self._files[cls]
        if self._capacity is not None and self._used + f.size > self._capacity:
            raise _enospc(f"target {self.root} full: {self._used} of {self._capacity} bytes used")
        if f.free:
            slot = f.free.pop()
        elif not grow:
            return None
        else:
            slot = f.total
            f.total += self._grow(f)
            f.free.extend(range(f.total - 1, slot, -1))  # the rest of the step, lowest first
        self._used += f.size
        return cls, slot

    def _grow(self, f: _SlotFile) -> int:
        """Add slots at the end of ``f`` (the caller holds ``_lock``) and return how many: as many as it has, up to
        ``_GROW_BYTES``. Each fallocate waits for the file system's journal, which a flush of much fresh data holds
        for up to ~0.1 s, and every engine call waits for ``_lock`` meanwhile: a file that grows slot by slot took
        147 of them in the first 8 s of a fresh target's sequential writes. A sync that writes out held versions
        is such a flush, and it also holds the file's inode lock that fallocate needs; with 64 MiB steps, fio's
        first write job on a fresh ``kvfs up`` stalled for half seconds at a time (552-830 MB/s, eleven runs), with
        256 MiB steps it did not (745-888, five runs). A disk too full for the step still gets a single slot."""
        step = max(1, min(f.total, _GROW_BYTES // f.size))
        while True:
            try:
                os.posix_fallocate(f.fd, f.total * f.size, step * f.size)
                return step
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if step == 1:
                    raise _enospc(f"disk of target {self.root} is full") from e
                step = 1

    def _free(self, cls: int, slot: int) -> None:
        if slot < 0:
            return
        key = (cls, slot)
        if self._pins[key]:
            self._deferred.add(key)
            return
        held = self._pop_held(key)
        if held is not None:  # superseded or removed before a sync wrote it: it never reaches the disk
            HELD_BYTES.labels("dropped").inc(len(held))
        if key in self._writing:  # reused only once the write-out under way has ended
            self._writing[key] = True
            return
        self._files[cls].free.append(slot)
        self._used -= 1 << cls

    def _retire(self, v: _Version, durable: bool) -> None:
        """Free the slot of a version whose row a transaction just dropped. While that transaction may still be
        undone by a power loss, the row may come back, so the slot stays out of use until a durable one; unless
        no sync has covered the version (write-back): a power loss may take such a version anyway, and recovery
        checks it block by block (table ``unsynced`` lists it), so a row that comes back over reused space is
        found torn and gives way."""
        if durable or (self._write_back and v.seq > self._covered_upto):
            self._free(v.cls, v.slot)
        else:
            self._undurable_frees.append((v.cls, v.slot))

    def _pin(self, v: _Version) -> None:
        if v.slot >= 0:
            self._pins[(v.cls, v.slot)] += 1

    def _unpin(self, v: _Version) -> None:
        key = (v.cls, v.slot)
        if v.slot < 0:
            return
        self._pins[key] -= 1
        if not self._pins[key]:
            del self._pins[key]
            if key in self._deferred:
                self._deferred.discard(key)
                self._free(*key)

    def _entry(self, cid: ChunkId) -> _Entry | None:
        return self._chunks.get(cid.inode, {}).get(cid.index)

    def _meta(self, cid: ChunkId, v: _Version, entry: _Entry) -> ChunkMeta:
        committed = entry.committed.version if entry.committed else 0
        pending = entry.pending.version if entry.pending else None
        return ChunkMeta(cid, v.version, v.length, v.crc, committed, pending)

    # ------------------------------------------------------------------------------ data I/O

    def _read_verified(self, v: _Version, offset: int, out: memoryview, nowait: bool = False) -> None:
        """Fill ``out`` with bytes [offset, offset+len(out)) of version ``v``, reading whole blocks
        (head and tail into scratch, the middle straight into ``out``) and checking each block's CRC.
        ``nowait``: only from the page cache; BlockingIOError if any of it would wait for the disk."""
        n = len(out)
        if n == 0:
            return
        end = offset + n
        lo = offset // BLOCK * BLOCK
        hi = min(_nblocks(end) * BLOCK, v.length)
        head, tail = memoryview(bytearray(offset - lo)), memoryview(bytearray(hi - end))
        f = self._files[v.cls]
        got = os.preadv(f.fd, [b for b in (head, out, tail) if len(b)], v.slot * f.size + lo,
                        os.RWF_NOWAIT if nowait else 0)
        if got != hi - lo and nowait:
            raise BlockingIOError(errno.EAGAIN, "partly outside the page cache")
        if got != hi - lo:
            raise ChecksumMismatch(f"{f.path} slot {v.slot}: short read ({got} of {hi - lo} bytes)")
        segments = ((lo, head), (offset, out), (end, tail))
        for b in range(lo // BLOCK, _nblocks(hi)):
            blo, bhi = b * BLOCK, min(b * BLOCK + BLOCK, v.length)
            crc = 0
            for start, buf in segments:
                s, t = max(blo, start), min(bhi, start + len(buf))
                if s < t:
                    crc = crc32c(buf[s - start : t - start], value=crc)
            if crc != v.blocks[b]:
                raise ChecksumMismatch(f"{f.path} slot {v.slot} block {b}: stored data is corrupt")

    def _copy(self, old: _Version, lo: int, hi: int, dst: _SlotFile, dst_off: int) -> None:
        """Copy unchanged bytes of the old version in the kernel; their block CRCs carry over, so
        corruption in them stays detectable instead of being laundered into a fresh CRC."""
        src = self._files[old.cls]
        src_off = old.slot * src.size + lo
        while lo < hi:
            n = os.copy_file_range(src.fd, dst.fd, hi - lo, src_off, dst_off)
            if n <= 0:
                raise ChecksumMismatch(f"{src.path} slot {old.slot}: ends early")
            lo, src_off, dst_off = lo + n, src_off + n, dst_off + n

    def _pwrite(self, f: _SlotFile, data: memoryview, offset: int) -> None:
        """Write ``data`` at ``offset`` of ``f``: its page-aligned head around the page cache where it can (see
        "Direct I/O"), the rest through it."""
        n = _direct_length(data, offset) if f.direct >= 0 else 0
        if n:
            try:
                _write_all(f.direct, data[:n], offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._stop_direct(f, e)
                n = 0  # all of it again, through the page cache
        _write_all(f.fd, data[n:], offset + n)

    def _hold(self, cls: int, slot: int, data: memoryview) -> bool:
        """Keep ``data``, a whole new version for ``slot``, in memory instead of writing it now (see "Held
        writes"); False where it must be written at once. Only bytes nobody can change are held: an immutable
        ``bytes``, or a buffer mapped for a received data section (the pool reuses it only once this view is gone).
        Past ``hold_bytes`` the oldest held versions are written out, by the thread that went past it."""
        if not self._hold_limit or len(data) > self._hold_limit or not isinstance(data.obj, (bytes, mmap.mmap)):
            return False
        with self._lock:
            self._put_held((cls, slot), data)
        while self._held_bytes > self._hold_limit:
            with self._lock:
                oldest = next(iter(self._held), None)
            if oldest is None:
                break
            self._write_held(oldest)
        return True

    def _put_held(self, key: tuple[int, int], data: memoryview) -> None:
        """(Caller holds ``_lock``.)"""
        self._held[key] = data
        self._held_bytes += len(data)
        HELD_NOW.inc(len(data))

    def _pop_held(self, key: tuple[int, int]) -> memoryview | None:
        """Slot ``key``'s held bytes, no longer held; None if it has none. (Caller holds ``_lock``.)"""
        data = self._held.pop(key, None)
        if data is not None:
            self._held_bytes -= len(data)
            HELD_NOW.dec(len(data))
        return data

    def _settle(self, v: _Version, nowait: bool = False) -> None:
        """Make sure ``v``'s bytes are in its slot (written out if held) before they are read from it.
        ``nowait``: BlockingIOError instead of writing them out (a read that must not wait for the disk)."""
        key = (v.cls, v.slot)
        if key in self._held or key in self._writing:
            if nowait:
                raise BlockingIOError(errno.EAGAIN, "held in memory, not written yet")
            self._write_held(key)

    def _write_held(self, key: tuple[int, int]) -> None:
        """Write out slot ``key``'s held bytes, if it still has any; or wait for the write-out under way. A slot
        freed meanwhile goes back to the free list once the bytes have landed, so no new version is written into
        it under them."""
        with self._lock:
            while key in self._writing:
                self._written.wait()
            data = self._pop_held(key)
            if data is None:
                return
            self._writing[key] = False
        cls, slot = key
        written = False
        try:
            self._pwrite(self._files[cls], data, slot << cls)
            written = True
        finally:
            with self._lock:
                freed = self._writing.pop(key)
                if freed:
                    self._free(cls, slot)
                elif not written:  # kept for the next try (a sync that failed tries again)
                    self._put_held(key, data)
                self._written.notify_all()
            if written:
                HELD_BYTES.labels("written").inc(len(data))

    def _stop_direct(self, f: _SlotFile, why: OSError) -> None:
        """The file system took ``O_DIRECT`` at open but refuses a write or read with it: use the page cache."""
        with self._lock:
            if f.direct < 0:
                return
            self._refused_fds.append(f.direct)  # closed with the engine: another thread may be writing with it
            f.direct = -1
        log.warning("target %s: %s refuses direct I/O (%s); using the page cache for it", self.root, f.path.name,
                    why.strerror)

    def _fill(self, old: _Version, cls: int, slot: int, offset: int, data: memoryview, new_len: int,
              data_blocks: list[int]) -> array:
        """Write the new version (old, with ``data`` at ``offset``, cut or zero-extended to
        ``new_len``) into the slot; return its block CRCs. Runs of blocks wholly from ``data``
        are written in one pwrite, runs wholly unchanged are copied in the kernel, and blocks
        that mix old bytes, new bytes or zeros are assembled in memory. ``data_blocks`` are the CRCs of
        ``data``'s own BLOCK pieces: a block-aligned write reuses them instead of reading the data again."""
        dst = self._files[cls]
        base = slot * dst.size
        end = offset + len(data)
        if offset == 0 and end == new_len:  # the whole new version is the write (a full chunk, say): one pwrite
            if not self._hold(cls, slot, data):
                self._pwrite(dst, data, base)
            return array("I", data_blocks)
        self._settle(old)  # its bytes are read or copied below
        crcs = array("I")

        def kind(b: int) -> int:
            lo, hi = b * BLOCK, min(b * BLOCK + BLOCK, new_len)
            if len(data) and offset <= lo and hi <= end:
                return 0  # all new data
            untouched = not len(data) or hi <= offset or lo >= end
            if untouched and lo < old.length and hi == min(lo + BLOCK, old.length):
                return 1  # the old block as it was
            return 2  # mixed: assemble

        b, nblocks = 0, _nblocks(new_len)
        while b < nblocks:
            k = kind(b)
            e = b + 1
            while k != 2 and e < nblocks and kind(e) == k:
                e += 1
            lo, hi = b * BLOCK, min(e * BLOCK, new_len)
            if k == 0:
                self._pwrite(dst, data[lo - offset : hi - offset], base + lo)
                if offset % BLOCK == 0:
                    crcs.extend(data_blocks[(lo - offset) // BLOCK : (hi - offset + BLOCK - 1) // BLOCK])
                else:
                    crcs.extend(crc32c(data[x - offset : min(x + BLOCK, hi) - offset]) for x in range(lo, hi, BLOCK))
            elif k == 1:
                self._copy(old, lo, hi, dst, base + lo)
                crcs.extend(old.blocks[b:e])
            else:
                buf = memoryview(bytearray(hi - lo))
                keep = min(hi, old.length) - lo
                if keep > 0:
                    self._read_verified(old, lo, buf[:keep])
                s, t = max(lo, offset), min(hi, end)
                if s < t:
                    buf[s - lo : t - lo] = data[s - offset : t - offset]
                self._pwrite(dst, buf, base + lo)
                crcs.append(crc32c(buf))
            b = e
        return crcs

    # ------------------------------------------------------------------------------ public API

    def write_pending(
        self,
        chunk_id: ChunkId,
        version: int,
        offset: int,
        data: bytes | bytearray | memoryview,
        crc: int,
        *,
        full_replace: bool = False,
        chunk_size: int,
        aux: bytes = b"",
        force: bool = False,
        block_crcs: list[int] | None = None,
    ) -> ChunkMeta:
        """Stage ``version`` = committed version with ``data`` at ``offset`` (or exactly ``data``).

        ``aux`` is stored with the version, atomically with it, for the replication layer (see :meth:`versions`).
        ``force`` stages a full replace even if ``version`` is not newer (a resyncing replica overwriting
        what it held before; the commit that follows makes it the committed version).

        Raises ChecksumMismatch (nothing touched) if ``crc32c(data) != crc``, EINVAL past
        ``chunk_size``, ENOSPC when full, StaleVersion if ``version`` is not newer than the
        committed one. A retransmit of the staged (or just committed) write returns its meta.
        A different pending version replaces the current one: the replication layer decides.
        ``block_crcs``: the CRC32Cs of ``data``'s BLOCK pieces when the caller has already computed them
        (:func:`kvfs.crc.block_crcs`); they must fold into ``crc``, and the data is not read again.
        """
        data = memoryview(data).cast("B")
        data_blocks = _checked_block_crcs(f"chunk {chunk_id} v{version}", data, crc, block_crcs)
        if offset < 0 or offset + len(data) > chunk_size or (full_replace and offset):
            raise KvfsError(
                f"chunk {chunk_id}: write [{offset}, {offset + len(data)}) outside chunk of {chunk_size}",
                errno.EINVAL,
            )
        if force and not full_replace:
            raise KvfsError(f"chunk {chunk_id}: only a full replace may be forced", errno.EINVAL)
        return self._stage(chunk_id, version, offset, data, data_blocks, crc, full_replace=full_replace, force=force,
                           aux=aux)

    def _stage(
        self, cid: ChunkId, version: int, offset: int, data: memoryview, data_blocks: list[int], crc: int,
        *, full_replace: bool, force: bool, new_len: int | None = None, aux: bytes = b"",
    ) -> ChunkMeta:
        asked_len = new_len
        for last_try in (False, True):
            with self._lock:
                entry = self._entry(cid) or _Entry()
                old = entry.committed or _EMPTY
                new_len = asked_len
                if new_len is None:
                    new_len = len(data) if full_replace else max(old.length, offset + len(data))
                origin = (offset, len(data), crc, new_len)
                for v in (entry.pending, entry.committed):
                    if not force and v is not None and v.version == version and v.origin == origin:
                        return self._meta(cid, v, entry)
                if not force and version <= old.version:
                    raise StaleVersion(f"chunk {cid}: v{version} is not newer than committed v{old.version}")
                # A new slot costs the page cache fresh pages and the file system an extent conversion on
                # writeback, several times what reusing one costs: reuse slots that only wait for a durable
                # transaction (write-back leaves them waiting until one runs) rather than grow the file.
                full = False
                try:
                    got = self._alloc(new_len, grow=last_try or not (self._write_back and self._undurable_frees))
                except KvfsError as e:
                    if e.errno != errno.ENOSPC or last_try or not (self._undurable_frees or self._superseded):
                        raise
                    got, full = None, True
                if got is not None:
                    cls, slot = got
                    self._pin(old)
                    break
            if full:
                self.sync()  # also frees the superseded versions' slots
            else:
                with self._db_lock:  # an fsync of the WAL alone makes the rows' removal durable
                    self._execute(_COUNT_SYNC, durable=True)
        try:
            try:
                blocks = self._fill(old, cls, slot, offset, data, new_len, data_blocks)
                if self._fsync and self._write_through:
                    os.fdatasync(self._files[cls].fd)
                elif self._write_back:
                    with self._lock:
                        self._dirty_classes.add(cls)
            finally:
                self._release(old)
            whole = crc if full_replace or (offset == 0 and len(data) == new_len) else fold_crc(blocks, new_len)
            staged = _Version(version, new_len, whole, blocks, cls, slot, origin, aux)
            return self._publish_pending(cid, staged, force)
        except BaseException as e:
            with self._lock:
                self._free(cls, slot)
            if isinstance(e, OSError) and not isinstance(e, KvfsError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _enospc(f"disk of target {self.root} is full") from e
            raise

    def _publish_pending(self, cid: ChunkId, v: _Version, force: bool) -> ChunkMeta:
        with self._db_lock:
            entry = self._entry(cid) or _Entry()
            committed = entry.committed.version if entry.committed else 0
            if not force and v.version <= committed:
                raise StaleVersion(f"chunk {cid}: v{v.version} is not newer than committed v{committed}")
            statements = [(
                "INSERT OR REPLACE INTO versions VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?, ?)",
                (cid.inode, cid.index, v.version, v.length, v.crc, v.blocks.tobytes(), v.cls, v.slot, v.aux),
            )]
            if self._write_back:
                statements.append(("INSERT INTO unsynced VALUES (?, ?, ?, ?)",
                                   (self._seq + 1, cid.inode, cid.index, v.version)))
            durable = self._execute(*statements, durable=self._write_through)
            with self._lock:
                if self._write_back:
                    self._seq += 1
                    self._last_seq[cid] = v.seq = self._seq
                entry = self._chunks.setdefault(cid.inode, {}).setdefault(cid.index, entry)
                if entry.pending is not None:
                    self._retire(entry.pending, durable)
                entry.pending = v
                return self._meta(cid, v, entry)

    def _execute(self, *statements: tuple[str, tuple], durable: bool) -> bool:
        """Run statements as one transaction (the caller holds ``_db_lock``); a full disk becomes ENOSPC with
        nothing changed. ``durable=False`` leaves out its fsync (see "Crash safety"); a durable one also makes
        every earlier one durable, so the slots those dropped become free. Returns whether it is durable (always,
        without fsync: nothing survives a power loss then anyway)."""
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
                raise _enospc(f"metadata of target {self.root}: {e}") from e
            raise KvfsError(f"metadata of target {self.root}: {e}", errno.EIO) from e
        self._db_dirty = lazy
        if not lazy and self._undurable_frees:
            with self._lock:
                for cls, slot in self._undurable_frees:
                    self._free(cls, slot)
                self._undurable_frees.clear()
        return not lazy

    def commit(self, chunk_id: ChunkId, version: int, *, durable: bool = True) -> ChunkMeta:
        """Make pending ``version`` the committed one (atomic); idempotent once it is committed.
        ``durable=False``: without an fsync of its own; a power loss may leave the version pending (see
        "Crash safety")."""
        with self._db_lock:
            entry = self._entry(chunk_id)
            if entry is None or entry.pending is None or entry.pending.version != version:
                if entry is not None and entry.committed is not None and entry.committed.version == version:
                    return self._meta(chunk_id, entry.committed, entry)
                raise KvfsError(f"chunk {chunk_id}: no pending v{version} to commit", errno.ENOENT)
            key = (chunk_id.inode, chunk_id.index)
            old = entry.committed
            # Write-back keeps the newest synced committed version until a sync, for a power loss to fall back to.
            keep = self._write_back and old is not None and old.seq <= self._covered_upto
            dropped = self._superseded.get(chunk_id) if keep else old
            statements = [("UPDATE versions SET pending=0 WHERE inode=? AND idx=? AND pending=1", key)]
            if keep:
                statements[:0] = [("DELETE FROM versions WHERE inode=? AND idx=? AND pending=2", key),
                                  ("UPDATE versions SET pending=2 WHERE inode=? AND idx=? AND pending=0", key)]
            else:
                statements[:0] = [("DELETE FROM versions WHERE inode=? AND idx=? AND pending=0", key)]
            durable = self._execute(*statements, durable=durable and self._write_through)
            with self._lock:
                if keep:
                    self._superseded[chunk_id] = old
                if dropped is not None:
                    self._retire(dropped, durable)
                entry.committed, entry.pending = entry.pending, None
                return self._meta(chunk_id, entry.committed, entry)

    def sync(self) -> None:
        """Make every version staged, committed or removed before this call durable (a client's fsync, a periodic
        flush, close). Cheap when nothing changed; without write-back only the chain's lazy commits need it."""
        if not self._fsync:
            return
        with self._sync_lock:
            with self._db_lock, self._lock:
                if not (self._dirty_classes or self._db_dirty or self._superseded):
                    return
                classes, self._dirty_classes = self._dirty_classes, set()
                upto, covered_before, self._covered_upto = self._seq, self._covered_upto, self._seq
                # every version staged up to ``upto`` whose bytes are held or being written out is among these
                held = [*self._held, *self._writing]
            try:
                for key in held:
                    self._write_held(key)
                    classes.add(key[0])
                for cls in sorted(classes):
                    os.fdatasync(self._files[cls].fd)
                with self._db_lock:
                    with self._lock:  # chunks staged after the snapshot keep their fallback until the next sync
                        released = [(cid, v) for cid, v in self._superseded.items()
                                    if self._last_seq.get(cid, 0) <= upto]
                    self._execute(
                        ("DELETE FROM unsynced WHERE seq <= ?", (upto,)),
                        _COUNT_SYNC,
                        *(("DELETE FROM versions WHERE inode=? AND idx=? AND pending=2", c) for c, _ in released),
                        durable=True,
                    )
                    with self._lock:
                        for cid, v in released:
                            del self._superseded[cid]
                            self._free(v.cls, v.slot)
                        self._last_seq = {cid: seq for cid, seq in self._last_seq.items() if seq > upto}
            except OSError:
                with self._lock:  # still not durable: the next sync tries again (its rows stay listed meanwhile)
                    self._dirty_classes |= classes
                    self._covered_upto = covered_before
                raise

    def abort(self, chunk_id: ChunkId, version: int) -> None:
        """Drop pending ``version`` if it is there (idempotent)."""
        with self._db_lock:
            entry = self._entry(chunk_id)
            if entry is None or entry.pending is None or entry.pending.version != version:
                return
            durable = self._execute(("DELETE FROM versions WHERE inode=? AND idx=? AND pending=1", tuple(chunk_id)),
                                    durable=self._write_through)
            with self._lock:
                self._retire(entry.pending, durable)
                entry.pending = None
                self._forget_if_empty(chunk_id, entry)

    def _forget_if_empty(self, cid: ChunkId, entry: _Entry) -> None:
        if entry.committed is None and entry.pending is None:
            files = self._chunks.get(cid.inode, {})
            files.pop(cid.index, None)
            if not files:
                self._chunks.pop(cid.inode, None)

    def read(
        self,
        chunk_id: ChunkId,
        offset: int,
        length: int,
        *,
        version: int | None = None,
        into: memoryview | None = None,
        nowait: bool = False,
    ) -> tuple[bytearray | int, ChunkMeta]:
        """Read up to ``length`` bytes at ``offset`` of the committed version (or the named one),
        verifying the CRC of every block touched. Returns a new bytearray, or the byte count when
        ``into`` is given (filled without an extra copy). Raises ENOENT for a missing chunk or
        version and ChecksumMismatch for corrupt data (serve from another replica, then repair).
        ``nowait`` reads only what is in the page cache and raises BlockingIOError otherwise, so an
        event loop can read cached data itself and leave the rest to a thread."""
        v, meta = self._pin_version(chunk_id, version)
        try:
            self._settle(v, nowait)
            n = self._readable(chunk_id, v, offset, length)
            if into is not None:
                out = memoryview(into).cast("B")
                n = min(n, len(out))
                out = out[:n]
            else:
                out = memoryview(bytearray(n))
            self._read_verified(v, offset, out, nowait)
        finally:
            self._release(v)
        return (n if into is not None else out.obj), meta

    def lend(self, chunk_id: ChunkId, offset: int, length: int, version: int) -> Lent:
        """Bytes [offset, offset+length) of ``version`` (cut at its end), their blocks' CRCs checked, without a copy
        by the CPU: read from the disk with direct I/O into a pooled page-aligned buffer (see "Direct I/O"), or, on
        a file system that refuses it, as a read-only view of the slot file's mapping (a copy out of the page cache
        costs more here than the CRC and the socket send together: README, "Reads"). A mapped version's slot
        stays pinned, so not reused, until ``release()``; call it once the bytes have left (an unreleased loan
        only keeps one slot out of use). This waits for the disk: call it from a worker thread. Raises as
        :meth:`read`."""
        v, _ = self._pin_version(chunk_id, version)
        try:
            self._settle(v)
            n = self._readable(chunk_id, v, offset, length)
            data = self._read_direct(v, offset, n) if n else memoryview(b"")
            if data is None:
                return self._lend_mapped(v, offset, n)
        except BaseException:
            self._release(v)
            raise
        self._release(v)  # the bytes are in our own buffer now
        return Lent(data, _nothing)

    def _read_direct(self, v: _Version, offset: int, n: int) -> memoryview | None:
        """``n`` bytes at ``offset`` of ``v`` read around the page cache (the blocks they touch, checked), or None
        where the file system does not take direct reads."""
        f = self._files[v.cls]
        fd = f.direct
        if fd < 0:
            return None
        lo = offset // BLOCK * BLOCK
        hi = min(_nblocks(offset + n) * BLOCK, v.length)
        span = -(-(hi - lo) // DIRECT_ALIGN) * DIRECT_ALIGN
        pooled = RECEIVED.take(1 << (span - 1).bit_length())
        if not isinstance(pooled, mmap.mmap):  # small, or the pool is full: a bytearray is not page-aligned
            pooled = page_aligned(span)
        buf = memoryview(pooled)[:span]
        try:
            got = os.preadv(fd, [buf], v.slot * f.size + lo)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._stop_direct(f, e)
            return None
        if got < hi - lo:
            raise ChecksumMismatch(f"{f.path} slot {v.slot}: short read ({got} of {hi - lo} bytes)")
        self._check_blocks(v, lo, buf[: hi - lo])
        return buf[offset - lo : offset - lo + n]

    def _lend_mapped(self, v: _Version, offset: int, n: int) -> Lent:
        mapped = self._mapping(v)
        base = v.slot * self._files[v.cls].size
        lo = offset // BLOCK * BLOCK
        self._check_blocks(v, lo, mapped[base + lo : base + min(_nblocks(offset + n) * BLOCK, v.length)])
        return Lent(mapped[base + offset : base + offset + n], lambda: self._release(v))

    def _check_blocks(self, v: _Version, start: int, data: memoryview | bytes) -> None:
        """Check ``data``, the bytes of ``v`` from block boundary ``start`` on, against the blocks' CRCs."""
        for at in range(0, len(data), BLOCK):
            b = (start + at) // BLOCK
            if crc32c(data[at : at + BLOCK]) != v.blocks[b]:
                raise ChecksumMismatch(f"{self._files[v.cls].path} slot {v.slot} block {b}: stored data is corrupt")

    def _release(self, v: _Version) -> None:
        """Unpin ``v`` (see :meth:`_pin_version`)."""
        with self._lock:
            self._unpin(v)

    def _mapping(self, v: _Version) -> memoryview:
        """A read-only mapping of ``v``'s slot file that covers its slot. Slot files only grow, so a mapping stays
        valid; one that ends before the slot is replaced by a mapping of the whole file as it is now (views of
        the old one keep it alive until they are gone)."""
        f = self._files[v.cls]
        end = (v.slot + 1) * f.size
        with self._lock:
            mapped = self._mappings.get(v.cls)
            if mapped is None or len(mapped) < end:
                mapped = memoryview(mmap.mmap(f.fd, f.total * f.size, prot=mmap.PROT_READ))
                self._mappings[v.cls] = mapped
            return mapped

    def _pin_version(self, chunk_id: ChunkId, version: int | None) -> tuple[_Version, ChunkMeta]:
        """The named version (the committed one if None), pinned: its slot is not reused until unpinned."""
        with self._lock:
            entry = self._entry(chunk_id)
            candidates = () if entry is None else (entry.committed, entry.pending)
            if version is None:
                candidates = candidates[:1]
            v = next((x for x in candidates if x is not None and version in (None, x.version)), None)
            if v is None:
                raise KvfsError(f"chunk {chunk_id} v{version if version is not None else 'committed'} not found",
                                errno.ENOENT)
            meta = self._meta(chunk_id, v, entry)
            self._pin(v)
        return v, meta

    @staticmethod
    def _readable(chunk_id: ChunkId, v: _Version, offset: int, length: int) -> int:
        """How many of ``length`` bytes at ``offset`` ``v`` holds."""
        if offset < 0 or length < 0:
            raise KvfsError(f"chunk {chunk_id}: bad range {offset}+{length}", errno.EINVAL)
        return max(0, min(length, v.length - offset))

    def versions(self, chunk_id: ChunkId) -> tuple[VersionInfo | None, VersionInfo | None]:
        """(committed, pending) versions of a chunk with their ``aux`` records; what a restarted replica resumes from."""
        with self._lock:
            entry = self._entry(chunk_id)
            if entry is None:
                return None, None
            return tuple(  # type: ignore[return-value]
                None if v is None else VersionInfo(v.version, v.length, v.crc, v.aux)
                for v in (entry.committed, entry.pending)
            )

    def meta(self, chunk_id: ChunkId) -> ChunkMeta | None:
        """The committed version (version 0, empty, if only a pending one exists), or None."""
        with self._lock:
            entry = self._entry(chunk_id)
            return None if entry is None else self._meta(chunk_id, entry.committed or _EMPTY, entry)

    def list_chunks(self, inode: int | None = None) -> Iterator[ChunkMeta]:
        """Metas of all chunks (of one inode), ordered by (inode, index); a snapshot, safe to iterate slowly."""
        with self._lock:
            inodes = [inode] if inode is not None else sorted(self._chunks)
            metas = [
                self._meta(ChunkId(i, x), e.committed or _EMPTY, e)
                for i in inodes
                for x, e in sorted(self._chunks.get(i, {}).items())
            ]
        return iter(metas)

    def remove_files(self, inodes: list[int]) -> int:
        """Delete every chunk of these inodes in one transaction; returns how many chunks there were."""
        with self._lock:
            inodes = [i for i in inodes if i in self._chunks]
            ids = [ChunkId(i, x) for i in inodes for x in self._chunks[i]]
        removed = 0
        for start in range(0, len(inodes), _SQL_BATCH):
            part = inodes[start : start + _SQL_BATCH]
            mine = set(part)
            removed += self._remove(f"inode IN ({','.join('?' * len(part))})", tuple(part),
                                    [c for c in ids if c.inode in mine])
        return removed

    def remove_from(self, inode: int, first: int) -> int:
        """Delete the chunks of ``inode`` at index ``first`` and beyond (a truncation's tail) in one transaction
        per ``_SQL_BATCH`` chunks, not one per chunk; returns how many there were. The DELETE names each index,
        so a chunk written meanwhile past ``first`` is never dropped from disk while it stays in memory."""
        with self._lock:
            indexes = sorted(x for x in self._chunks.get(inode, {}) if x >= first)
        removed = 0
        for start in range(0, len(indexes), _SQL_BATCH):
            part = indexes[start : start + _SQL_BATCH]
            removed += self._remove(f"inode=? AND idx IN ({','.join('?' * len(part))})", (inode, *part),
                                    [ChunkId(inode, x) for x in part])
        return removed

    def _remove(self, where: str, args: tuple, ids: list[ChunkId]) -> int:
        with self._db_lock:
            ids = [c for c in ids if self._entry(c) is not None]
            durable = bool(ids) and self._execute((f"DELETE FROM versions WHERE {where}", args),
                                                  durable=self._write_through)
            with self._lock:
                for cid in ids:
                    entry = self._entry(cid)
                    for v in (entry.committed, entry.pending, self._superseded.pop(cid, None)):
                        if v is not None:
                            self._retire(v, durable)
                    entry.committed = entry.pending = None
                    self._forget_if_empty(cid, entry)
            return len(ids)

    def truncate(self, chunk_id: ChunkId, length: int, version: int) -> ChunkMeta:
        """Cut or zero-extend the chunk to ``length`` as new committed ``version`` (copy-on-write)."""
        if length < 0:
            raise KvfsError(f"chunk {chunk_id}: negative length {length}", errno.EINVAL)
        self._stage(chunk_id, version, length, memoryview(b""), [], 0, full_replace=False, force=False, new_len=length)
        return self.commit(chunk_id, version)

    def replace_full(
        self, chunk_id: ChunkId, version: int, data: bytes | bytearray | memoryview, crc: int
    ) -> ChunkMeta:
        """Install ``data`` as committed ``version`` whatever is there now (resync and repair)."""
        data = memoryview(data).cast("B")
        data_blocks = _checked_block_crcs(f"chunk {chunk_id} v{version}", data, crc)
        self._stage(chunk_id, version, 0, data, data_blocks, crc, full_replace=True, force=True)
        return self.commit(chunk_id, version)

    def space(self) -> tuple[int, int, int]:
        """(capacity, used, free) in bytes for statfs; used counts the slots of live versions."""
        st = os.statvfs(self.root)
        with self._lock:
            pooled = sum(len(f.free) * f.size for f in self._files.values())
            used = self._used
        capacity = self._capacity if self._capacity is not None else st.f_blocks * st.f_frsize
        return capacity, used, max(0, min(capacity - used, st.f_bavail * st.f_frsize + pooled))

    def local_location(self, chunk_id: ChunkId) -> tuple[Path, int, int, int] | None:
        """(file, offset, length, version) of the committed data, for short-circuit/GPUDirect readers.

        The bytes stay there only until the chunk's next commit or removal: read them, then check
        that ``meta(chunk_id).version`` is still ``version`` (else the slot may hold other data). A held version is
        written out first, so this may wait for the disk."""
        with self._lock:
            entry = self._entry(chunk_id)
            if entry is None or entry.committed is None:
                return None
            v = entry.committed
            self._pin(v)
        try:
            self._settle(v)
        finally:
            self._release(v)
        f = self._files[v.cls]
        return f.path, v.slot * f.size, v.length, v.version
