"""Large byte buffers reused instead of allocated per message.

A fresh multi-MiB ``bytearray`` costs a memset and, once glibc hands it out as new pages, a page fault per
4 KiB: about a tenth of a chunk server's CPU while it takes writes. Buffers that are filled completely before
anyone reads them (a received data section, a file read) can be reused instead. :data:`RECEIVED`'s buffers are
page-aligned anonymous mappings, so a chunk server can hand them to the disk with ``O_DIRECT``.

There is no "give back" call: the data flows on to threads, replication peers and FUSE replies whose ends are
hard to pin down, and a buffer given back too early would be overwritten under a reader. Instead the pool
keeps its own reference and hands a buffer out again only when that is the only reference left (CPython
reference counts are exact: every memoryview of the buffer holds one too).
"""

from __future__ import annotations

import mmap
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_FREE_REFS = 3  # the pool's list, the loop variable looking at it, and getrefcount's own argument


class BufferPool:
    """Reusable buffers of power-of-two sizes from ``min_size`` up, at most ``capacity`` bytes held in all.

    ``take(n)`` returns a writable buffer of exactly ``n`` bytes whose contents are garbage: the caller must fill
    all of it before it is read. Other sizes, and any beyond ``capacity``, get a fresh bytearray. ``allocate(n)``
    makes the pooled buffers (a bytearray by default; :data:`kvfs.transport.shm.SHARED` carves them from shared
    memory), or returns None to fall back to a bytearray. Thread-safe."""

    def __init__(self, capacity: int = 256 << 20, min_size: int = 256 << 10,
                 allocate: Callable[[int], Any | None] = bytearray) -> None:
        self.capacity = capacity
        self.min_size = min_size
        self.held = 0
        self._allocate = allocate
        self._by_size: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        self._last_take = time.monotonic()
        self._trimmed: set[int] = set()  # ids of pooled buffers whose pages were given back and not used since

    def take(self, n: int) -> Any:
        if n < self.min_size or n & (n - 1):
            return bytearray(n)
        with self._lock:
            self._last_take = time.monotonic()
            pooled = self._by_size.setdefault(n, [])
            for buf in pooled:
                if sys.getrefcount(buf) == _FREE_REFS:
                    self._trimmed.discard(id(buf))
                    return buf
            if self.held + n <= self.capacity:
                buf = self._allocate(n)
                if buf is not None:
                    pooled.append(buf)
                    self.held += n
                    return buf
            return bytearray(n)

    def view(self, n: int) -> memoryview:
        """``n`` bytes at the start of a pooled buffer of the next pooled size up, garbage as from :meth:`take`:
        sizes that are not a power of two (a 128 KiB block, a short last piece) are reused too, not allocated
        and faulted in afresh per message."""
        return memoryview(self.take(max(self.min_size, 1 << (n - 1).bit_length()) if n else 0))[:n]

    def trim(self, idle: float) -> int:
        """Give the pages of unused mapped buffers (shared memory, :func:`page_aligned`) back to the system once
        nothing was taken for ``idle`` seconds (they stay pooled and are refilled with zero pages on next use);
        returns the bytes given back. Only :func:`mmap.mmap` buffers can: a process keeps what ``bytearray``
        buffers its pool holds. A buffer let go of after the pool went idle (held writes that a later flush wrote
        out) is given back by the next call."""
        given = 0
        with self._lock:
            if time.monotonic() - self._last_take < idle:
                return 0
            for size, pooled in self._by_size.items():
                for buf in pooled:
                    if (isinstance(buf, mmap.mmap) and id(buf) not in self._trimmed
                            and sys.getrefcount(buf) == _FREE_REFS):
                        self._trimmed.add(id(buf))
                        try:
                            buf.madvise(mmap.MADV_REMOVE)  # shared memory: frees the pages themselves
                        except OSError:
                            buf.madvise(mmap.MADV_DONTNEED)  # private memory (page_aligned)
                        given += size
        return given


def page_aligned(n: int) -> mmap.mmap:
    """Private anonymous memory: page-aligned, so a chunk server writes what it received to disk with O_DIRECT
    (a large bytearray's data starts 16 bytes into its pages)."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


RECEIVED = BufferPool(allocate=page_aligned)
"""The process's pool for data sections received over RPC and for file reads (mount, chunk server)."""
