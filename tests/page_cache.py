"""Which pages of a file the page cache holds, by mincore(2) on a mapping of it. A ``RWF_NOWAIT`` read is no probe:
on a miss it starts readahead, whose I/O can finish before the read looks again, and then it finds the pages it
was to show absent."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident(path: str | Path, offset: int, n: int) -> list[bool]:
    """Whether each page of the file's bytes ``[offset, offset + n)`` is in the page cache."""
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    length = offset + n - start
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "mmap")
    finally:
        os.close(fd)
    try:
        vec = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
        if _libc.mincore(addr, length, vec):
            raise OSError(ctypes.get_errno(), "mincore")
        return [bool(v & 1) for v in vec]
    finally:
        _libc.munmap(addr, length)
