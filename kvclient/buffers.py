"""What kvclient accepts as a value or an output buffer, seen as host bytes or as a span of GPU memory.

Host memory is anything with the buffer protocol (bytes, memoryview, numpy, CPU torch tensors through ``.numpy()``)
or a :class:`RegisteredBuffer` at a raw address. GPU memory is anything that exports ``__cuda_array_interface__``
(torch CUDA tensors, cupy, numba) or a raw device pointer registered with ``device="cuda[:N]"``. Nothing here
imports a GPU library: a GPU object's own attributes say where it lies, so CPU-only use loads none of them.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import re
from collections.abc import Callable, Sequence
from typing import Any

from kvfs.pool import BufferPool
from kvfs.transport.direct import DirectRegion
from kvfs.transport.shm import SHM_MIN_BYTES

_DEVICE = re.compile(r"cpu|cuda(?::(\d+))?")


def parse_device(device: str) -> int | None:
    """None for ``"cpu"``; the GPU index for ``"cuda"`` (0) or ``"cuda:N"``; ValueError for anything else."""
    m = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if m is None:
        raise ValueError(f"device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    return None if device == "cpu" else int(m.group(1) or 0)


class DeviceSpan:
    """``nbytes`` bytes of GPU memory at ``ptr`` on GPU ``device``; exports ``__cuda_array_interface__`` (flat
    bytes), so KvikIO, cupy and torch take it as an array without knowing who owns the memory. ``owner`` keeps the
    exporting object alive while the span is used; ``region``: the registered region it lies in, open for
    GPUDirect RDMA (None: answers from the network come through a pinned host buffer)."""

    __slots__ = ("ptr", "nbytes", "device", "owner", "region")

    def __init__(self, ptr: int, nbytes: int, device: int, owner: Any = None,
                 region: DirectRegion | None = None) -> None:
        self.ptr, self.nbytes, self.device, self.owner, self.region = ptr, nbytes, device, owner, region

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, s: slice) -> DeviceSpan:
        start, stop, step = s.indices(self.nbytes)
        if step != 1:
            raise ValueError("device spans are sliced contiguously")
        return DeviceSpan(self.ptr + start, max(0, stop - start), self.device, self.owner, self.region)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None}

    def __repr__(self) -> str:
        return f"DeviceSpan(ptr={self.ptr:#x}, nbytes={self.nbytes}, device=cuda:{self.device})"


class RegisteredBuffer:
    """Memory at a raw address, registered with :meth:`KVClient.register_buffer` and usable as a value or an output
    buffer: host memory through ``view`` (buffer protocol), GPU memory (``device="cuda[:N]"``) through ``span``."""

    def __init__(self, ptr: int, size: int, device: str = "cpu") -> None:
        if not isinstance(ptr, int) or not isinstance(size, int) or size < 0 or (ptr == 0 and size):
            raise ValueError("register_buffer needs an address and a size >= 0")
        gpu = parse_device(device)
        self.ptr, self.size, self.device = ptr, size, device
        self.span = None if gpu is None else DeviceSpan(ptr, size, gpu, self)
        self.view = memoryview(b"")
        if gpu is None and size:
            self.view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _device_span(value: Any) -> DeviceSpan | None:
    """The GPU memory ``value`` exports, or None if it is not a GPU array."""
    try:
        cai = value.__cuda_array_interface__
    except (AttributeError, RuntimeError):  # torch raises on CPU tensors' attribute
        return None
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    strides = cai.get("strides")
    if strides is not None:
        expected, step = [], itemsize
        for dim in reversed(shape):
            expected.insert(0, step)
            step *= dim
        if tuple(strides) != tuple(expected) and math.prod(shape) > 1:
            raise TypeError("the GPU buffer must be C-contiguous")
    device = getattr(value, "device", None)
    index = getattr(device, "index", None)
    if index is None:
        index = getattr(device, "id", 0)
    return DeviceSpan(int(cai["data"][0]), math.prod(shape) * itemsize, int(index or 0), value)


def as_buffer(value: Any, *, writable: bool) -> memoryview | DeviceSpan:
    """A flat byte view of host memory, or the span of GPU memory, that ``value`` holds; no copy either way.
    TypeError for what is neither, not C-contiguous, or read-only where it is written."""
    if isinstance(value, RegisteredBuffer):
        return value.view if value.span is None else value.span
    if isinstance(value, DeviceSpan):
        return value
    span = _device_span(value)
    if span is not None:
        if writable and value.__cuda_array_interface__["data"][1]:
            raise TypeError("the output GPU buffer is read-only")
        return span
    if hasattr(value, "is_cuda") and hasattr(value, "numpy"):  # a torch CPU tensor
        value = value.detach().numpy()
    try:
        view = memoryview(value)
    except TypeError:
        raise TypeError(f"{type(value).__name__} does not support the buffer protocol") from None
    if not view.c_contiguous:
        raise TypeError("the buffer must be C-contiguous")
    if writable and view.readonly:
        raise TypeError("the output buffer is read-only")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def host_values(bufs: Sequence[memoryview | DeviceSpan], to_host: Callable[[memoryview, DeviceSpan], None],
                shared: BufferPool | None) -> list[memoryview]:
    """Values as the chunk servers take them: host bytes, GPU memory copied out with ``to_host(host, span)``. With
    ``shared`` (the pool of this process's shared memory, where the servers on this host map it) a batch is
    copied into one of its buffers, back to back: the chain's head then copies the whole batch straight out of it
    (no loopback TCP) into its own shared memory, holds the versions there until its next flush and forwards
    them on the same way. A batch too small to gain, or one the pool has no room for, stays where it is."""
    total = sum(len(buf) for buf in bufs)
    staged = shared.view(total) if shared is not None and total >= SHM_MIN_BYTES else None
    if staged is not None and not isinstance(staged.obj, mmap.mmap):  # the pool is spent: a copy gains nothing
        staged = None
    out = []
    at = 0
    for buf in bufs:
        if staged is None and not isinstance(buf, DeviceSpan):
            out.append(buf)
            continue
        host = staged[at:at + len(buf)] if staged is not None else memoryview(bytearray(len(buf)))
        at += len(buf)
        if isinstance(buf, DeviceSpan):
            to_host(host, buf)
        else:
            host[:] = buf
        out.append(host)
    return out
