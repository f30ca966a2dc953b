"""GPU destinations: which way a chunk's bytes take into GPU memory, and the GPU calls that move them.

Where the chunk has a replica on this host and KvikIO is there, the bytes go from the slot file straight into GPU
memory (GPUDirect Storage: ``kvikio.CuFile(path).pread``; KvikIO falls back to its own bounce buffers where the
cuFile driver is missing, and ``capabilities()`` says so). Otherwise they land in a pinned host buffer (a
short-circuit ``pread`` or the network read) and are copied to the device with cupy or torch. KvikIO is never the
CPU fallback: every KvikIO read needs the CUDA driver.

Remote replicas over RDMA can land straight in GPU memory (GPUDirect RDMA) where the destination lies in a buffer
registered with ``register_buffer(ptr, size, "cuda")`` and the NIC can reach GPU memory: by a dma-buf the CUDA
driver exports (``cuMemGetHandleForAddressRange``, registered with ``mlx5dv_reg_dmabuf_mr``), else by
``ibv_reg_mr`` on the device address where ``nvidia-peermem`` is loaded (:func:`choose_gdr`,
:mod:`kvfs.transport.direct`).

The choice is :func:`choose_read_path`, a pure function of the destination, whether the chunk was located on this
host, whether the destination lies in such a region, and :class:`GpuSupport`. :func:`probe` imports a GPU library
only where an NVIDIA device node exists, so a CPU-only process that uses kvclient loads none of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import glob
import importlib
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvfs.errors import KvfsError
from kvfs.kvclient.buffers import DeviceSpan
from kvfs.transport.direct import DirectRegion, DmaBuf


_MIN_STAGING = 4 << 20


class ReadPath(enum.Enum):
    LOCAL_HOST = "local-host"  # pread from the replica's slot file into the caller's host buffer
    NETWORK_HOST = "network-host"  # chunk server -> the caller's host buffer
    LOCAL_GDS = "local-gds"  # KvikIO/cuFile: slot file -> GPU memory
    LOCAL_STAGED = "local-staged"  # pread into a pinned host buffer, then a copy to the GPU
    NETWORK_STAGED = "network-staged"  # chunk server -> pinned host buffer -> GPU
    NETWORK_GDR = "network-gdr"  # chunk server RDMA-WRITEs into GPU memory (a pinned host buffer on a TCP link)


GDR_DMABUF = "dmabuf"
GDR_PEER_MEMORY = "peer-memory"


class GpuUnavailable(KvfsError):
    """A GPU destination where this process cannot reach GPU memory (no device, no cupy/torch)."""

    default_errno = errno.ENODEV


@dataclass(frozen=True)
class GpuSupport:
    """What this process can do with GPU memory. ``copier``: the library that copies between host and device
    ("cupy" or "torch"), None without one; ``gds``: KvikIO is importable; ``gds_direct``: and it reads through
    the cuFile driver rather than its compatibility mode; ``gdr``: how GPU memory is registered with the NIC for
    GPUDirect RDMA (``"dmabuf"`` or ``"peer-memory"``), None where it cannot be, ``gdr_reason`` saying why."""

    gpu: bool = False
    copier: str | None = None
    gds: bool = False
    gds_direct: bool = False
    reason: str = ""
    gdr: str | None = None
    gdr_reason: str = ""


def choose_read_path(to_gpu: bool, located: bool, support: GpuSupport, gdr_region: bool = False) -> ReadPath:
    """How one chunk's bytes reach the destination. ``located``: a replica on this host told where they lie (local
    replicas keep GDS or a local read: no network at all beats any). ``gdr_region``: the destination lies in a
    registered region open for GPUDirect RDMA. NETWORK_GDR still goes through the pinned buffer on a connection
    without an RDMA link or whose protection domain refused the region (decided per call, in kvfs.rpc)."""
    if not to_gpu:
        return ReadPath.LOCAL_HOST if located else ReadPath.NETWORK_HOST
    if not support.gpu or support.copier is None:  # the GDS path checks CRCs on a copy back, so it needs one too
        raise GpuUnavailable(f"a GPU destination, but {support.reason or 'no GPU support'}")
    if located:
        return ReadPath.LOCAL_GDS if support.gds else ReadPath.LOCAL_STAGED
    return ReadPath.NETWORK_GDR if gdr_region and support.gdr is not None else ReadPath.NETWORK_STAGED


def choose_gdr(rdma_reason: str, dmabuf_reason: str, peer_memory: bool) -> tuple[str | None, str]:
    """How to register GPU memory with the NIC, and why not or why the second choice. Each reason is "" where that
    part works. dma-buf first: it is the kernel's own mechanism (5.12+) and needs no out-of-tree module."""
    if rdma_reason:
        return None, f"no GPUDirect RDMA: this host cannot use RDMA ({rdma_reason})"
    if not dmabuf_reason:
        return GDR_DMABUF, ""
    if peer_memory:
        return GDR_PEER_MEMORY, f"no dma-buf ({dmabuf_reason}); GPU memory is registered through nvidia-peermem"
    return None, (f"no GPUDirect RDMA: no dma-buf ({dmabuf_reason}) and no peer-memory client"
                  " (neither the nvidia_peermem nor the nv_peer_mem module is loaded)")


def _peer_memory_loaded() -> bool:
    return any(os.path.isdir(f"/sys/module/{name}") for name in ("nvidia_peermem", "nv_peer_mem"))


class CudaDriver:
    """The CUDA driver calls dma-buf export needs, through ctypes on ``libcuda.so.1``: neither cupy nor torch binds
    ``cuMemGetHandleForAddressRange``, and the driver library is there wherever a GPU is usable."""

    DMA_BUF_SUPPORTED = 124  # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
    RANGE_HANDLE_DMA_BUF_FD = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD

    def __init__(self) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._check(self._lib.cuInit(0), "cuInit")

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result:
            raise GpuUnavailable(f"{what} failed: CUresult {result}", errno.EIO)

    def dmabuf_supported(self, device: int = 0) -> bool:
        handle, value = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
        self._check(self._lib.cuDeviceGetAttribute(ctypes.byref(value), self.DMA_BUF_SUPPORTED, handle),
                    "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)")
        return bool(value.value)

    def export_dmabuf(self, addr: int, length: int) -> DmaBuf:
        """A dma-buf fd for the host pages around ``[addr, addr + length)`` (the driver wants page-aligned ranges);
        the range starts ``offset`` bytes into it. The caller closes the fd."""
        base = addr - addr % mmap.PAGESIZE
        end = -(-(addr + length) // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = ctypes.c_int(-1)
        self._check(self._lib.cuMemGetHandleForAddressRange(
            ctypes.byref(fd), ctypes.c_uint64(base), ctypes.c_size_t(end - base),
            self.RANGE_HANDLE_DMA_BUF_FD, ctypes.c_ulonglong(0)), f"cuMemGetHandleForAddressRange({base:#x}, {end - base})")
        return DmaBuf(fd.value, addr - base)


def _dmabuf_reason() -> str:
    """"" where the CUDA driver exports dma-bufs of GPU memory and pyverbs can register one by its fd; else why not."""
    try:
        importlib.import_module("pyverbs.providers.mlx5.mlx5dv_dmabuf")
    except Exception as exc:  # noqa: BLE001 - absent, or an rdma-core older than 2024: say which
        return f"pyverbs cannot register a dma-buf fd (mlx5dv_dmabuf: {type(exc).__name__}: {exc})"
    try:
        if not CudaDriver().dmabuf_supported():
            return "the CUDA driver does not export dma-bufs here (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0)"
    except (OSError, GpuUnavailable) as exc:
        return f"libcuda: {exc}"
    return ""


def _probe_gdr() -> tuple[str | None, str]:
    from kvfs.transport.verbs import detect_rdma

    rdma = detect_rdma()
    if not rdma.available:
        return choose_gdr(rdma.reason, "", False)
    return choose_gdr("", _dmabuf_reason(), _peer_memory_loaded())


def _device_nodes() -> list[str]:
    return glob.glob("/dev/nvidia[0-9]*")


def probe() -> GpuSupport:
    """Find out, importing cupy/torch/kvikio only where an NVIDIA device node exists (``KVFS_GPU=0``: never)."""
    if os.environ.get("KVFS_GPU", "1") == "0":
        return GpuSupport(reason="turned off by KVFS_GPU=0")
    if not _device_nodes():
        return GpuSupport(reason="no NVIDIA GPU on this host (no /dev/nvidia<N>)")
    copier, why = None, []
    for name in ("cupy", "torch"):
        try:
            module = importlib.import_module(name)
            if name == "cupy" and module.cuda.runtime.getDeviceCount() > 0 or \
                    name == "torch" and module.cuda.is_available():
                copier = name
                break
            why.append(f"{name} sees no GPU")
        except Exception as exc:  # noqa: BLE001 - absent, or its CUDA runtime failed to load: say which
            why.append(f"{name}: {type(exc).__name__}: {exc}")
    if copier is None:
        return GpuSupport(gpu=True, reason="neither cupy nor torch can copy to the GPU (" + "; ".join(why) + ")")
    gdr, gdr_reason = _probe_gdr()
    try:
        kvikio = importlib.import_module("kvikio")
    except Exception as exc:  # noqa: BLE001
        return GpuSupport(True, copier, reason=f"no GPUDirect Storage: kvikio: {type(exc).__name__}: {exc}; reads"
                                               " into GPU memory go through a pinned host buffer",
                          gdr=gdr, gdr_reason=gdr_reason)
    direct = not _compat_mode(kvikio)
    reason = "" if direct else ("kvikio runs in compatibility mode (no cuFile driver): it reads through its own host"
                                " bounce buffers")
    return GpuSupport(True, copier, True, direct, reason, gdr, gdr_reason)


def _compat_mode(kvikio: Any) -> bool:
    """Whether KvikIO will read through POSIX and bounce buffers rather than cuFile (its mode may be AUTO, so ask
    what it resolved to; older releases only have ``compat_mode()``, a bool)."""
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):
        return bool(defaults.is_compat_mode_preferred())
    return bool(defaults.compat_mode())


class GpuBackend:
    """The GPU calls of the read and write paths, with the library :func:`probe` found. Made only for a GPU
    destination or value, so only then is any GPU library imported."""

    def __init__(self, support: GpuSupport) -> None:
        if not support.gpu or support.copier is None:
            raise GpuUnavailable(support.reason or "no GPU support")
        self.support = support
        self._lib = importlib.import_module(support.copier)
        self._kvikio = importlib.import_module("kvikio") if support.gds else None
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._free: list[memoryview] = []  # pinned staging buffers not in use
        self._driver: CudaDriver | None = None

    def direct_region(self, ptr: int, size: int) -> DirectRegion | None:
        """GPU memory at ``ptr`` made ready for GPUDirect RDMA (registered with each link's protection domain on
        first use), or None where this process has no way to register GPU memory with the NIC."""
        if self.support.gdr is None or not size:
            return None
        if self.support.gdr == GDR_PEER_MEMORY:
            return DirectRegion(ptr, size)
        with self._lock:
            if self._driver is None:
                self._driver = CudaDriver()
        return DirectRegion(ptr, size, export=self._driver.export_dmabuf)

    @contextlib.contextmanager
    def staging(self, nbytes: int) -> Iterator[memoryview]:
        """A pinned host buffer of ``nbytes`` for the length of the block, reused afterwards: pinning memory costs
        milliseconds, far more than a chunk's copy."""
        with self._lock:  # by position: memoryviews compare by content, so list.remove could take another one
            at = next((i for i, b in enumerate(self._free) if len(b) >= nbytes), None)
            buf = None if at is None else self._free.pop(at)
        if buf is None:
            buf = self.pinned(max(nbytes, _MIN_STAGING))
        try:
            yield buf[:nbytes]
        finally:
            with self._lock:
                self._free.append(buf)

    def pinned(self, nbytes: int) -> memoryview:
        """A page-locked host buffer: copies from it to the GPU run at full bus speed, and need no staging copy."""
        if self.support.copier == "cupy":
            import numpy
            mem = self._lib.cuda.alloc_pinned_memory(max(nbytes, 1))
            return memoryview(numpy.frombuffer(mem, numpy.uint8, nbytes)).cast("B")
        return memoryview(self._lib.empty(nbytes, dtype=self._lib.uint8, pin_memory=True).numpy()).cast("B")

    def _device_array(self, span: DeviceSpan) -> Any:
        if self.support.copier == "cupy":
            with self._lib.cuda.Device(span.device):
                return self._lib.asarray(span)
        return self._lib.as_tensor(span, device=f"cuda:{span.device}")

    def to_device(self, dst: DeviceSpan, src: memoryview) -> None:
        """Copy host bytes into GPU memory; returns once they are there."""
        if not len(src):
            return
        if self.support.copier == "cupy":
            import numpy
            self._device_array(dst).set(numpy.frombuffer(src, numpy.uint8))
            self._lib.cuda.Device(dst.device).synchronize()
        else:
            self._device_array(dst).copy_(self._lib.frombuffer(src, dtype=self._lib.uint8))
            self._lib.cuda.synchronize(dst.device)

    def to_host(self, dst: memoryview, src: DeviceSpan) -> None:
        """Copy GPU bytes into host memory (a GPU value that is put, a GDS read's CRC check)."""
        if not len(dst):
            return
        if self.support.copier == "cupy":
            import numpy
            self._device_array(src).get(out=numpy.frombuffer(dst, numpy.uint8))
        else:
            self._lib.frombuffer(dst, dtype=self._lib.uint8).copy_(self._device_array(src))

    def gds_read(self, path: str, dst: DeviceSpan, file_offset: int) -> int:
        """``len(dst)`` bytes of ``path`` at ``file_offset`` straight into GPU memory (KvikIO); bytes read."""
        assert self._kvikio is not None
        with self._lock:
            handle = self._files.get(path)
            if handle is None:
                handle = self._files[path] = self._kvikio.CuFile(path, "r")
        return handle.pread(dst, len(dst), file_offset).get()

    def close(self) -> None:
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()
