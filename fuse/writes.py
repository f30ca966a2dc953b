"""The mount's write path: each open gathers the kernel's writes in a buffer, full buffers go to the chunk
servers in the background (several in flight per open), and every flush reports the file's new end to meta.

Kept apart from :mod:`kvfs.fuse.ops` (which answers FUSE requests) because its rules are about ordering and
errors, not about FUSE: writes to the same bytes reach storage in the order they were made, whichever open made
them; a failed background flush is reported to the open's writer at its next write, flush or fsync, never to a
reader that happened to trigger it; and a buffer lives in shared memory while there is room, so the chunk
servers of this host receive it without a copy through the socket (:mod:`kvfs.transport.shm`).
"""

from __future__ import annotations

import errno
import logging
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


@dataclass(eq=False)
class InodeState:
    """What the mount knows about a file it has open: shared by all its handles."""

    ino: int
    layout: Layout
    size: int  # the length as this mount knows it: meta's, extended by local writes, set by truncate
    stamp: Stamp = (0, 0)  # (mtime_ns, size) meta gave at the latest open: what cached blocks are read under
    changes: int = 0  # local writes and truncations so far: a cache fill that raced one must not be kept
    handles: set = field(default_factory=set)

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
    flushes: list[tuple[int, int, trio.Event]] = field(default_factory=list)  # in flight: [start, end), done
    error: OSError | None = None  # a failed background flush, reported at the next write/flush/fsync

    def holds(self, lo: int = 0, hi: int = sys.maxsize) -> bool:
        """Bytes of ``[lo, hi)`` written here that storage may not have yet (buffered or being flushed)."""
        return (self.buf_len > 0 and self.buf_off < hi and lo < self.buf_off + self.buf_len) or any(
            s < hi and lo < e for s, e, _ in self.flushes)

    def raise_error(self) -> None:
        """Report (once) a flush failure that happened since the writer last heard from this open."""
        if self.error is not None:
            err, self.error = self.error, None
            raise err


def _write_buffer(size: int) -> Any:
    """A buffer for a handle's writes, of at least ``size`` bytes: in this process's shared memory while there is
    room, so chunk writes to chunk servers on this host go by shared memory (:mod:`kvfs.transport.shm`)."""
    return SHARED.take(1 << (size - 1).bit_length())


class WriteBack:
    """Buffers, flushes and length reports of a mount's open files.

    ``changed(state, offset, length)`` is called under the open's lock before bytes are taken, so caches of the
    range drop them; ``reported(ino)`` after meta took a new length (the kernel's copy of the attributes is stale
    then). ``nursery`` runs background flushes; without one every flush is waited for.
    """

    def __init__(self, meta: Any, storage: Any, *, write_buffer: int, flush_depth: int, write_parallel: int,
                 changed: Callable[[InodeState, int, int], None], reported: Callable[[int], None]) -> None:
        self.meta = meta
        self.storage = storage
        self.write_buffer = write_buffer
        self.flush_depth = flush_depth
        self.write_limit = trio.CapacityLimiter(write_parallel)
        self._changed = changed
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
        await per_chunk(self.storage.write, st.ino, st.layout, off, data, self.write_limit)
        end = off + len(data)
        st.size = max(st.size, end)
        if h.session is not None:
            await self.meta.report_length(h.caller, st.ino, h.session, end)
            self._reported(st.ino)

    @staticmethod
    async def _wait_inflight(h: Handle) -> None:
        while h.flushes:
            await h.flushes[0][2].wait()

    async def _start_flush(self, h: Handle) -> None:
        """Hand the full buffer to a background task and continue in another, so the writer fills one while
        others travel (caller holds h.lock). Up to ``flush_depth`` flushes of a handle are in flight, which keeps
        the chains fed across one flush's tail; a flush that overlaps an earlier one waits for it, so the
        handle's writes to the same bytes reach storage in order."""
        if not h.buf_len:
            return
        lo, hi = h.buf_off, h.buf_off + h.buf_len
        while h.flushes and (len(h.flushes) >= self.flush_depth or any(s < hi and lo < e for s, e, _ in h.flushes)):
            await h.flushes[0][2].wait()
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
            await self._write_through(h, off, view)
        except Exception as e:  # noqa: BLE001 - reported to the writer at its next write/flush/fsync
            _keep_error(h, e, off, end - off, "background flush")
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
        if not h.buf_len:
            return
        data = memoryview(h.buf)[:h.buf_len]
        try:
            await self._write_through(h, h.buf_off, data)
        except Exception as e:  # noqa: BLE001
            _keep_error(h, e, h.buf_off, h.buf_len, "flush")
        finally:
            h.buf_len = 0
            data.release()


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
