"""Registered-memory bookkeeping for RDMA, independent of pyverbs.

RDMA can only touch memory registered with the device, and registering is slow (it pins pages and
programs the NIC's translation table), so the pool registers a few large regions once and hands out
fixed-size slabs carved from them. The registration itself is injected (``register(view, addr)`` returns
an object with ``lkey``, ``rkey`` and optionally ``close()``, exactly what ``pyverbs.mr.MR`` is), which keeps
this module testable without a device.

A :class:`RemoteBuffer` is what travels in an RPC body in place of a data section: the peer RDMA-READs from
or RDMA-WRITEs into ``[addr, addr + length)`` with ``rkey``.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import msgspec

from kvfs.transport.errors import BufferExhausted, UnregisteredMemory

U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack caps ints at 2**64 - 1; msgspec bounds stop at int64
#: One RDMA message carries at most 2 GiB (ibv_port_attr.max_msg_sz is 2^31 on common HCAs).
MAX_RDMA_MESSAGE = 1 << 31
RdmaLength = Annotated[int, msgspec.Meta(ge=0, le=MAX_RDMA_MESSAGE)]


class RemoteBuffer(msgspec.Struct, array_like=True, frozen=True):
    """A peer's registered memory range: enough for one RDMA READ or WRITE against it."""

    addr: U64
    rkey: U32
    length: RdmaLength

    def __post_init__(self) -> None:
        if self.addr + self.length > 0xFFFFFFFFFFFFFFFF + 1:
            raise ValueError("remote buffer wraps around the address space")

    def slice(self, offset: int, length: int | None = None) -> RemoteBuffer:
        """A sub-range, bounds-checked (an RDMA op outside the range would fail with a remote access error)."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"slice [{offset}, {offset}+{length}) is outside a remote buffer of {self.length} bytes")
        return RemoteBuffer(self.addr + offset, self.rkey, length)


@dataclass(frozen=True, slots=True)
class LocalSge:
    """A scatter/gather element: local registered memory the NIC reads from or writes into."""

    addr: int
    length: int
    lkey: int


class MemoryRegistration(Protocol):
    lkey: int
    rkey: int


RegisterFn = Callable[[memoryview, int], MemoryRegistration]


def buffer_address(view: memoryview) -> int:
    """The virtual address of a writable, contiguous, non-empty buffer (what the NIC is told)."""
    view = memoryview(view)
    if view.readonly:
        raise UnregisteredMemory("read-only buffers are never registered memory")
    if not view.c_contiguous:
        raise UnregisteredMemory("RDMA needs a contiguous buffer")
    if view.nbytes == 0:
        raise UnregisteredMemory("an empty buffer has no RDMA address")
    return ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))


@dataclass(eq=False, slots=True)
class _Region:
    index: int
    memory: mmap.mmap
    addr: int
    length: int
    registration: Any

    @property
    def lkey(self) -> int:
        return int(self.registration.lkey)

    @property
    def rkey(self) -> int:
        return int(self.registration.rkey)


@dataclass(eq=False, slots=True)
class Slab:
    """One fixed-size piece of registered memory, owned by whoever acquired it until it is released."""

    pool: BufferPool
    region: _Region
    index: int  # global slab number within the pool
    offset: int  # within the region
    size: int
    view: memoryview

    @property
    def addr(self) -> int:
        return self.region.addr + self.offset

    @property
    def lkey(self) -> int:
        return self.region.lkey

    @property
    def rkey(self) -> int:
        return self.region.rkey

    def remote(self, offset: int = 0, length: int | None = None) -> RemoteBuffer:
        """The descriptor to send a peer so it can RDMA into/out of ``[offset, offset + length)`` of this slab."""
        length = self.size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"[{offset}, {offset}+{length}) is outside a slab of {self.size} bytes")
        return RemoteBuffer(self.addr + offset, self.rkey, length)

    def sge(self, offset: int = 0, length: int | None = None) -> LocalSge:
        length = self.size - offset if length is None else length
        if offset < 0 or length <= 0 or offset + length > self.size:
            raise ValueError(f"[{offset}, {offset}+{length}) is outside a slab of {self.size} bytes")
        return LocalSge(self.addr + offset, length, self.lkey)

    def release(self) -> None:
        self.pool.release(self)


class BufferPool:
    """Fixed-size slabs carved from a few large registered regions, allocated on demand up to a bound.

    ``slab_size`` bytes per slab, ``slabs_per_region`` slabs per registration, at most ``max_regions``
    registrations: at most ``slab_size * slabs_per_region * max_regions`` bytes are ever pinned. Acquire and
    release are thread-safe (the completion poller may release from its thread).
    """

    def __init__(
        self,
        register: RegisterFn,
        *,
        slab_size: int = 4 << 20,
        slabs_per_region: int = 16,
        max_regions: int = 4,
    ) -> None:
        if slab_size <= 0 or slab_size % mmap.PAGESIZE:
            raise ValueError(f"slab_size must be a positive multiple of the page size ({mmap.PAGESIZE})")
        if slabs_per_region <= 0 or max_regions <= 0:
            raise ValueError("slabs_per_region and max_regions must be positive")
        if slab_size > MAX_RDMA_MESSAGE:
            raise ValueError("a slab must fit in one RDMA message")
        self._register = register
        self.slab_size = slab_size
        self.slabs_per_region = slabs_per_region
        self.max_regions = max_regions
        self._regions: list[_Region] = []
        self._free: list[Slab] = []
        self._in_use: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    # --- capacity -------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slabs this pool may ever hand out at once."""
        return self.slabs_per_region * self.max_regions

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    @property
    def registered_bytes(self) -> int:
        return sum(r.length for r in self._regions)

    # --- acquire / release ----------------------------------------------------------------------------

    def acquire(self) -> Slab:
        """A free slab; registers one more region when all are in use; BufferExhausted at the bound."""
        with self._lock:
            if self._closed:
                raise BufferExhausted("the buffer pool is closed")
            if not self._free:
                if len(self._regions) >= self.max_regions:
                    raise BufferExhausted(
                        f"all {self.capacity} registered slabs of {self.slab_size} bytes are in use"
                    )
                self._grow()
            slab = self._free.pop()
            self._in_use.add(slab.index)
            return slab

    def release(self, slab: Slab) -> None:
        with self._lock:
            if slab.pool is not self:
                raise ValueError("slab belongs to another pool")
            if slab.index not in self._in_use:
                raise ValueError(f"slab {slab.index} released twice")
            self._in_use.remove(slab.index)
            if not self._closed:
                self._free.append(slab)

    @contextmanager
    def slab(self) -> Iterator[Slab]:
        slab = self.acquire()
        try:
            yield slab
        finally:
            self.release(slab)

    def _grow(self) -> None:
        length = self.slab_size * self.slabs_per_region
        memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned, zeroed
        view = memoryview(memory)
        try:
            addr = buffer_address(view)
            registration = self._register(view, addr)
        except BaseException:
            view.release()
            memory.close()
            raise
        region = _Region(len(self._regions), memory, addr, length, registration)
        self._regions.append(region)
        base = region.index * self.slabs_per_region
        # reversed so pop() hands out the lowest address first
        for i in reversed(range(self.slabs_per_region)):
            off = i * self.slab_size
            self._free.append(Slab(self, region, base + i, off, self.slab_size, view[off : off + self.slab_size]))

    # --- lookup ---------------------------------------------------------------------------------------

    def lookup(self, view: memoryview | bytearray) -> LocalSge:
        """(addr, length, lkey) for a buffer inside one registered region; UnregisteredMemory otherwise."""
        view = memoryview(view)
        addr = buffer_address(view)
        end = addr + view.nbytes
        for region in self._regions:
            if region.addr <= addr and end <= region.addr + region.length:
                return LocalSge(addr, view.nbytes, region.lkey)
        raise UnregisteredMemory(f"buffer at {addr:#x} (+{view.nbytes}) is not inside memory registered for RDMA")

    def describe(self, view: memoryview | bytearray) -> RemoteBuffer:
        """The RemoteBuffer a peer needs to RDMA into/out of ``view`` (which must be registered memory)."""
        view = memoryview(view)
        addr = buffer_address(view)
        end = addr + view.nbytes
        for region in self._regions:
            if region.addr <= addr and end <= region.addr + region.length:
                return RemoteBuffer(addr, region.rkey, view.nbytes)
        raise UnregisteredMemory(f"buffer at {addr:#x} (+{view.nbytes}) is not inside memory registered for RDMA")

    # --- teardown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Deregister and unmap everything. Slabs still out must not be used afterwards (the NIC can't)."""
        with self._lock:
            self._closed = True
            self._free.clear()
            regions, self._regions = self._regions, []
        for region in regions:
            close = getattr(region.registration, "close", None)
            if close is not None:
                close()
        # mmaps are unmapped when the last slab view is gone; closing here would fail while views exist.

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
