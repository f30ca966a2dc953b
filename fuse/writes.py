"""The mount's write path: each open gathers the kernel's writes in a buffer, full buffers go to the chunk
servers in the background (several in flight per open), and every flush reports the file's new end to meta.
Small writes that do not continue the buffer are gathered per chunk (:class:`DirtyRuns`), as a page cache
would hold them, and go out together: scattered 4 KiB writes cost a chain round per chunk, not per write.

Kept apart from :mod:`kvfs.fuse.ops` (which answers FUSE requests) because its rules are about ordering and
errors, not about FUSE: writes to the same bytes reach storage in the order they were made, whichever open made
them; a failed background flush is reported to the open's writer at its next write, flush or fsync, never to a
reader that happened to trigger it; and a buffer lives in shared memory while there is room, so the chunk
servers of this host receive it without a copy through the socket (:mod:`kvfs.transport.shm`).
"""

from __future__ import annotations

import errno
import logging
from bisect import bisect_right
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from kvfs.aio import one_error
from kvfs.meta.types import Caller, Layout
from kvfs.transport.shm import SHARED

from .cache import Stamp

log = logging.getLogger(__name__)

MIB = 1 << 20
FLUSH_DEPTH = 8  # write flushes in flight per open file (see WriteBack.start_flush)
SPARSE_WRITE = 128 << 10  # a smaller write that does not continue the open's buffer is gathered (DirtyRuns)
RUNS_DEPTH = 2  # flushes of gathered runs in flight per open file (each up to a write buffer's worth)


@dataclass(eq=False)
class InodeState:
    """What the mount knows about a file it has open: shared by all its handles."""

    ino: int
    layout: Layout
    size: int  # the length as this mount knows it: meta's, extended by local writes, set by truncate
    stamp: Stamp = (0, 0)  # (mtime_ns, size) meta gave at the latest open: what cached blocks are read under
    changes: int = 0  # local writes and truncations so far: a cache fill that raced one must not be kept
    handles: set = field(default_factory=set)
    #: held while an exact length goes to meta (fsync): two opens' fsyncs side by side would otherwise race, and an
    #: older, shorter length taken first could reach meta last and cut off what the other open wrote
    exact_length: trio.Lock = field(default_factory=trio.Lock)

    def dirty(self) -> bool:
        """Bytes written here that meta has not heard of yet (buffered or being flushed)."""
        return any(h.holds() for h in self.handles)


@dataclass(eq=False)
class Handle:
    """One open of a file: who opened it, its sessions with meta, and its write buffer and flushes."""

    fh: int
    state: InodeState
    flags: int
    caller: Caller
    session: int | None
    hold: int | None = None  # a read-only open's hold session: the file outlives its last name while open
    direct: bool = False  # the kernel sends its writes without the page cache (see KvfsOperations._attach)
    set_id: bool = False  # a set-id file opened for writing by anyone but root: its first write drops the bits
    lock: trio.Lock = field(default_factory=trio.Lock)
    buf: Any = field(default_factory=bytearray)  # bytearray, or a buffer in shared memory (_write_buffer)
    buf_off: int = 0
    buf_len: int = 0
    spares: list[Any] = field(default_factory=list)  # flushed buffers, for the next ones to fill
    runs: DirtyRuns | None = None  # scattered small writes not yet flushed
    runs_flushes: int = 0  # flushes of gathered runs in flight
    flushes: list[tuple[int, int, trio.Event]] = field(default_factory=list)  # in flight: [start, end), done
    error: OSError | None = None  # a failed background flush, reported at the next write/flush/fsync

    def holds(self, lo: int = 0, hi: int = sys.maxsize) -> bool:
        """Bytes of ``[lo, hi)`` written here that storage may not have yet (buffered or being flushed)."""
        return (self.buffered(lo, hi) or (self.runs is not None and self.runs.overlaps(lo, hi))
                or any(s < hi and lo < e for s, e, _ in self.flushes))

    def buffered(self, lo: int, hi: int) -> bool:
        """Whether the sequential buffer holds bytes of ``[lo, hi)``."""
        return self.buf_len > 0 and self.buf_off < hi and lo < self.buf_off + self.buf_len

    def raise_error(self) -> None:
        """Report (once) a flush failure that happened since the writer last heard from this open."""
        if self.error is not None:
            err, self.error = self.error, None
            raise err


class DirtyRuns:
    """Scattered writes of one open, per chunk: sorted runs that neither overlap nor touch (a write that
    overlaps or adjoins runs merges with them, the later bytes winning). A chunk's runs go out as one storage
    call, so a program that writes 4 KiB pages here and there (a database, a build tree) costs the chunk
    servers a chain round per chunk and flush, not per write."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.chunks: dict[int, tuple[list[int], list[bytearray]]] = {}  # index -> (run starts, run bytes)
        self.size = 0  # bytes held, the bound a flush is started at

    def add(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        for pos, at, n in _chunk_pieces(self.chunk_size, offset, len(view)):
            self._add_piece(pos // self.chunk_size, pos, view[at:at + n])

    def _add_piece(self, index: int, offset: int, data: memoryview) -> None:
        starts, runs = self.chunks.setdefault(index, ([], []))
        end = offset + len(data)
        first = bisect_right(starts, offset) - 1
        if first < 0 or starts[first] + len(runs[first]) < offset:
            first += 1  # no run starts at or before offset and reaches it
        last = first
        while last < len(starts) and starts[last] <= end:
            last += 1  # runs [first, last) overlap or adjoin the write
        old = sum(len(r) for r in runs[first:last])
        if first < last and starts[first] <= offset:
            base, merged = starts[first], runs[first]
            merged[offset - base:end - base] = data  # patched in place (extended when the write goes past it)
            following = range(first + 1, last)
        else:
            base, merged = offset, bytearray(data)
            following = range(first, last)
        for k in following:
            tail = base + len(merged) - starts[k]
            if tail < len(runs[k]):
                merged += memoryview(runs[k])[tail:]
        starts[first:last] = [base]
        runs[first:last] = [merged]
        self.size += len(merged) - old

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether runs hold bytes of ``[lo, hi)``: a look at the chunks of the range only, as every read and
        write of a dirty file asks."""
        if hi <= lo:
            return False
        first, last = lo // self.chunk_size, (hi - 1) // self.chunk_size
        if last - first < len(self.chunks):
            candidates = [got for index in range(first, last + 1) if (got := self.chunks.get(index)) is not None]
        else:  # a range of more chunks than hold runs (the whole file): the chunks that do
            candidates = [got for index, got in self.chunks.items() if first <= index <= last]
        for starts, runs in candidates:
            i = bisect_right(starts, hi - 1) - 1  # the last run starting below hi
            if i >= 0 and lo < starts[i] + len(runs[i]):
                return True
        return False

    def copy_into(self, out: memoryview, offset: int) -> None:
        """Lay the runs' bytes in ``[offset, offset + len(out))`` over ``out``, what storage holds there."""
        end = offset + len(out)
        for index in range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1):
            starts, runs = self.chunks.get(index, ((), ()))
            i = max(0, bisect_right(starts, offset) - 1)
            while i < len(starts) and starts[i] < end:
                s, t = max(offset, starts[i]), min(end, starts[i] + len(runs[i]))
                if s < t:
                    out[s - offset:t - offset] = memoryview(runs[i])[s - starts[i]:t - starts[i]]
                i += 1

    def spans(self) -> list[tuple[int, int]]:
        """Per chunk, the range from its first run's start to its last run's end."""
        return [(starts[0], starts[-1] + len(runs[-1])) for starts, runs in self.chunks.values()]

    def bounds(self) -> tuple[int, int]:
        """Where the runs start and end, over all chunks."""
        spans = self.spans()
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)


def _write_buffer(size: int) -> Any:
    """A buffer for a handle's writes, of at least ``size`` bytes: in this process's shared memory while there is
    room, so chunk writes to chunk servers on this host go by shared memory (:mod:`kvfs.transport.shm`)."""
    return SHARED.take(1 << (size - 1).bit_length())


class WriteBack:
    """Buffers, flushes and length reports of a mount's open files.

    ``changed(state, offset, length)`` is called under the open's lock before bytes are taken, so caches of the
    range drop them; ``wrote(state)`` once storage took (some of) a flush, so what was located in storage before
    it (a pinned chunk version) is not read from any more (reads do not wait for gathered writes, see
    :meth:`gathered_over`); ``reported(ino)`` after meta took a new length (the kernel's copy of the attributes
    is stale then). ``nursery`` runs background flushes; without one every flush is waited for.
    """

    def __init__(self, meta: Any, storage: Any, *, write_buffer: int, flush_depth: int, write_parallel: int,
                 changed: Callable[[InodeState, int, int], None], wrote: Callable[[InodeState], None],
                 reported: Callable[[int], None]) -> None:
        self.meta = meta
        self.storage = storage
        self.write_buffer = write_buffer
        self.flush_depth = flush_depth
        self.write_limit = trio.CapacityLimiter(write_parallel)
        self._changed = changed
        self._wrote = wrote
        self._reported = reported
        self.nursery: trio.Nursery | None = None

    async def write(self, h: Handle, off: int, buf: Any) -> None:
        """Take one write of ``h``'s: into its buffer, or (as large as a buffer) straight to storage."""
        st = h.state
        n = len(buf)
        async with h.lock:
            h.raise_error()
            if h.flags & os.O_APPEND and st.size > off:
                off = st.size  # another writer of this inode appended meanwhile
            self._changed(st, off, n)
            continues = h.buf_len and off == h.buf_off + h.buf_len
            if 0 < n < SPARSE_WRITE and (h.buf_len or h.runs) and not continues:
                await self._gather(h, off, buf)
                return
            if h.runs is not None and h.runs.overlaps(off, off + n):
                await self._start_runs_flush(h)  # they hold older bytes of the range: out first
            if h.buf_len and (off != h.buf_off + h.buf_len or h.buf_len + n > self.write_buffer):
                await self._start_flush(h)
            if n >= self.write_buffer:
                await self._wait_inflight(h)
                await self._write_through(h, off, memoryview(buf))
                return
            if not h.buf_len:
                h.buf_off = off
            if len(h.buf) < h.buf_len + n:  # grown as a file's writes go on: small files keep small buffers
                grown = _write_buffer(min(max(h.buf_len + n, 2 * len(h.buf), MIB), self.write_buffer))
                memoryview(grown)[:h.buf_len] = memoryview(h.buf)[:h.buf_len]
                h.buf = grown
            memoryview(h.buf)[h.buf_len:h.buf_len + n] = buf
            h.buf_len += n
            st.size = max(st.size, off + n)
            if h.buf_len >= self.write_buffer:
                await self._start_flush(h)

    async def _gather(self, h: Handle, off: int, buf: Any) -> None:
        """Add a small scattered write to the open's runs (caller holds h.lock); flush them once they hold a
        write buffer's worth."""
        if h.buffered(off, off + len(buf)):
            await self._start_flush(h)  # the buffer holds older bytes of the range: out first
        if h.runs is None:
            h.runs = DirtyRuns(h.state.layout.chunk_size)
        h.runs.add(off, buf)
        h.state.size = max(h.state.size, off + len(buf))
        if h.runs.size >= self.write_buffer:
            await self._start_runs_flush(h)

    @staticmethod
    def gathered_over(st: InodeState, lo: int, hi: int) -> list[DirtyRuns] | None:
        """What a read of ``[lo, hi)`` lays over the bytes it reads from storage instead of waiting for them to be
        written out, as a page cache serves reads from dirty pages (a database re-reading pages it just wrote would
        otherwise pay a chain round per read): [] where nothing written here is pending there, the one open's
        gathered runs that hold all of it, or None where the read must wait for a flush (a sequential buffer or a
        flush in flight holds some of it, or two opens' runs do, and which of them is newer is not kept)."""
        found: list[DirtyRuns] = []
        for h in st.handles:
            if h.buffered(lo, hi) or any(s < hi and lo < e for s, e, _ in h.flushes):
                return None
            if h.runs is not None and h.runs.overlaps(lo, hi):
                if found:
                    return None
                found.append(h.runs)
        return found

    async def flush_inode(self, st: InodeState, lo: int = 0, hi: int = sys.maxsize, but: Handle | None = None
                          ) -> None:
        """Write out what the file's opens (but ``but``) hold of ``[lo, hi)``. Each open flushes its buffer on its
        own schedule, so a write flushes the other opens' bytes it overlaps first. Each lock is taken alone
        (a writer calls this before taking its own)."""
        for h in list(st.handles):
            if h is not but and h.holds(lo, hi):
                async with h.lock:
                    await self._flush_handle(h)

    async def _write_through(self, h: Handle, off: int, data: memoryview) -> None:
        """Write ``data`` at ``off`` (chunk pieces in parallel), then report the new end to meta."""
        st = h.state
        try:
            await per_chunk(self.storage.write, st.ino, st.layout, off, data, self.write_limit)
        finally:
            self._wrote(st)
        await self._report(h, off + len(data))

    async def _write_runs(self, h: Handle, runs: DirtyRuns) -> None:
        """Write gathered runs, every chunk's in one storage call (a chain round per chain for all of them: see
        ``StorageClient.write_many``), then report the new end to meta."""
        st = h.state
        gathered = [run for starts, pieces in runs.chunks.values() for run in zip(starts, pieces)]
        try:
            async with self.write_limit:
                await self.storage.write_runs(st.ino, st.layout, gathered)
        finally:
            self._wrote(st)
        await self._report(h, runs.bounds()[1])

    async def _report(self, h: Handle, end: int) -> None:
        st = h.state
        st.size = max(st.size, end)
        if h.session is not None:
            try:
                await self.meta.report_length(h.caller, st.ino, h.session, end)
            finally:  # a report whose answer was lost may have changed them too
                self._reported(st.ino)

    @staticmethod
    async def _wait_inflight(h: Handle) -> None:
        while h.flushes:
            await h.flushes[0][2].wait()

    async def _wait_room(self, h: Handle, spans: list[tuple[int, int]]) -> None:
        """Wait until fewer than ``flush_depth`` flushes are in flight and none overlaps ``spans``, so the
        handle's writes to the same bytes reach storage in order."""
        while h.flushes and (len({done for _, _, done in h.flushes}) >= self.flush_depth or any(
                s < hi and lo < e for s, e, _ in h.flushes for lo, hi in spans)):
            await h.flushes[0][2].wait()

    async def _start_runs_flush(self, h: Handle) -> None:
        """Hand the gathered runs to a background flush, a chunk's runs in one storage call (caller holds
        h.lock). The flush waits in the background for the earlier flushes of the same bytes, so the writer
        goes on gathering meanwhile; at most ``RUNS_DEPTH`` are in flight per open, which bounds its memory."""
        if h.runs is None:
            return
        while h.runs_flushes >= RUNS_DEPTH:
            await h.flushes[0][2].wait()
        if self.nursery is None:
            await self._flush_gathered(h)
            h.raise_error()
            return
        runs, h.runs = h.runs, None
        spans = runs.spans()
        earlier = {done for s, e, done in h.flushes for lo, hi in spans if s < hi and lo < e}
        done = trio.Event()
        flushes = [(lo, hi, done) for lo, hi in spans]
        h.flushes.extend(flushes)
        h.runs_flushes += 1
        self.nursery.start_soon(self._background_runs, h, runs, flushes, earlier)

    async def _background_runs(self, h: Handle, runs: DirtyRuns, flushes: list[tuple[int, int, trio.Event]],
                               earlier: set[trio.Event]) -> None:
        try:
            for event in earlier:  # in the order the writes were made
                await event.wait()
            await self._flush_runs(h, runs, "background flush")
        finally:
            h.runs_flushes -= 1
            for flush in flushes:
                h.flushes.remove(flush)
            flushes[0][2].set()

    async def _start_flush(self, h: Handle) -> None:
        """Hand the full buffer to a background task and continue in another, so the writer fills one while
        others travel (caller holds h.lock). Up to ``flush_depth`` flushes of a handle are in flight, which keeps
        the chains fed across one flush's tail; a flush that overlaps an earlier one waits for it, so the
        handle's writes to the same bytes reach storage in order."""
        if not h.buf_len:
            return
        lo, hi = h.buf_off, h.buf_off + h.buf_len
        await self._wait_room(h, [(lo, hi)])
        if self.nursery is None:
            await self._flush_handle(h)
            h.raise_error()
            return
        data = h.buf
        h.buf = h.spares.pop() if h.spares else bytearray()
        h.buf_len = 0
        flush = (lo, hi, trio.Event())
        h.flushes.append(flush)
        self.nursery.start_soon(self._background_flush, h, data, flush)

    async def _background_flush(self, h: Handle, data: Any, flush: tuple[int, int, trio.Event]) -> None:
        off, end, done = flush
        view = memoryview(data)[:end - off]
        try:
            await self._flush_now(h, lambda: self._write_through(h, off, view), off, end - off, "background flush")
        finally:
            view.release()
            if len(h.spares) < self.flush_depth:
                h.spares.append(data)
            h.flushes.remove(flush)
            done.set()

    async def _flush_handle(self, h: Handle) -> None:
        """Write out the handle's buffer and wait for its flushes (caller holds h.lock). A failure drops the
        buffer and is kept for the handle's writer, as with a background flush: a reader that triggered the
        flush does not get it."""
        await self._wait_inflight(h)
        if h.runs is not None and 0 < h.buf_len < SPARSE_WRITE:
            # A small buffer beside gathered runs (the first write after a flush starts a buffer, the scattered
            # ones after it are gathered) goes with them: one chain round, not two in a row
            h.runs.add(h.buf_off, memoryview(h.buf)[:h.buf_len])
            h.buf_len = 0
        await self._flush_gathered(h)  # never the same bytes as the buffer: a write to one sends the other out first
        if not h.buf_len:
            return
        data = memoryview(h.buf)[:h.buf_len]
        try:
            await self._flush_now(h, lambda: self._write_through(h, h.buf_off, data), h.buf_off, h.buf_len, "flush")
        finally:
            h.buf_len = 0
            data.release()

    async def _flush_gathered(self, h: Handle) -> None:
        """Write the open's gathered runs and wait for them (caller holds h.lock). They stay in ``h.runs`` until
        written: the kernel sends one large read as several FUSE reads side by side, and one that comes meanwhile
        must still find the inode dirty and wait for this lock, not read what storage holds yet."""
        if h.runs is None:
            return
        try:
            await self._flush_runs(h, h.runs, "flush")
        finally:
            h.runs = None

    async def _flush_runs(self, h: Handle, runs: DirtyRuns, what: str) -> None:
        lo, hi = runs.bounds()
        await self._flush_now(h, lambda: self._write_runs(h, runs), lo, hi - lo, what)

    @staticmethod
    async def _flush_now(h: Handle, write: Callable[[], Any], off: int, length: int, what: str) -> None:
        """Run one flush; a failure is kept for the handle's writer (see :meth:`Handle.raise_error`)."""
        try:
            await write()
        except Exception as e:  # noqa: BLE001 - reported to the writer at its next write/flush/fsync
            _keep_error(h, e, off, length, what)


def _keep_error(h: Handle, e: Exception, off: int, length: int, what: str) -> None:
    log.warning("%s of inode %d [%d, +%d) failed: %r", what, h.state.ino, off, length, e)
    h.error = e if isinstance(e, OSError) else OSError(errno.EIO, repr(e))


async def parallel(fn: Callable[..., Any], pieces: list[tuple]) -> None:
    """Run ``fn(*piece)`` for every piece concurrently; a failure comes out as the plain exception."""
    async with one_error(), trio.open_nursery() as nursery:
        for piece in pieces:
            nursery.start_soon(fn, *piece)


async def per_chunk(io: Callable[..., Any], ino: int, layout: Layout, offset: int, view: memoryview,
                    limit: trio.CapacityLimiter) -> None:
    """``io(ino, layout, offset, piece)`` for each chunk-aligned piece of ``view`` (the file's bytes from
    ``offset``): pieces of different chunks may be on different chains, so they travel side by side, at most
    ``limit`` of the mount's at once."""
    pieces = list(_chunk_pieces(layout.chunk_size, offset, len(view)))
    if len(pieces) == 1:
        await io(ino, layout, offset, view)
        return

    async def one(piece_offset: int, start: int, n: int) -> None:
        async with limit:
            await io(ino, layout, piece_offset, view[start:start + n])

    await parallel(one, pieces)


def _chunk_pieces(chunk_size: int, offset: int, length: int):
    """(file offset, buffer offset, length) of each chunk-aligned piece of a range."""
    pos, end = offset, offset + length
    while pos < end:
        n = min(chunk_size - pos % chunk_size, end - pos)
        yield pos, pos - offset, n
        pos += n
