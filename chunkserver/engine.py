"""Chunk engine: the local, synchronous store of one storage target (one disk or directory).

Theory of operation
-------------------
The replication layer (CRAQ) decides versions; this module only keeps them safe. Every chunk has a
*committed* version (version 0 = empty, when nothing was ever committed) and at most one *pending*
version. Writes are copy-on-write: a pending version is written into free *slots* beside the committed one
(a whole new copy, or only the blocks it changes: "Block-level copy-on-write" below), and ``commit`` only
flips metadata.

On-disk format (under ``root``)::

    LOCK                 flock()ed while an engine has the target open (one engine per target)
    CLEAN                written durably by ``close`` after its flush, removed at open: its absence at open
                         means the last stop was unclean (``ChunkEngine.unclean_stop``)
    chunks.sqlite        SQLite, WAL mode, synchronous=FULL (OFF when fsync=False)
    data/NN.dat          slot file of size class 2**NN bytes (NN = 16 .. 26, i.e. 64 KiB .. 64 MiB);
                         slot s occupies bytes [s * 2**NN, (s + 1) * 2**NN)

A version of length L has a *base*: one slot of the smallest class >= max(L, 64 KiB) (of a larger one where
that class has no free slot and its file may not grow), and may have *overrides*: blocks kept in slots of their
own in ``data/16.dat``. Slot files are preallocated with ``posix_fallocate`` and slots are reused, so a write
never creates a file; they grow only while the file system keeps a reserve free. Table ``versions`` has one
row per committed or pending version: (inode, idx, pending, version, length, crc, block_crcs, cls, slot, aux,
overrides). The free list is *not* stored, nor are the counts of rows that share a slot: at open every slot
not named by a row is free and every named one counts its rows, so a crash can leak nothing.

Block-level copy-on-write
-------------------------
A whole-chunk write (and a write that changes the version's size class) makes a fresh base. A partial write
instead names the committed version's base and overrides and writes only the blocks it touches, each into a
fresh 64 KiB block slot (a block it covers partly is read, checked, overlaid and written whole): its cost is
its bytes rounded out to blocks plus one row. Block ``b`` of a version is its override if it has one, else
block ``b`` of its base; the row's block CRCs cover both, so reads check every block as before. A block slot,
like a base, is written only while no row names it, and the versions it came from stay untouched, so the
crash-safety argument below holds unchanged. A slot shared by several rows is freed when the last of them is
dropped, under the same rule as before (reused only once that drop is durable, unless no flush covered any of
the dropped rows that named it). When a write would leave a version with a quarter of its blocks or more in
overrides (or ``MAX_OVERRIDES``), it *folds*: the blocks that every row naming the base keeps in block slots of
its own (so that nobody reads the base there) are written into the base in place, from those block slots or
from the write, and the new version names the base with only the overrides left (``_foldable``). Its cost is
64 KiB a block folded, and the block slots go free with the old version. Where a fold cannot make room (a
reader's pin on the base, which may hold a version already dropped; a row whose removal a power loss may undo,
in write-through until the WAL fsync that the fold then makes; a superseded version with fewer overrides), the
write writes a fresh base instead (compaction: one chunk copy). Either way a chunk's live slots stay within
1.25x its length. A version with overrides lies in several places, so a loan of it is a copy through the page
cache and a short-circuit location is refused (the reader reads over the network).

Checksums: one CRC32C per 64 KiB block (``BLOCK``), stored as a little array in the row, so a
range read verifies only the blocks it touches. 64 KiB rather than 4 KiB because the block list
is rewritten with every version: a 64 MiB chunk carries 4 KiB of CRCs instead of 64 KiB, while a
4 KiB random read pays one 64 KiB read and its CRC. The whole-chunk
CRC (compared along the chain) is derived from the block CRCs without rereading data, using
linearity: crc(A+B) = M(crc(A)) ^ crc(B), M a fixed linear map on 32 bits for len(B) = BLOCK (four
table lookups). A write's CRC is checked the same way, from the block CRCs it stores, so the engine
reads a written byte once.

Crash safety (write-through)
----------------------------
A version's data is written into a slot no row names (or, a fold, into blocks of a base that no row reads) and
fdatasync'ed *before* the row that names it is committed to SQLite (one atomic, fsync'ed transaction). ``commit``
is one transaction that deletes the old committed row and turns the pending row into the committed one. A slot is
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
stage the data, so the page cache would only add a copy and memory per byte written (chunkserver/README.md,
"Direct I/O"). Large reads (:meth:`ChunkEngine.lend`) come straight from
the disk the same way, into pooled page-aligned buffers; small ones through the page cache. Linux keeps the two
paths coherent (a direct write drops cached pages of its range, a direct read first writes back dirty ones). A
file system that refuses ``O_DIRECT`` (at open, or on a write or read) gets buffered writes and mapped loans,
with one log line.
Durability is unchanged: a direct write may still sit in the disk's cache, and the same fdatasync flushes it.

Write-back
----------
With ``write_through=False`` nothing is flushed before a write is acknowledged: :meth:`flush` flushes (the
slot files written since, then one fsync'ed transaction), and callers decide when (a client's fsync, a
timer, ``close``). A kill -9 still loses nothing. For a power loss, two records keep what a flush covered:
table ``unsynced`` lists every version staged since (in the transaction that publishes it), and a commit
keeps the newest flushed committed version as a ``pending = 2`` row, slot included, until the next flush.
On open, every listed and every kept version is checked block by block: a torn pending version is dropped,
a torn committed one gives way to the kept one (and a pending one newer than that goes too), and the
replication layer resyncs the replica. Slots of rows dropped by a transaction not yet durable stay out of
use until a durable one; a write that would otherwise grow the slot file makes one (an fsync of the WAL).
Except the slot of a version no flush has covered (a commit drops one whenever a chunk is written twice between
flushes): should a power loss undo the drop, the row comes back listed in ``unsynced``, is found torn and gives
way, and a power loss may take such a version anyway. Its slot is reused at once, which spares a chain's
sequential writes the WAL fsync that every fifth chunk write or so would need.

Held writes
-----------
With write-back and ``hold_bytes``, a write that is a whole new version (a full chunk, the way the mount flushes
a file written in order) is not written at all at first: the engine keeps the received buffer it arrived in
until a flush writes it out. If the chunk is written again before that, the new version's commit frees the old
one's slot and the held bytes are dropped: they never reach the disk. A program that rewrites a file within a
flush interval (a checkpoint saved every few seconds, fio's write job over one 256 MiB file) costs the disk one
copy per flush instead of one per write. A partial write on a held version shares its base, like any other;
the base stays held until something writes it out. Reads and loans of a held version are served from the held
bytes (their block CRCs checked, as on disk); what needs the bytes in the slot writes the version out first,
through the page cache, which the read that follows then hits: a partial write's old blocks, a short-circuit
reader (a batch of chunks is read faster from this host's files, even after a write-out, than in an RPC each over
the network from memory: benchmarks/RESULTS.md). Past half of
``hold_bytes`` a background thread writes out the oldest held versions, beside the writers; past ``hold_bytes``
the writer that went past it does.

What it costs: a kill -9 now loses what the target holds, as a power loss loses unflushed writes in plain
write-back. The versions were staged (their rows name slots the bytes never reached) and listed as unflushed,
so the reopened engine finds them torn and falls back to the flushed ones, exactly as after a power loss, and the
chain resyncs the replica from its peers, which hold the same versions. Acknowledged writes are lost only if
every replica's process dies before a flush (or the host loses power), as with any page cache. ``hold_bytes = 0``
writes every version at once.

Readers on this host
--------------------
Writes go around the page cache where they can (``direct_io``, chunkserver/README.md), which suits a target
that only remote clients read. A target that a short-circuit reader on its host which reads back what is put
(a kvclient beside an inference engine: :meth:`pin_location` with ``reads_back`` within the last
``READ_BACK_FOR`` seconds) located chunks at writes whole versions through the page cache instead, and held ones
out in the background at once rather than at the next flush (its locate would otherwise write them out first):
that reader gets what was put a moment ago, and around the cache each such read went to the
disk, behind the flush that wrote it out. A mount's short-circuit reads do not ask for it: its large sequential
writes would pay a page-cache copy per byte for reads that seldom follow.

Parts
-----
:class:`ChunkEngine` keeps the chunks' versions in memory, decides what happens to them, and keeps slots in use
while a version is pinned (read or copied) or its row's removal is not yet durable. Three parts do the rest:
:mod:`~kvfs.chunkserver.slots` the slot files (size classes, free lists, growth, direct or buffered I/O),
:mod:`~kvfs.chunkserver.rows` the SQLite row store (every statement), and :mod:`~kvfs.chunkserver.held` the held
writes (the held bytes, their count and gauge, and writing them out). All share the engine's ``_lock``.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import threading
import time
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
from crc32c import crc32c

from kvfs.chunkserver import rows
from kvfs.chunkserver.held import HeldWrites
from kvfs.chunkserver.slots import SlotFiles, class_for, enospc
from kvfs.craq.messages import ChunkId
from kvfs.crc import BLOCK, bad_block, block_crcs, block_runs, fold_crc
from kvfs.errors import ChecksumMismatch, KvfsError

log = logging.getLogger("kvfs.chunkserver.engine")

BLOCK_CLS = class_for(BLOCK)  # the slot file whose slots hold one block each: a version's overrides live there
MAX_OVERRIDES = 256  # a version names fewer block slots than this; a write that would reach it makes a fresh base
#: Seconds after its last location for a reader that reads back what is put that a target still writes whole
#: versions through the page cache (see "Readers on this host").
READ_BACK_FOR = 60.0

Slot = tuple[int, int]  # (size class, slot)

CLEAN_MARKER = "CLEAN"


def _fsync_path(path: Path, flags: int = os.O_RDONLY | os.O_DIRECTORY) -> None:
    """Open ``path`` with ``flags`` (a directory by default; ``O_CREAT`` makes an empty marker) and fsync it."""
    fd = os.open(path, flags, 0o644)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ChunkVersion(msgspec.Struct, frozen=True):
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


class Location(NamedTuple):
    """A pinned version's place in its slot file (:meth:`ChunkEngine.pin_location`): ``offset`` is the slot's
    start in ``path``; ``block_crcs`` are the CRC32Cs of the version's blocks from ``first_block`` on. ``release``
    ends the pin; so does :meth:`ChunkEngine.release_pins` of several ``pin`` together, which a server holding
    thousands of pins for a lease keeps instead (a callable each is three objects for the garbage collector to
    walk)."""

    path: Path
    offset: int
    length: int
    version: int
    first_block: int
    block_crcs: list[int]
    release: Callable[[], None]
    pin: object


class VersionInfo(NamedTuple):
    version: int
    length: int
    crc: int
    aux: bytes


class StaleVersion(KvfsError):
    """A write names a version that is not newer than the committed one."""

    default_errno = errno.EALREADY


class PendingWrite(NamedTuple):
    """One chunk's write for :meth:`ChunkEngine.write_pending_many`; the fields are :meth:`ChunkEngine.write_pending`'s."""

    chunk_id: ChunkId
    version: int
    offset: int
    data: bytes | bytearray | memoryview
    crc: int
    full_replace: bool = False
    aux: bytes = b""
    force: bool = False
    block_crcs: list[int] | None = None
    extents: Sequence[Sequence[int]] | None = None


@dataclass(slots=True)
class _Version:
    version: int
    length: int
    crc: int
    blocks: array  # array('I') of per-BLOCK CRC32Cs
    cls: int  # log2 of the slot size; -1 only for the virtual empty version 0
    slot: int
    origin: tuple | None = None  # (offset, len, crc, new_len, extents) of the write that made it, for retransmits
    aux: bytes = b""  # the replication layer's record for this version (e.g. its idempotency table)
    seq: int = 0  # write-back: its number in table unsynced; flushed once a flush has covered it (0: flushed)
    overrides: dict[int, int] = field(default_factory=dict)  # block -> its slot in BLOCK_CLS, instead of the base's

    def slots(self) -> list[Slot]:
        """Every slot this version names: its base, then its block slots."""
        if self.slot < 0:
            return []
        return [(self.cls, self.slot), *((BLOCK_CLS, s) for s in self.overrides.values())]

    def overrides_blob(self) -> bytes:
        """The overrides as a row stores them: (block, slot) pairs, 32 bits each, by block."""
        return array("I", [x for pair in sorted(self.overrides.items()) for x in pair]).tobytes()


def _overrides(blob: bytes) -> dict[int, int]:
    pairs = array("I", blob)
    return dict(zip(pairs[::2], pairs[1::2]))


def _row_version(version: int, length: int, crc: int, blob: bytes, cls: int, slot: int, overrides: bytes,
                 aux: bytes = b"") -> _Version:
    return _Version(version, length, crc, array("I", blob), cls, slot, aux=aux, overrides=_overrides(overrides))


def _covering(buffers: list[memoryview], start: int, n: int) -> list[memoryview]:
    """The pieces of ``buffers`` (taken as one run of bytes) at [start, start + n)."""
    out = []
    for b in buffers:
        if start < len(b) and n > 0:
            piece = b[start : start + n]
            out.append(piece)
            n -= len(piece)
        start = max(0, start - len(b))
    return out


_EMPTY = _Version(0, 0, 0, array("I"), -1, -1)


@dataclass(slots=True)
class _Entry:
    committed: _Version | None = None
    pending: _Version | None = None


def _nblocks(length: int) -> int:
    return -(-length // BLOCK)


def _nothing() -> None:
    pass


def _runs(offset: int, data: memoryview, extents: Sequence[Sequence[int]] | None) -> list[tuple[int, int, int]]:
    """(offset in the chunk, position in ``data``, length) of each non-empty run a write holds."""
    if extents is None:
        return [(offset, 0, len(data))] if len(data) else []
    runs, at = [], 0
    for start, length in extents:
        if length:
            runs.append((start, at, length))
        at += length
    return runs


_NEW, _OLD, _MIXED = range(3)  # a block of a new version: all from one run of the write; the old block; assembled


def _block_kind(runs: list[tuple[int, int, int]], old_len: int, new_len: int, b: int) -> tuple[int, int]:
    """What block ``b`` of a new version of ``new_len`` bytes is, made from a version of ``old_len`` bytes by a
    write of ``runs`` (:func:`_runs`): (_NEW, run), (_OLD, -1) untouched and as long as before, or (_MIXED, -1)."""
    lo, hi = b * BLOCK, min(b * BLOCK + BLOCK, new_len)
    i = bisect_right(runs, (hi - 1, 1 << 62)) - 1  # the last run starting below hi: the only candidate
    if i >= 0 and runs[i][0] <= lo and hi <= runs[i][0] + runs[i][2]:
        return _NEW, i
    untouched = i < 0 or runs[i][0] + runs[i][2] <= lo
    if untouched and lo < old_len and hi == min(lo + BLOCK, old_len):
        return _OLD, -1
    return _MIXED, -1


def _changed_blocks(old: _Version, runs: list[tuple[int, int, int]], new_len: int) -> list[int] | None:
    """The blocks a partial write of ``runs`` makes other than ``old``'s (each to be written whole); None where the
    new version cannot share ``old``'s base: ``old`` has none, or the version changes size class."""
    if old.slot < 0 or class_for(new_len) != old.cls:
        return None
    nblocks = _nblocks(new_len)
    # only a block a run touches, or one at or past the shorter length's end, can be other than _OLD: ask about
    # those alone (a 4 KiB write into a 4 MiB chunk asks about one block, not 64)
    candidates = set(range(min(old.length, new_len) // BLOCK, nblocks))
    for start, _, length in runs:
        candidates.update(range(start // BLOCK, min(nblocks, (start + length - 1) // BLOCK + 1)))
    return [b for b in sorted(candidates) if _block_kind(runs, old.length, new_len, b)[0] != _OLD]


def _within_limit(old: _Version, fresh: list[int], fold: set[int], new_len: int) -> bool:
    """Whether the new version names fewer block slots than a quarter of its blocks (at most ``MAX_OVERRIDES``):
    ``old``'s overrides that it keeps (not folded into the base, not past its end) and the ``fresh`` blocks it
    writes into block slots of their own. So a write of a quarter of a chunk or more (a sequential writer's 1 MiB
    into a 4 MiB chunk) makes a fresh base, which reads and loans take in one piece."""
    nblocks = _nblocks(new_len)
    kept = sum(1 for b in old.overrides if b < nblocks and b not in fold)
    added = sum(1 for b in fresh if b not in old.overrides)  # one already there gets a new slot: counted once
    return kept + added < min(MAX_OVERRIDES, nblocks // 4)


def _check_extents(chunk_id: ChunkId, offset: int, data: memoryview, extents: Sequence[Sequence[int]],
                   chunk_size: int) -> None:
    """A write of several runs must name them in order, apart, inside the chunk, holding exactly ``data``."""
    ends = [start + length for start, length in extents]
    if not (extents and extents[0][0] == offset and all(length >= 0 for _, length in extents)
            and sum(length for _, length in extents) == len(data) and ends[-1] <= chunk_size
            and all(ends[k] <= extents[k + 1][0] for k in range(len(extents) - 1))):
        raise KvfsError(f"chunk {chunk_id}: runs {list(extents)[:4]}... at {offset} are out of order, overlap, "
                        f"leave the chunk of {chunk_size} or do not add up to the {len(data)} bytes sent",
                        errno.EINVAL)


def _checked_block_crcs(cid: ChunkId, version: int, data: memoryview, crc: int, blocks: list[int] | None = None
                        ) -> list[int]:
    """CRCs of ``data``'s BLOCK-sized pieces, after checking that together they make ``crc``: one pass over the
    data serves both the check and the stored block CRCs. ``blocks``: those CRCs as the caller computed them
    (the chain member, which checks every write it accepts), so the data is not read again; only their count
    and their fold into ``crc`` are checked."""
    if blocks is None:
        blocks = block_crcs(data)
    elif len(blocks) != _nblocks(len(data)):
        raise KvfsError(f"chunk {cid} v{version}: {len(blocks)} block CRCs for {len(data)} bytes", errno.EINVAL)
    if fold_crc(blocks, len(data)) != crc:
        raise ChecksumMismatch(f"chunk {cid} v{version}: data does not match its CRC32C")
    return blocks


class _Staged(NamedTuple):
    """A version whose bytes :meth:`ChunkEngine._prepare` wrote, its row not yet published: the slots it took
    (``got``) and the committed version it builds on, pinned until then."""

    cid: ChunkId
    v: _Version
    got: list[Slot]
    old: _Version
    force: bool
    folded: bool  # it wrote blocks into old's base in place: no other fold of that base until it is settled


_PUBLISHED = object()  # a batch's place holder for a result that its transaction fills in


def _one(results: list[ChunkVersion | KvfsError]) -> ChunkVersion:
    """The result of a batch of one, raised if it is an error."""
    (result,) = results
    if isinstance(result, KvfsError):
        raise result
    return result


class ChunkEngine:
    """Chunk versions of one storage target. Thread-safe: big calls may run in worker threads while
    small cached ones (``meta``, ``list_chunks``, ``space``; ``local_location`` unless the version is held) run
    inline."""

    def __init__(
        self, root: Path, *, fsync: bool = True, write_through: bool = True, capacity_bytes: int | None = None,
        direct_io: bool = True, hold_bytes: int = 0, reserve_bytes: int | None = None,
    ) -> None:
        """``fsync=False`` never flushes (tests, scratch space). ``write_through=False`` acknowledges writes
        from the page cache and makes them durable at :meth:`flush` (see "Write-back" above). ``direct_io=False``
        writes slot data through the page cache too (see "Direct I/O"). ``hold_bytes``: with write-back, up to
        this many bytes of whole-version writes wait in memory for a flush (see "Held writes"). ``reserve_bytes``:
        how much of the file system new chunk data leaves free (None: :func:`~kvfs.chunkserver.slots.default_reserve`);
        past it writes fail with ENOSPC."""
        self.root = Path(root)
        self._fsync = fsync
        self._write_through = write_through
        self._write_back = fsync and not write_through  # tracks unflushed versions and keeps superseded ones
        self._lock = threading.Lock()  # in-memory state; never held across disk I/O except fallocate
        self._db_lock = threading.Lock()  # serialises metadata writers; held across the SQLite commit
        self._chunks: dict[int, dict[int, _Entry]] = {}
        self._pins: dict[Slot, int] = {}  # slot -> readers holding it (absent: none)
        self._deferred: set[Slot] = set()
        self._refs: Counter[Slot] = Counter()  # slot -> how many versions (rows) name it
        self._undurable_frees: list[Slot] = []  # slots whose rows' removal is not yet fsync'ed
        self._undurably_dropped: set[Slot] = set()  # named by a row whose removal a power loss may undo
        self._superseded: dict[ChunkId, _Version] = {}  # write-back: the last flushed committed version, until flush
        self._folding: set[Slot] = set()  # bases a staged version folded blocks into, until it is published or dropped
        self._last_seq: dict[ChunkId, int] = {}  # write-back: each chunk's newest unflushed staging
        self._dirty_classes: set[int] = set()  # write-back: slot files written since the last flush
        self._seq = 0  # the last unflushed staging's number
        self._covered_upto = 0  # stagings up to this number are covered by the latest flush begun (durable at its end)
        self._flush_lock = threading.Lock()  # one flush at a time; a caller's flush starts after its call
        self.root.mkdir(parents=True, exist_ok=True)
        self._lockfd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lockfd)
            raise KvfsError(f"target {self.root} is open in another engine", errno.EBUSY) from None
        existed = (self.root / rows.DB_NAME).exists()
        self._rows = rows.RowStore(self.root, fsync=fsync)
        self._slots = SlotFiles(self.root, direct_io=direct_io, capacity_bytes=capacity_bytes, lock=self._lock,
                                reserve_bytes=reserve_bytes)
        self._read_back_at = -READ_BACK_FOR  # monotonic time of the last location for a reader that reads back
        self._held = HeldWrites(hold_bytes if self._write_back else 0, self._lock, self._slots.write, self._free,
                                self._reads_back)
        torn = self._drop_torn_versions()
        clean = self.root / CLEAN_MARKER
        #: Opened after an unclean stop in write-back mode (a kill, a crash, a power loss: no record of a clean
        #: close, or torn versions found): acknowledged writes no flush covered may be gone. The chunk server says
        #: so in its heartbeats, so that mgmtd does not let this target serve alone while another replica may hold
        #: them (craq/README.md, "Recovery").
        self.unclean_stop = torn or (self._write_back and existed and not clean.exists())
        clean.unlink(missing_ok=True)  # durable with the directory fsync below, before any write is taken
        if self.unclean_stop:
            log.warning("target %s: opened after an unclean stop; acknowledged writes no flush covered may be lost"
                        " here (mgmtd lets it serve alone only after the other replicas returned)", self.root)
        self._load()
        if fsync:
            for d in (self.root, self.root / "data"):
                _fsync_path(d)

    def _drop_torn_versions(self) -> bool:
        """After a crash in write-back mode, check every version staged since the last flush: a power loss may
        have kept its row but not all of its data. A torn committed version gives way to the flushed one it
        superseded (a torn pending one, or one newer than a restored one, is dropped: the chain resyncs it), so
        nothing a flush covered is lost. Then everything is flushed and no superseded version is needed.
        Returns whether any version was torn."""
        listed = self._rows.unflushed_versions()
        if not listed:
            return False
        torn: dict[tuple[int, int], dict[int, int]] = {}  # chunk -> {pending state: version} of its torn versions
        for inode, idx, pending, version, length, crc, blob, cls, slot, overrides in listed:
            try:
                self._read_verified(_row_version(version, length, crc, blob, cls, slot, overrides), 0,
                                    memoryview(bytearray(length)))
            except ChecksumMismatch:
                torn.setdefault((inode, idx), {})[pending] = version
        statements: list[rows.Statement] = []
        for chunk, states in torn.items():
            if 0 in states:  # back to the superseded version, if it is whole; what was newer goes too
                statements.append(rows.delete_current(chunk))
                if 2 in states:
                    fallback = "its superseded version was torn too: gone from this replica"
                else:
                    fallback = "back at the version the last flush made durable, if any"
                    statements.append(rows.move(chunk, 2, 0))
                log.warning("target %s: chunk %s v%d was torn by a crash before a flush; %s (the chain resyncs the"
                            " replica)", self.root, chunk, states[0], fallback)
            elif 1 in states:
                statements.append(rows.delete(chunk, 1))
                log.warning("target %s: pending chunk %s v%d was torn by a crash before a flush; dropped it",
                            self.root, chunk, states[1])
        if self._fsync:
            for cls in self._slots.files:  # what was checked came from the page cache: make it what the disk holds
                self._slots.flush(cls)
        self._execute(*statements, rows.FORGET_KEPT, rows.FORGET_ALL_UNFLUSHED, durable=True)
        return bool(torn)

    def _load(self) -> None:
        """Rebuild the index from the rows; every slot no row names is free, and a slot's count of users is the
        number of rows that name it (nothing on disk counts them, so a crash can leave no count wrong)."""
        for inode, idx, pending, version, length, crc, blob, cls, slot, aux, overrides in self._rows.versions():
            v = _row_version(version, length, crc, blob, cls, slot, overrides, aux)
            entry = self._chunks.setdefault(inode, {}).setdefault(idx, _Entry())
            if pending:
                entry.pending = v
            else:
                entry.committed = v
            self._refs.update(v.slots())
        self._slots.mark_used(list(self._refs))

    def close(self) -> None:
        """Flush, record the clean stop, then release files and the target lock; the engine is unusable afterwards."""
        try:
            self.flush()
            if self._fsync:
                _fsync_path(self.root / CLEAN_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                _fsync_path(self.root)
        finally:
            self._close_files()

    def _close_files(self) -> None:
        self._held.stop()
        self._rows.close()
        self._slots.close()
        os.close(self._lockfd)

    def __enter__(self) -> ChunkEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- slots and pins (hold _lock)

    def _free(self, cls: int, slot: int) -> None:
        if slot < 0:
            return
        key = (cls, slot)
        if key in self._pins:
            self._deferred.add(key)
            return
        if self._held.drop(key):  # freed once the write-out under way has ended
            return
        self._slots.release(cls, slot)

    def _adopt(self, v: _Version) -> None:
        """A row now names ``v``: each of its slots has one more user."""
        self._refs.update(v.slots())

    def _retire(self, v: _Version, durable: bool) -> None:
        """A transaction just dropped ``v``'s row: free each of its slots that no other row names. While that
        transaction may still be undone by a power loss, the row may come back, so such a slot stays out of use
        until a durable one; unless no flush has covered the version (write-back): a power loss may take such a
        version anyway, and recovery checks it block by block (table ``unsynced`` lists it), so a row that comes
        back over reused space is found torn and gives way. A slot shared with a version whose drop was not
        durable waits even if its last user goes at once."""
        at_once = durable or (self._write_back and v.seq > self._covered_upto)
        for key in v.slots():
            if not at_once:
                self._undurably_dropped.add(key)
            self._refs[key] -= 1
            if self._refs[key]:
                continue
            del self._refs[key]
            if key in self._undurably_dropped:
                self._undurably_dropped.discard(key)
                self._undurable_frees.append(key)
            else:
                self._free(*key)

    def _pin(self, v: _Version) -> None:
        pins = self._pins
        for key in v.slots():
            pins[key] = pins.get(key, 0) + 1

    def _unpin(self, v: _Version) -> None:
        pins = self._pins
        for key in v.slots():
            left = pins[key] - 1
            if left:
                pins[key] = left
            else:
                del pins[key]
                if key in self._deferred:
                    self._deferred.discard(key)
                    self._free(*key)

    def _entry(self, cid: ChunkId) -> _Entry | None:
        return self._chunks.get(cid.inode, {}).get(cid.index)

    def _meta(self, cid: ChunkId, v: _Version, entry: _Entry) -> ChunkVersion:
        committed = entry.committed.version if entry.committed else 0
        pending = entry.pending.version if entry.pending else None
        return ChunkVersion(cid, v.version, v.length, v.crc, committed, pending)

    # ------------------------------------------------------------------------------ data I/O

    def _where(self, v: _Version) -> str:
        blocks = f" and {len(v.overrides)} block slots" if v.overrides else ""
        return f"{self._slots.files[v.cls].path} slot {v.slot}{blocks}"

    @staticmethod
    def _pieces(v: _Version, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(slot file class, offset in it, length) of the contiguous pieces that hold bytes [lo, hi) of ``v``, in
        order: one for a version without overrides, else a piece per run of base blocks and per block slot."""
        if not v.overrides:
            return [(v.cls, (v.slot << v.cls) + lo, hi - lo)]
        pieces: list[tuple[int, int, int]] = []
        at = lo
        while at < hi:
            b = at // BLOCK
            end = min(hi, b * BLOCK + BLOCK)
            own = v.overrides.get(b)
            cls, off = (v.cls, (v.slot << v.cls) + at) if own is None else (BLOCK_CLS, (own << BLOCK_CLS) + at % BLOCK)
            if pieces and pieces[-1][0] == cls and pieces[-1][1] + pieces[-1][2] == off:
                pieces[-1] = (cls, pieces[-1][1], pieces[-1][2] + end - at)
            else:
                pieces.append((cls, off, end - at))
            at = end
        return pieces

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
        buffers = [b for b in (head, out, tail) if len(b)]
        got = 0
        for cls, at, n in self._pieces(v, lo, hi):
            k = self._slots.read(cls, _covering(buffers, got, n), at, nowait)
            got += k
            if k < n:
                break
        if got != hi - lo and nowait:
            raise BlockingIOError(errno.EAGAIN, "partly outside the page cache")
        if got != hi - lo:
            raise ChecksumMismatch(f"{self._where(v)}: short read ({got} of {hi - lo} bytes)")
        bad = bad_block([(lo, head), (offset, out), (end, tail)], lo, hi, v.blocks)
        if bad is not None:
            raise ChecksumMismatch(f"{self._where(v)} block {bad}: stored data is corrupt")

    def _copy(self, old: _Version, lo: int, hi: int, cls: int, dst_off: int) -> None:
        """Copy unchanged bytes of the old version in the kernel; their block CRCs carry over, so
        corruption in them stays detectable instead of being laundered into a fresh CRC."""
        for src_cls, src_off, left in self._pieces(old, lo, hi):
            while left:
                n = self._slots.copy(src_cls, src_off, cls, dst_off, left)
                if n <= 0:
                    raise ChecksumMismatch(f"{self._where(old)}: ends early")
                left, src_off, dst_off = left - n, src_off + n, dst_off + n

    def _reads_back(self) -> bool:
        """Whether a reader on this host that reads back what is put located a version here lately (see "Readers on
        this host")."""
        return time.monotonic() - self._read_back_at < READ_BACK_FOR

    def _held_bytes(self, v: _Version) -> memoryview | None:
        """(Caller holds the lock.) ``v``'s bytes where they are still held in memory, else None. A pinned version
        keeps its slot, so the bytes stay the version's even if a write-out takes them off the held list."""
        return None if v.overrides else self._held.peek((v.cls, v.slot))

    def _checked_held(self, v: _Version, held: memoryview, offset: int, n: int) -> memoryview:
        """Bytes [offset, offset+n) of ``v``'s held bytes, the blocks they touch checked against their CRCs."""
        lo = offset // BLOCK * BLOCK
        self._check_blocks(v, lo, held[lo : min(_nblocks(offset + n) * BLOCK, v.length)])
        return held[offset : offset + n]

    def _settle(self, v: _Version, nowait: bool = False) -> None:
        """Make sure ``v``'s bytes are in its slot (written out if held) before they are read from it.
        ``nowait``: BlockingIOError instead of writing them out (a read that must not wait for the disk)."""
        self._held.settle((v.cls, v.slot), nowait)

    def _fill(self, old: _Version, cls: int, slot: int, offset: int, data: memoryview, new_len: int,
              data_blocks: list[int], extents: Sequence[Sequence[int]] | None = None) -> array:
        """Write the new version (old, with ``data`` at ``offset`` or its ``extents``, cut or zero-extended
        to ``new_len``) into a fresh base slot; return its block CRCs. Runs of blocks wholly from one run of
        ``data`` are written in one pwrite, runs wholly unchanged are copied in the kernel, and blocks
        that mix old bytes, new bytes or zeros are assembled in memory. ``data_blocks`` are the CRCs of
        ``data``'s own BLOCK pieces: a block-aligned write reuses them instead of reading the data again."""
        base = slot << cls
        end = offset + len(data)
        if extents is None and offset == 0 and end == new_len:  # the whole new version is the write: one pwrite
            if not self._held.hold(cls, slot, data):
                self._slots.write(cls, data, base, self._reads_back())
            return array("I", data_blocks)
        self._settle(old)  # its bytes are read or copied below
        crcs = array("I")
        runs = _runs(offset, data, extents)
        b, nblocks = 0, _nblocks(new_len)
        while b < nblocks:
            k, i = _block_kind(runs, old.length, new_len, b)
            e = b + 1
            while k != _MIXED and e < nblocks and _block_kind(runs, old.length, new_len, e) == (k, i):
                e += 1
            lo, hi = b * BLOCK, min(e * BLOCK, new_len)
            if k == _NEW:
                crcs.extend(self._write_new(runs[i], data, data_blocks, lo, hi, cls, base + lo))
            elif k == _OLD:
                self._copy(old, lo, hi, cls, base + lo)
                crcs.extend(old.blocks[b:e])
            else:
                crcs.append(self._write_mixed(old, runs, data, lo, hi, cls, base + lo))
            b = e
        return crcs

    def _fill_blocks(self, old: _Version, fresh: list[int], block_slots: list[int], offset: int, data: memoryview,
                     new_len: int, data_blocks: list[int], extents: Sequence[Sequence[int]] | None,
                     fold: set[int]) -> tuple[array, dict[int, int]]:
        """Write blocks ``fresh`` of the new version into ``block_slots``, one each, and blocks ``fold`` into
        ``old``'s base in place (:meth:`_foldable`), whether the write changes them or ``old`` keeps them in block
        slots; every other block is shared with ``old`` (its base block or its override). Returns the new
        version's block CRCs and overrides."""
        runs = _runs(offset, data, extents)
        nblocks = _nblocks(new_len)
        crcs = array("I", old.blocks[:nblocks])
        crcs.extend([0] * (nblocks - len(crcs)))
        overrides = {b: s for b, s in old.overrides.items() if b < nblocks and b not in fold}
        if fold:
            self._settle(old)  # held bytes written out later would land over the folded blocks
        base = old.slot << old.cls
        for b, (cls, at) in [*((b, (BLOCK_CLS, s << BLOCK_CLS)) for b, s in zip(fresh, block_slots)),
                             *((b, (old.cls, base + b * BLOCK)) for b in sorted(fold))]:
            k, i = _block_kind(runs, old.length, new_len, b)
            lo, hi = b * BLOCK, min(b * BLOCK + BLOCK, new_len)
            if k == _NEW:
                crcs[b] = self._write_new(runs[i], data, data_blocks, lo, hi, cls, at)[0]
            elif k == _OLD:
                self._copy(old, lo, hi, cls, at)  # a fold of a block old keeps in a block slot; its CRC carries over
            else:
                crcs[b] = self._write_mixed(old, runs, data, lo, hi, cls, at)
            if cls == BLOCK_CLS:
                overrides[b] = at >> BLOCK_CLS
        return crcs, overrides

    def _write_new(self, run: tuple[int, int, int], data: memoryview, data_blocks: list[int], lo: int, hi: int,
                   cls: int, dst: int) -> Sequence[int]:
        """Write bytes [lo, hi) of the new version, all from ``run`` of ``data``, at ``dst``; their block CRCs."""
        start, at, _ = run
        first, last = at + lo - start, at + hi - start  # the blocks' bytes in data
        self._slots.write(cls, data[first:last], dst)
        if first % BLOCK == 0 and (last % BLOCK == 0 or last == len(data)):
            return data_blocks[first // BLOCK : (last + BLOCK - 1) // BLOCK]
        return [crc32c(data[x : min(x + BLOCK, last)]) for x in range(first, last, BLOCK)]

    def _write_mixed(self, old: _Version, runs: list[tuple[int, int, int]], data: memoryview, lo: int, hi: int,
                     cls: int, dst: int) -> int:
        """Assemble block [lo, hi) of the new version from old bytes (checked), new bytes and zeros, write it at
        ``dst``; its CRC."""
        buf = memoryview(bytearray(hi - lo))
        keep = min(hi, old.length) - lo
        if keep > 0:
            self._settle(old)
            self._read_verified(old, lo, buf[:keep])
        starts = [start for start, _, _ in runs]
        for start, at, length in runs[max(0, bisect_right(starts, lo) - 1):]:
            if start >= hi:
                break
            s, t = max(lo, start), min(hi, start + length)
            if s < t:
                buf[s - lo : t - lo] = data[at + s - start : at + t - start]
        self._slots.write(cls, buf, dst)
        return crc32c(buf)

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
        extents: Sequence[Sequence[int]] | None = None,
    ) -> ChunkVersion:
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
        ``extents``: ``data`` is several runs, ``(offset, length)`` in order and apart (a client's gathered
        scattered writes), staged as one version; EINVAL if they do not fit.
        """
        return _one(self.write_pending_many(
            [PendingWrite(chunk_id, version, offset, data, crc, full_replace, aux, force, block_crcs, extents)],
            chunk_size=chunk_size))

    def write_pending_many(self, writes: Sequence[PendingWrite], *, chunk_size: int) -> list[ChunkVersion | KvfsError]:
        """:meth:`write_pending` for several chunks (each at most once) with one row-store transaction for all:
        a chain's batch of small writes costs one SQLite commit per replica, not one per chunk. A chunk that
        fails (bad CRC, stale version, ENOSPC) gets its error in its place and stores nothing, and the others
        are staged anyway; a failure of the transaction itself raises, and then nothing is staged."""
        if len({w.chunk_id for w in writes}) != len(writes):
            raise KvfsError("a batch names a chunk twice", errno.EINVAL)
        results: list[ChunkVersion | KvfsError | _Staged] = []
        for w in writes:
            try:
                results.append(self._prepare_write(w, chunk_size))
            except KvfsError as exc:
                results.append(exc)
            except BaseException:
                self._drop_staged([r for r in results if isinstance(r, _Staged)])
                raise
        staged = [r for r in results if isinstance(r, _Staged)]
        published = iter(self._publish_pending(staged))
        return [next(published) if isinstance(r, _Staged) else r for r in results]

    def _prepare_write(self, w: PendingWrite, chunk_size: int) -> ChunkVersion | _Staged:
        data = memoryview(w.data).cast("B")
        cid, version, offset, extents = w.chunk_id, w.version, w.offset, w.extents
        data_blocks = _checked_block_crcs(cid, version, data, w.crc, w.block_crcs)
        if offset < 0 or offset + len(data) > chunk_size or (w.full_replace and offset):
            raise KvfsError(
                f"chunk {cid}: write [{offset}, {offset + len(data)}) outside chunk of {chunk_size}",
                errno.EINVAL,
            )
        if w.force and not w.full_replace:
            raise KvfsError(f"chunk {cid}: only a full replace may be forced", errno.EINVAL)
        if extents is not None:
            if w.full_replace:
                raise KvfsError(f"chunk {cid}: a full replace is one run", errno.EINVAL)
            _check_extents(cid, offset, data, extents, chunk_size)
            extents = tuple((start, length) for start, length in extents)
        return self._prepare(cid, version, offset, data, data_blocks, w.crc, full_replace=w.full_replace,
                             force=w.force, aux=w.aux, extents=extents)

    def _stage(self, cid: ChunkId, *args: Any, **kwargs: Any) -> ChunkVersion:
        """Write a version's bytes (:meth:`_prepare`) and publish its row."""
        prepared = self._prepare(cid, *args, **kwargs)
        return prepared if isinstance(prepared, ChunkVersion) else _one(self._publish_pending([prepared]))

    def _prepare(
        self, cid: ChunkId, version: int, offset: int, data: memoryview, data_blocks: list[int], crc: int,
        *, full_replace: bool, force: bool, new_len: int | None = None, aux: bytes = b"",
        extents: tuple[tuple[int, int], ...] | None = None, base: tuple[int, int] | None = None,
    ) -> ChunkVersion | _Staged:
        """Write a version's bytes into slots no row names; its row is for :meth:`_publish_pending` (a retransmit
        of a version already there returns its meta). ``base``: (version, chunk CRC) of a delta
        (:meth:`write_delta`): the committed version it must apply to and the CRC the result must have; the
        blocks it keeps are read and checked first."""
        asked_len = new_len
        for last_try in (False, True):
            with self._lock:
                entry = self._entry(cid) or _Entry()
                old = entry.committed or _EMPTY
                new_len = asked_len
                if new_len is None:
                    end = extents[-1][0] + extents[-1][1] if extents else offset + len(data)
                    new_len = len(data) if full_replace else max(old.length, end)
                origin = (offset, len(data), crc, new_len, extents)
                for v in (entry.pending, entry.committed):
                    if not force and v is not None and v.version == version and v.origin == origin:
                        return self._meta(cid, v, entry)
                if not force and version <= old.version:
                    raise StaleVersion(f"chunk {cid}: v{version} is not newer than committed v{old.version}")
                if base is not None and old.version != base[0]:
                    raise StaleVersion(f"chunk {cid}: a delta of v{base[0]}, but v{old.version} is committed")
                whole = full_replace or (extents is None and offset == 0 and len(data) == new_len)
                fresh, fold = (None, set()) if whole else \
                    self._partial_plan(cid, entry, old, _runs(offset, data, extents), new_len, last_try)
                # A new slot costs the page cache fresh pages and the file system an extent conversion on
                # writeback, several times what reusing one costs: reuse slots that only wait for a durable
                # transaction (write-back leaves them waiting until one runs) rather than grow the file.
                full = False
                try:
                    # a fold that waits only for a durable transaction is worth the WAL fsync that makes one
                    got = None if fold is None else \
                        self._alloc_all([new_len] if fresh is None else [BLOCK] * len(fresh),
                                        grow=last_try or not (self._write_back and self._undurable_frees))
                except KvfsError as e:
                    if e.errno != errno.ENOSPC or last_try or not (self._undurable_frees or self._superseded):
                        raise
                    got, full = None, True
                if got is not None:
                    self._pin(old)
                    if fold:
                        self._folding.add((old.cls, old.slot))
                    break
            if full:
                self.flush()  # also frees the superseded versions' slots
            else:
                with self._db_lock:  # an fsync of the WAL alone makes the rows' removal durable
                    self._execute(rows.COUNT_FLUSH, durable=True)
        try:
            try:
                if base is not None:
                    self._check_kept(old, _runs(offset, data, extents), new_len)
                if fresh is None:
                    ((cls, slot),) = got
                    blocks = self._fill(old, cls, slot, offset, data, new_len, data_blocks, extents)
                    overrides: dict[int, int] = {}
                else:
                    cls, slot = old.cls, old.slot
                    blocks, overrides = self._fill_blocks(old, fresh, [s for _, s in got], offset, data, new_len,
                                                          data_blocks, extents, fold)
                for written in {c for c, _ in got} | ({old.cls} if fold else set()):
                    if self._fsync and self._write_through:
                        self._slots.flush(written)
                    elif self._write_back:
                        with self._lock:
                            self._dirty_classes.add(written)
                staged = _Version(version, new_len, crc if whole else fold_crc(blocks, new_len), blocks, cls, slot,
                                  origin, aux, overrides=overrides)
                if base is not None and staged.crc != base[1]:
                    raise ChecksumMismatch(f"chunk {cid}: v{version} from a delta of v{base[0]} does not match its CRC")
                # old stays pinned until the new version's row names the slots they share
                return _Staged(cid, staged, got, old, force, bool(fold))
            except BaseException:
                self._release(old)
                raise
        except BaseException as e:
            with self._lock:
                for key in got:
                    self._free(*key)
                if fold:
                    self._folding.discard((old.cls, old.slot))
            if isinstance(e, OSError) and not isinstance(e, KvfsError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise enospc(f"disk of target {self.root} is full") from e
            raise

    def _partial_plan(self, cid: ChunkId, entry: _Entry, old: _Version, runs: list[tuple[int, int, int]],
                      new_len: int, last_try: bool) -> tuple[list[int] | None, set[int] | None]:
        """(Caller holds the lock.) How a partial write makes its version: ``(fresh, fold)``, the blocks it writes
        into block slots of their own and those it writes into ``old``'s base in place; ``(None, set())``: a fresh
        base. ``fold`` is None where a fold waits only for a durable transaction (not on the ``last_try``)."""
        fresh = _changed_blocks(old, runs, new_len)
        if fresh is None:
            return None, set()
        if _within_limit(old, fresh, set(), new_len):
            return fresh, set()
        shadowed = self._foldable(cid, entry, old)
        if not shadowed:
            return None, set()
        if (old.cls, old.slot) in self._undurably_dropped:
            return (fresh, None) if not last_try else (None, set())
        fold = {b for b in shadowed if b < _nblocks(new_len)}
        fresh = [b for b in fresh if b not in fold]
        return (fresh, fold) if _within_limit(old, fresh, fold, new_len) else (None, set())

    def _foldable(self, cid: ChunkId, entry: _Entry, old: _Version) -> set[int]:
        """(Caller holds the lock.) The blocks of ``old``'s base that no row naming it reads, each such row having a
        block slot of its own there: a write may overwrite them in place (a fold), since neither a reader nor a
        crash can see them. Empty where something else may read the base: a reader's pin (which may hold a
        version already dropped), a row other than the chunk's committed, pending and superseded ones, another
        fold under way. A row whose removal a power loss may undo is the caller's to rule out."""
        base = (old.cls, old.slot)
        if base in self._pins or base in self._folding:
            return set()
        naming = [v for v in (old, entry.pending, self._superseded.get(cid))
                  if v is not None and (v.cls, v.slot) == base]
        if self._refs[base] != len(naming):
            return set()
        shadowed = set(old.overrides)
        for v in naming:
            shadowed.intersection_update(v.overrides)
        return shadowed

    def _check_kept(self, old: _Version, runs: list[tuple[int, int, int]], new_len: int) -> None:
        """Read and check every block a delta keeps from ``old``: its CRC in the row says which bytes the sender
        compared against, but only a read says they are still on the disk (ChecksumMismatch if not)."""
        self._settle(old)
        kept = [b for b in range(_nblocks(new_len)) if _block_kind(runs, old.length, new_len, b)[0] == _OLD]
        for lo, n in block_runs(kept, old.length):
            self._read_verified(old, lo, memoryview(bytearray(n)))

    def _alloc_all(self, lengths: list[int], grow: bool) -> list[Slot] | None:
        """A slot for each of ``lengths`` (the caller holds the lock), or None if one is missing and not ``grow``;
        all or none."""
        got: list[Slot] = []
        try:
            for n in lengths:
                key = self._slots.alloc(n, grow=grow)
                if key is None:
                    break
                got.append(key)
            else:
                return got
        except BaseException:
            for key in got:
                self._slots.release(*key)
            raise
        for key in got:
            self._slots.release(*key)
        return None

    def _publish_pending(self, staged: Sequence[_Staged]) -> list[ChunkVersion | KvfsError]:
        """Publish staged versions' rows in one transaction; one that is no longer newer than its chunk's committed
        version gets StaleVersion. Every staged version's committed one is unpinned, and the slots of those not
        published are freed."""
        results: list[ChunkVersion | KvfsError] = []
        published: list[_Staged] = []
        try:
            with self._db_lock:
                statements = []
                for st in staged:
                    entry = self._entry(st.cid) or _Entry()
                    committed = entry.committed.version if entry.committed else 0
                    if not st.force and st.v.version <= committed:
                        results.append(StaleVersion(f"chunk {st.cid}: v{st.v.version} is not newer than committed "
                                                    f"v{committed}"))
                        continue
                    v, key = st.v, (st.cid.inode, st.cid.index)
                    statements.append(rows.put_pending(key, v.version, v.length, v.crc, v.blocks.tobytes(), v.cls,
                                                       v.slot, v.aux, v.overrides_blob()))
                    if self._write_back:
                        statements.append(rows.list_unflushed(self._seq + 1 + len(published), key, v.version))
                    published.append(st)
                    results.append(_PUBLISHED)
                if not published:
                    return results
                durable = self._execute(*statements, durable=self._write_through)
                with self._lock:
                    metas = iter([self._adopt_pending(st.cid, st.v, durable) for st in published])
                return [next(metas) if r is _PUBLISHED else r for r in results]
        except BaseException:
            published = []
            raise
        finally:
            self._drop_staged([st for st in staged if all(st is not p for p in published)])
            for st in published:
                self._settled(st)

    def _adopt_pending(self, cid: ChunkId, v: _Version, durable: bool) -> ChunkVersion:
        """Make a version whose row was just published the chunk's pending one (the caller holds the lock)."""
        if self._write_back:
            self._seq += 1
            self._last_seq[cid] = v.seq = self._seq
        entry = self._chunks.setdefault(cid.inode, {}).setdefault(cid.index, _Entry())
        self._adopt(v)
        if entry.pending is not None:
            self._retire(entry.pending, durable)
        entry.pending = v
        return self._meta(cid, v, entry)

    def _drop_staged(self, staged: Sequence[_Staged]) -> None:
        """Undo :meth:`_prepare` for versions never published: free their slots, unpin their committed ones. (What
        a fold wrote into a base stays: no row reads those blocks of it.)"""
        for st in staged:
            self._settled(st)
            with self._lock:
                for key in st.got:
                    self._free(*key)

    def _settled(self, st: _Staged) -> None:
        """A staged version was published or dropped: unpin the committed version it was made from, and let its
        base be folded into again."""
        with self._lock:
            self._unpin(st.old)
            if st.folded:
                self._folding.discard((st.old.cls, st.old.slot))

    def _execute(self, *statements: rows.Statement, durable: bool) -> bool:
        """Run statements as one transaction of the row store (the caller holds ``_db_lock``); see
        :meth:`RowStore.execute <kvfs.chunkserver.rows.RowStore.execute>`. A durable one also makes every earlier
        one durable, so the slots those dropped become free. Returns whether it is durable."""
        durable = self._rows.execute(*statements, durable=durable)
        if durable and (self._undurable_frees or self._undurably_dropped):
            with self._lock:
                for cls, slot in self._undurable_frees:
                    self._free(cls, slot)
                self._undurable_frees.clear()
                self._undurably_dropped.clear()
        return durable

    def commit(self, chunk_id: ChunkId, version: int, *, durable: bool = True) -> ChunkVersion:
        """Make pending ``version`` the committed one (atomic); idempotent once it is committed.
        ``durable=False``: without an fsync of its own; a power loss may leave the version pending (see
        "Crash safety")."""
        return _one(self.commit_many([(chunk_id, version)], durable=durable))

    def commit_many(self, commits: Sequence[tuple[ChunkId, int]], *, durable: bool = True
                    ) -> list[ChunkVersion | KvfsError]:
        """:meth:`commit` of several chunks (each at most once) in one row-store transaction, so a chain's batch
        costs one SQLite commit per replica; a chunk without that pending version gets ENOENT in its place. Each
        chunk flips atomically from its old to its new version (one transaction for all of them)."""
        if len({cid for cid, _ in commits}) != len(commits):
            raise KvfsError("a batch names a chunk twice", errno.EINVAL)
        results: list[ChunkVersion | KvfsError] = []
        flips: list[tuple[ChunkId, _Entry, bool, _Version | None]] = []
        with self._db_lock:
            statements: list[rows.Statement] = []
            for chunk_id, version in commits:
                entry = self._entry(chunk_id)
                if entry is None or entry.pending is None or entry.pending.version != version:
                    if entry is not None and entry.committed is not None and entry.committed.version == version:
                        results.append(self._meta(chunk_id, entry.committed, entry))
                    else:
                        results.append(KvfsError(f"chunk {chunk_id}: no pending v{version} to commit", errno.ENOENT))
                    continue
                key = (chunk_id.inode, chunk_id.index)
                old = entry.committed
                # Write-back keeps the newest flushed committed version until a flush, for a power loss to fall
                # back to.
                keep = self._write_back and old is not None and old.seq <= self._covered_upto
                if keep:
                    statements += [rows.delete(key, 2), rows.move(key, 0, 2), rows.move(key, 1, 0)]
                else:
                    statements += [rows.delete(key, 0), rows.move(key, 1, 0)]
                flips.append((chunk_id, entry, keep, old))
                results.append(_PUBLISHED)
            if not flips:
                return results
            durable = self._execute(*statements, durable=durable and self._write_through)
            metas = []
            with self._lock:
                for chunk_id, entry, keep, old in flips:
                    dropped = self._superseded.get(chunk_id) if keep else old
                    if keep:
                        self._superseded[chunk_id] = old
                    if dropped is not None:
                        self._retire(dropped, durable)
                    entry.committed, entry.pending = entry.pending, None
                    metas.append(self._meta(chunk_id, entry.committed, entry))
        flipped = iter(metas)
        return [next(flipped) if r is _PUBLISHED else r for r in results]

    def flush(self) -> None:
        """Make every version staged, committed or removed before this call durable (a client's fsync, a periodic
        flush, close). Cheap when nothing changed; without write-back only the chain's lazy commits need it."""
        if not self._fsync:
            return
        with self._flush_lock:
            with self._db_lock, self._lock:
                if not (self._dirty_classes or self._rows.dirty or self._superseded):
                    return
                classes, self._dirty_classes = self._dirty_classes, set()
                upto, covered_before, self._covered_upto = self._seq, self._covered_upto, self._seq
                # every version staged up to ``upto`` whose bytes are held or being written out is among these
                held = list(self._held.slots())
            try:
                for key in held:
                    self._held.write_out(key)
                    classes.add(key[0])
                for cls in sorted(classes):
                    self._slots.flush(cls)
                with self._db_lock:
                    with self._lock:  # chunks staged after the snapshot keep their fallback until the next flush
                        released = [(cid, v) for cid, v in self._superseded.items()
                                    if self._last_seq.get(cid, 0) <= upto]
                    self._execute(
                        rows.forget_flushed(upto),
                        rows.COUNT_FLUSH,
                        *(rows.delete((c.inode, c.index), 2) for c, _ in released),
                        durable=True,
                    )
                    with self._lock:
                        for cid, v in released:
                            del self._superseded[cid]
                            self._retire(v, durable=True)
                        self._last_seq = {cid: seq for cid, seq in self._last_seq.items() if seq > upto}
            except OSError:
                with self._lock:  # still not durable: the next flush tries again (its rows stay listed meanwhile)
                    self._dirty_classes |= classes
                    self._covered_upto = covered_before
                raise

    def abort(self, chunk_id: ChunkId, version: int) -> None:
        """Drop pending ``version`` if it is there (idempotent)."""
        with self._db_lock:
            entry = self._entry(chunk_id)
            if entry is None or entry.pending is None or entry.pending.version != version:
                return
            durable = self._execute(rows.delete((chunk_id.inode, chunk_id.index), 1), durable=self._write_through)
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
    ) -> tuple[bytearray | int, ChunkVersion]:
        """Read up to ``length`` bytes at ``offset`` of the committed version (or the named one),
        verifying the CRC of every block touched. Returns a new bytearray, or the byte count when
        ``into`` is given (filled without an extra copy). Raises ENOENT for a missing chunk or
        version and ChecksumMismatch for corrupt data (serve from another replica, then repair).
        ``nowait`` reads only what is in the page cache and raises BlockingIOError otherwise, so an
        event loop can read cached data itself and leave the rest to a thread."""
        with self._lock:
            v, entry = self._pinned(chunk_id, version)
            meta = self._meta(chunk_id, v, entry)
            held = self._held_bytes(v)
        try:
            n = self._readable(chunk_id, v, offset, length)
            if into is not None:
                out = memoryview(into).cast("B")
                n = min(n, len(out))
                out = out[:n]
            else:
                out = memoryview(bytearray(n))
            if held is not None:
                out[:] = self._checked_held(v, held, offset, n)
            else:
                self._settle(v, nowait)
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
        with self._lock:
            v = self._pinned(chunk_id, version)[0]
            held = self._held_bytes(v)
        try:
            n = self._readable(chunk_id, v, offset, length)
            if held is not None:  # immutable bytes of our own: the slot need not stay pinned
                data = self._checked_held(v, held, offset, n)
                self._release(v)
                return Lent(data, _nothing)
            self._settle(v)
            if v.overrides:  # in several places: read through the page cache into a buffer of its own
                data = memoryview(bytearray(n))
                self._read_verified(v, offset, data)
            else:
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
        lo = offset // BLOCK * BLOCK
        hi = min(_nblocks(offset + n) * BLOCK, v.length)
        buf = self._slots.read_direct(v.cls, (v.slot << v.cls) + lo, hi - lo)
        if buf is None:
            return None
        if len(buf) < hi - lo:
            raise ChecksumMismatch(f"{self._where(v)}: short read ({len(buf)} of {hi - lo} bytes)")
        self._check_blocks(v, lo, buf[: hi - lo])
        return buf[offset - lo : offset - lo + n]

    def _lend_mapped(self, v: _Version, offset: int, n: int) -> Lent:
        mapped = self._slots.mapping(v.cls, v.slot)
        base = v.slot << v.cls
        lo = offset // BLOCK * BLOCK
        self._check_blocks(v, lo, mapped[base + lo : base + min(_nblocks(offset + n) * BLOCK, v.length)])
        return Lent(mapped[base + offset : base + offset + n], lambda: self._release(v))

    def _check_blocks(self, v: _Version, start: int, data: memoryview | bytes) -> None:
        """Check ``data``, the bytes of ``v`` from block boundary ``start`` on, against the blocks' CRCs."""
        for at in range(0, len(data), BLOCK):
            b = (start + at) // BLOCK
            if crc32c(data[at : at + BLOCK]) != v.blocks[b]:
                raise ChecksumMismatch(f"{self._where(v)} block {b}: stored data is corrupt")

    def _release(self, v: _Version) -> None:
        """Unpin ``v`` (see :meth:`_pin_version`)."""
        with self._lock:
            self._unpin(v)

    def _pin_version(self, chunk_id: ChunkId, version: int | None) -> _Version:
        """The named version (the committed one if None), pinned: its slot is not reused until unpinned."""
        with self._lock:
            return self._pinned(chunk_id, version)[0]

    def _pinned(self, chunk_id: ChunkId, version: int | None) -> tuple[_Version, _Entry]:
        """(Caller holds the lock.) :meth:`_pin_version`, and the chunk's entry."""
        entry = self._entry(chunk_id)
        v = None
        if entry is not None:
            v = entry.committed
            if version is not None and (v is None or v.version != version):
                v = entry.pending if entry.pending is not None and entry.pending.version == version else None
        if v is None:
            raise KvfsError(f"chunk {chunk_id} v{version if version is not None else 'committed'} not found",
                            errno.ENOENT)
        self._pin(v)
        return v, entry

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

    def meta(self, chunk_id: ChunkId) -> ChunkVersion | None:
        """The committed version (version 0, empty, if only a pending one exists), or None."""
        with self._lock:
            entry = self._entry(chunk_id)
            return None if entry is None else self._meta(chunk_id, entry.committed or _EMPTY, entry)

    def list_chunks(self, inode: int | None = None) -> Iterator[ChunkVersion]:
        """Metas of all chunks (of one inode), ordered by (inode, index); a snapshot, safe to iterate slowly."""
        with self._lock:
            inodes = [inode] if inode is not None else sorted(self._chunks)
            metas = [
                self._meta(ChunkId(i, x), e.committed or _EMPTY, e)
                for i in inodes
                for x, e in sorted(self._chunks.get(i, {}).items())
            ]
        return iter(metas)

    def remove_files(self, inodes: list[int]) -> list[ChunkId]:
        """Delete every chunk of these inodes in one transaction; returns the chunks that were there (for the
        chain members, which must forget them)."""
        with self._lock:
            inodes = [i for i in inodes if i in self._chunks]
            ids = [ChunkId(i, x) for i in inodes for x in self._chunks[i]]
        removed: list[ChunkId] = []
        for start in range(0, len(inodes), rows.SQL_BATCH):
            part = inodes[start : start + rows.SQL_BATCH]
            mine = set(part)
            removed += self._remove(rows.delete_inodes(part), [c for c in ids if c.inode in mine])
        return removed

    def remove_from(self, inode: int, first: int) -> list[ChunkId]:
        """Delete the chunks of ``inode`` at index ``first`` and beyond (a truncation's tail) in one transaction
        per ``SQL_BATCH`` chunks, not one per chunk; returns the chunks that were there. The DELETE names each
        index, so a chunk written meanwhile past ``first`` is never dropped from disk while it stays in memory."""
        with self._lock:
            indexes = sorted(x for x in self._chunks.get(inode, {}) if x >= first)
        return self._remove_indexes(inode, indexes)

    def remove_chunks(self, chunk_ids: Iterable[ChunkId]) -> list[ChunkId]:
        """Delete these chunks (a resync drops what the chain removed while this target was away: craq/member.py,
        rule 10); returns the ones that were there."""
        by_inode: dict[int, set[int]] = {}
        for cid in chunk_ids:
            by_inode.setdefault(cid.inode, set()).add(cid.index)
        removed: list[ChunkId] = []
        for inode, wanted in sorted(by_inode.items()):
            with self._lock:
                indexes = sorted(x for x in self._chunks.get(inode, {}) if x in wanted)
            removed += self._remove_indexes(inode, indexes)
        return removed

    def _remove_indexes(self, inode: int, indexes: list[int]) -> list[ChunkId]:
        removed: list[ChunkId] = []
        for start in range(0, len(indexes), rows.SQL_BATCH):
            part = indexes[start : start + rows.SQL_BATCH]
            removed += self._remove(rows.delete_indexes(inode, part), [ChunkId(inode, x) for x in part])
        return removed

    def _remove(self, delete: rows.Statement, ids: list[ChunkId]) -> list[ChunkId]:
        with self._db_lock:
            ids = [c for c in ids if self._entry(c) is not None]
            durable = bool(ids) and self._execute(delete, durable=self._write_through)
            with self._lock:
                for cid in ids:
                    entry = self._entry(cid)
                    for v in (entry.committed, entry.pending, self._superseded.pop(cid, None)):
                        if v is not None:
                            self._retire(v, durable)
                    entry.committed = entry.pending = None
                    self._forget_if_empty(cid, entry)
            return ids

    def truncate(self, chunk_id: ChunkId, length: int, version: int) -> ChunkVersion:
        """Cut or zero-extend the chunk to ``length`` as new committed ``version`` (copy-on-write)."""
        if length < 0:
            raise KvfsError(f"chunk {chunk_id}: negative length {length}", errno.EINVAL)
        self._stage(chunk_id, version, length, memoryview(b""), [], 0, full_replace=False, force=False, new_len=length)
        return self.commit(chunk_id, version)

    def replace_full(
        self, chunk_id: ChunkId, version: int, data: bytes | bytearray | memoryview, crc: int
    ) -> ChunkVersion:
        """Install ``data`` as committed ``version`` whatever is there now (resync and repair)."""
        data = memoryview(data).cast("B")
        data_blocks = _checked_block_crcs(chunk_id, version, data, crc)
        self._stage(chunk_id, version, 0, data, data_blocks, crc, full_replace=True, force=True)
        return self.commit(chunk_id, version)

    def write_delta(
        self, chunk_id: ChunkId, version: int, base_version: int, length: int, chunk_crc: int,
        data: bytes | bytearray | memoryview, crc: int, extents: Sequence[Sequence[int]], *, aux: bytes = b"",
        force: bool = False, block_crcs: list[int] | None = None,
    ) -> ChunkVersion:
        """Stage ``version`` = committed ``base_version`` with the whole blocks that ``extents`` of ``data`` hold
        replaced, cut or zero-extended to ``length``: a resync or repair copy of only the blocks that differ,
        written by block-level copy-on-write, so it is as crash-safe as any write. Every block kept from the base
        is read and checked first, and the result must come to ``chunk_crc``; otherwise ChecksumMismatch (or
        StaleVersion if ``base_version`` is no longer committed) and nothing is staged: copy the chunk whole.
        ``force``: ``version`` need not be newer (a repair at the committed version). ``crc``, ``block_crcs``
        and ``aux`` as in :meth:`write_pending`; EINVAL where a run does not cover whole blocks."""
        data = memoryview(data).cast("B")
        data_blocks = _checked_block_crcs(chunk_id, version, data, crc, block_crcs)
        runs = tuple((start, n) for start, n in extents)
        ends = [start + n for start, n in runs]
        if not (0 <= length and sum(n for _, n in runs) == len(data)
                and all(start % BLOCK == 0 and n > 0 and (end % BLOCK == 0 or end == length)
                        for (start, n), end in zip(runs, ends))
                and all(ends[k] <= runs[k + 1][0] for k in range(len(runs) - 1)) and (not runs or ends[-1] <= length)):
            raise KvfsError(f"chunk {chunk_id}: delta runs {list(runs)[:4]}... of {len(data)} bytes are not whole "
                            f"blocks of a {length}-byte version in order", errno.EINVAL)
        return self._stage(chunk_id, version, runs[0][0] if runs else 0, data, data_blocks, crc, full_replace=False,
                           force=force, new_len=length, aux=aux, extents=runs, base=(base_version, chunk_crc))

    def repair_blocks(self, chunk_id: ChunkId, version: int, data: bytes | bytearray | memoryview, crc: int,
                      extents: Sequence[Sequence[int]]) -> ChunkVersion:
        """Replace whole blocks of committed ``version`` by a peer's copies of them (``extents`` of ``data``, as in
        :meth:`write_delta`), as a new copy of the same version with its length, CRCs and ``aux`` unchanged: the
        repair of blocks that failed their CRC. Raises as :meth:`write_delta` (the peer's blocks are not this
        version's, or another block is bad too) with nothing changed."""
        committed, _ = self.versions(chunk_id)
        if committed is None or committed.version != version:
            held = committed.version if committed else 0
            raise StaleVersion(f"chunk {chunk_id}: repair of v{version}, but v{held} is committed")
        self.write_delta(chunk_id, version, version, committed.length, committed.crc, data, crc, extents,
                         aux=committed.aux, force=True)
        return self.commit(chunk_id, version)

    def read_runs(self, chunk_id: ChunkId, version: int, runs: Sequence[tuple[int, int]]) -> bytearray:
        """The bytes of ``runs`` (``(offset, length)``) of ``version``, one after another, every block checked."""
        out = bytearray(sum(n for _, n in runs))
        at = 0
        for start, n in runs:
            got, _ = self.read(chunk_id, start, n, version=version, into=memoryview(out)[at : at + n])
            if got != n:
                raise KvfsError(f"chunk {chunk_id} v{version}: run {start}+{n} past its end", errno.EINVAL)
            at += n
        return out

    def version_blocks(self, chunk_id: ChunkId, version: int) -> tuple[int, array] | None:
        """(length, block CRCs) of the committed or pending ``version`` of a chunk, or None: what a resync
        compares to send only the blocks that differ."""
        with self._lock:
            entry = self._entry(chunk_id)
            v = next((x for x in (entry.committed, entry.pending) if x is not None and x.version == version),
                     None) if entry is not None else None
            return None if v is None else (v.length, array("I", v.blocks))

    def bad_blocks(self, chunk_id: ChunkId) -> tuple[int, list[int]]:
        """(committed version, its blocks whose bytes on the disk fail their CRC), each block read and checked
        on its own: what a repair must fetch. ENOENT if the chunk has no committed version."""
        v = self._pin_version(chunk_id, None)
        try:
            self._settle(v)
            bad = []
            for b in range(_nblocks(v.length)):
                try:
                    self._read_verified(v, b * BLOCK, memoryview(bytearray(min(BLOCK, v.length - b * BLOCK))))
                except ChecksumMismatch:
                    bad.append(b)
            return v.version, bad
        finally:
            self._release(v)

    def space(self) -> tuple[int, int, int]:
        """(capacity, used, free) in bytes for statfs; used counts the slots of live versions."""
        return self._slots.space()

    def local_location(self, chunk_id: ChunkId) -> tuple[Path, int, int, int] | None:
        """(file, offset, length, version) of the committed data, for short-circuit/GPUDirect readers.

        The bytes stay there only until the chunk's next commit or removal: read them, then check
        that ``meta(chunk_id).version`` is still ``version`` (else the slot may hold other data). A held version is
        written out first, so this may wait for the disk."""
        try:
            loc = self.pin_location(chunk_id, None, 0, 0)
        except KvfsError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        loc.release()
        return loc.path, loc.offset, loc.length, loc.version

    def pin_location(self, chunk_id: ChunkId, version: int | None, offset: int, length: int,
                     nowait: bool = False, reads_back: bool = False) -> Location:
        """Where ``version`` (the committed one if None) lies, with the CRCs of the blocks that bytes
        [offset, offset+length) touch, kept in place (its slot not reused) until ``release()``: a short-circuit
        reader on this host reads the slot file itself while the pin holds (chunkserver/README.md, "Short-circuit
        reads"). A held version is written out first, so this may wait for the disk; ``nowait``: BlockingIOError
        instead. Raises ENOENT as :meth:`read`, and EXDEV for a version with overrides: it lies in several places,
        which one location cannot name, so the reader reads it over the network (until a write makes a fresh
        base). ``reads_back``: the reader reads back what is put (see "Readers on this host")."""
        if reads_back:
            self._read_back_at = time.monotonic()
        v = self._pin_version(chunk_id, version)
        try:
            if v.overrides:
                raise KvfsError(f"chunk {chunk_id} v{v.version} lies in {len(v.overrides) + 1} places, not one",
                                errno.EXDEV)
            self._settle(v, nowait)
            n = self._readable(chunk_id, v, offset, length)
        except BaseException:
            self._release(v)
            raise
        first = offset // BLOCK
        blocks = list(v.blocks[first : _nblocks(offset + n)]) if n else []
        return Location(self._slots.files[v.cls].path, v.slot << v.cls, v.length, v.version, first, blocks,
                        functools.partial(self._release, v), v)

    def release_pins(self, pins: Sequence[object]) -> None:
        """End the pins of these locations (their ``pin``), each exactly once."""
        with self._lock:
            for v in pins:
                self._unpin(v)  # type: ignore[arg-type]
