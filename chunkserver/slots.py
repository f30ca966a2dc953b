"""Slot files of one storage target: the bytes of chunk versions (see :mod:`kvfs.chunkserver.engine`).

``data/NN.dat`` holds slots of 2**NN bytes (NN = 16 .. 26, i.e. 64 KiB .. 64 MiB); slot s occupies bytes
[s * 2**NN, (s + 1) * 2**NN). Files are preallocated with ``posix_fallocate`` and slots are reused, so a write
never creates a file. This module allocates and frees slots and moves bytes in and out of them (direct I/O where
the file system takes it, see the engine's "Direct I/O"); it knows nothing of versions or rows. Its callers
hold the engine's lock, passed in as ``lock``, around allocation and freeing; it takes the lock itself only to
give up direct I/O and to replace a mapping.

Slot files grow only while the target's file system keeps ``reserve`` bytes free (:func:`default_reserve`), so
a disk that chunk data fills still has room for what shares it: the KV store, logs, this target's own SQLite
rows. Past that, a version goes into a free slot of its class, or of a larger class (freed slots count as room
whatever size they are), and else the write fails with ENOSPC.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from kvfs.errors import KvfsError
from kvfs.pool import RECEIVED, page_aligned
from kvfs.transport.buffers import buffer_address

log = logging.getLogger("kvfs.chunkserver.engine")

MIN_CLASS_LOG2 = 16
MAX_CLASS_LOG2 = 26
_GROW_BYTES = 256 << 20  # the most a slot file grows by at once (see SlotFiles._grow)
#: The most a target keeps free of its file system by default: MooseFS's chunk servers leave 256 MiB per disk
#: (``HDD_LEAVE_SPACE_DEFAULT``) for the same reason.
MAX_DEFAULT_RESERVE = 256 << 20
#: What O_DIRECT needs aligned (buffer address, file offset, length): the page, which covers any disk's logical
#: block (512 B, or 4 KiB on 4Kn disks) without asking each file system.
DIRECT_ALIGN = mmap.PAGESIZE


def class_for(length: int) -> int:
    """The size class (log2 of the slot size) of a version of ``length`` bytes."""
    return max(MIN_CLASS_LOG2, (max(length, 1) - 1).bit_length())


def enospc(what: str) -> KvfsError:
    return KvfsError(what, errno.ENOSPC)


def default_reserve(root: Path) -> int:
    """Bytes of ``root``'s file system that chunk data leaves free unless configured: 256 MiB, or a tenth of a
    file system smaller than 2.5 GiB. What it protects (a KV store's WAL, logs, SQLite rows) does not grow with
    the disk, and a small disk should not lose most of itself to it."""
    st = os.statvfs(root)
    return min(MAX_DEFAULT_RESERVE, st.f_blocks * st.f_frsize // 10)


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


@dataclass(slots=True)
class SlotFile:
    path: Path
    fd: int
    size: int
    total: int
    free: list[int]
    direct: int = -1  # the same file opened O_DIRECT, or -1: writes go through the page cache


class SlotFiles:
    """The slot files of the target at ``root``, their free lists and the bytes in use."""

    def __init__(self, root: Path, *, direct_io: bool, capacity_bytes: int | None, lock: threading.Lock,
                 reserve_bytes: int | None = None) -> None:
        self.root = root
        self._direct_io = direct_io
        self._capacity = capacity_bytes
        self._lock = lock
        self._refused_fds: list[int] = []
        self._mappings: dict[int, memoryview] = {}  # size class -> read-only mapping of its slot file (lend)
        self.used = 0
        (root / "data").mkdir(parents=True, exist_ok=True)
        self.reserve = default_reserve(root) if reserve_bytes is None else reserve_bytes
        self.files = {c: self._open(c) for c in range(MIN_CLASS_LOG2, MAX_CLASS_LOG2 + 1)}
        if direct_io and any(f.direct < 0 for f in self.files.values()):
            log.warning("target %s: its file system refuses O_DIRECT; slot data is written through the page cache",
                        root)

    def _open(self, cls: int) -> SlotFile:
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
        return SlotFile(path, fd, size, os.fstat(fd).st_size // size, [], direct)

    def close(self) -> None:
        self._mappings.clear()  # each mapping goes when the last view of it does
        for f in self.files.values():
            os.close(f.fd)
            if f.direct >= 0:
                os.close(f.direct)
        for fd in self._refused_fds:
            os.close(fd)

    # ----------------------------------------------------------------- allocation (the caller holds the lock)

    def mark_used(self, used: list[tuple[int, int]]) -> None:
        """At open: the slots ``used`` (``(cls, slot)`` of each row) are in use, every other one is free."""
        self.used = sum(1 << cls for cls, _ in used)
        taken = set(used)
        for cls, f in self.files.items():
            f.free = [s for s in range(f.total - 1, -1, -1) if (cls, s) not in taken]

    def alloc(self, length: int, *, grow: bool = True) -> tuple[int, int] | None:
        """A free slot for ``length`` bytes; without one, a new slot at the end of the file, or None if not ``grow``.
        Where the file may not grow (the reserve, a full disk), a free slot of a larger class serves."""
        cls = class_for(length)
        if cls > MAX_CLASS_LOG2:
            raise KvfsError(f"chunk length {length} exceeds {1 << MAX_CLASS_LOG2}", errno.EINVAL)
        f = self.files[cls]
        if self._capacity is not None and self.used + f.size > self._capacity:
            raise enospc(f"target {self.root} full: {self.used} of {self._capacity} bytes used")
        if f.free:
            slot = f.free.pop()
        elif not grow:
            return None
        else:
            slot = f.total
            try:
                f.total += self._grow(f)
            except KvfsError:
                larger = next((g for g in self.files.values() if g.size > f.size and g.free), None)
                if larger is None:
                    raise
                f, slot = larger, larger.free.pop()
            else:
                f.free.extend(range(f.total - 1, slot, -1))  # the rest of the step, lowest first
        self.used += f.size
        return f.size.bit_length() - 1, slot

    def _grow(self, f: SlotFile) -> int:
        """Add slots at the end of ``f`` (the caller holds the lock) and return how many: as many as it has, up to
        ``_GROW_BYTES``. Each fallocate waits for the file system's journal, and every engine call waits for the
        lock meanwhile, so a file grows in steps rather than slot by slot; a flush that writes out held versions
        also holds the file's inode lock that fallocate needs, which steps of 256 MiB keep rare. A disk too full
        for the step still gets a single slot; none where it would eat into the reserve."""
        st = os.statvfs(self.root)
        room = st.f_bavail * st.f_frsize - self.reserve
        if room < f.size:
            raise enospc(f"target {self.root}: its file system has {max(0, room + self.reserve) >> 20} MiB free, and"
                         f" chunk data leaves {self.reserve >> 20} MiB of it to the KV store and logs")
        step = max(1, min(f.total, _GROW_BYTES // f.size, room // f.size))
        while True:
            try:
                os.posix_fallocate(f.fd, f.total * f.size, step * f.size)
                return step
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if step == 1:
                    raise enospc(f"disk of target {self.root} is full") from e
                step = 1

    def release(self, cls: int, slot: int) -> None:
        """Slot ``(cls, slot)`` is free for reuse."""
        self.files[cls].free.append(slot)
        self.used -= 1 << cls

    def space(self) -> tuple[int, int, int]:
        """(capacity, used, free) in bytes; used counts the slots in use, free includes the free slots and leaves
        out the reserve."""
        st = os.statvfs(self.root)
        with self._lock:
            pooled = sum(len(f.free) * f.size for f in self.files.values())
            used = self.used
        capacity = self._capacity if self._capacity is not None else st.f_blocks * st.f_frsize
        growable = max(0, st.f_bavail * st.f_frsize - self.reserve)
        return capacity, used, max(0, min(capacity - used, growable + pooled))

    # ----------------------------------------------------------------- data I/O

    def write(self, cls: int, data: memoryview, offset: int, cached: bool = False) -> None:
        """Write ``data`` at ``offset`` of slot file ``cls``: its page-aligned head around the page cache where it
        can (see "Direct I/O") and not ``cached``, the rest through it."""
        f = self.files[cls]
        n = _direct_length(data, offset) if f.direct >= 0 and not cached else 0
        if n:
            try:
                _write_all(f.direct, data[:n], offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._stop_direct(f, e)
                n = 0  # all of it again, through the page cache
        _write_all(f.fd, data[n:], offset + n)

    def copy(self, src_cls: int, src_off: int, dst_cls: int, dst_off: int, n: int) -> int:
        """Copy up to ``n`` bytes between slot files in the kernel; returns how many it copied."""
        return os.copy_file_range(self.files[src_cls].fd, self.files[dst_cls].fd, n, src_off, dst_off)

    def read(self, cls: int, buffers: list[memoryview], offset: int, nowait: bool) -> int:
        """Read into ``buffers`` from ``offset`` of slot file ``cls`` through the page cache; ``nowait``: only what
        is cached (``RWF_NOWAIT``), else BlockingIOError, which the caller answers by reading in a thread. A file
        system without ``RWF_NOWAIT`` (tmpfs says EOPNOTSUPP) is treated the same way."""
        try:
            return os.preadv(self.files[cls].fd, buffers, offset, os.RWF_NOWAIT if nowait else 0)
        except OSError as exc:
            if nowait and exc.errno == errno.EOPNOTSUPP:
                raise BlockingIOError(errno.EAGAIN, "this file system cannot say what is cached") from None
            raise

    def read_direct(self, cls: int, offset: int, n: int) -> memoryview | None:
        """Up to ``n`` bytes at ``offset`` of slot file ``cls`` (both page-aligned up to ``n``, rounded up here)
        read around the page cache into a pooled page-aligned buffer (at most ``n`` of the returned view are
        filled: compare its length), or None where the file system does not take direct reads."""
        f = self.files[cls]
        fd = f.direct
        if fd < 0:
            return None
        span = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN
        pooled = RECEIVED.take(1 << (span - 1).bit_length())
        if not isinstance(pooled, mmap.mmap):  # small, or the pool is full: a bytearray is not page-aligned
            pooled = page_aligned(span)
        buf = memoryview(pooled)[:span]
        try:
            got = os.preadv(fd, [buf], offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._stop_direct(f, e)
            return None
        return buf[:got]

    def _stop_direct(self, f: SlotFile, why: OSError) -> None:
        """The file system took ``O_DIRECT`` at open but refuses a write or read with it: use the page cache."""
        with self._lock:
            if f.direct < 0:
                return
            self._refused_fds.append(f.direct)  # closed with the engine: another thread may be writing with it
            f.direct = -1
        log.warning("target %s: %s refuses direct I/O (%s); using the page cache for it", self.root, f.path.name,
                    why.strerror)

    def mapping(self, cls: int, slot: int) -> memoryview:
        """A read-only mapping of slot file ``cls`` that covers ``slot``. Slot files only grow, so a mapping stays
        valid; one that ends before the slot is replaced by a mapping of the whole file as it is now (views of
        the old one keep it alive until they are gone)."""
        f = self.files[cls]
        end = (slot + 1) * f.size
        with self._lock:
            mapped = self._mappings.get(cls)
            if mapped is None or len(mapped) < end:
                mapped = memoryview(mmap.mmap(f.fd, f.total * f.size, prot=mmap.PROT_READ))
                self._mappings[cls] = mapped
            return mapped

    def flush(self, cls: int) -> None:
        """fdatasync slot file ``cls``."""
        os.fdatasync(self.files[cls].fd)
