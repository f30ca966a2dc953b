"""GPU destinations: which way a chunk's bytes take into GPU memory, and the GPU calls that move them.

Where the chunk has a replica on this host and KvikIO is there, the bytes go from the slot file straight into GPU
memory (GPUDirect Storage: ``kvikio.CuFile(path).pread``; KvikIO falls back to its own bounce buffers where the
cuFile driver is missing, and ``capabilities()`` says so). Otherwise they land in a pinned host buffer (a
short-circuit ``pread`` or the network read) and are copied to the device with cupy or torch. KvikIO is never the
CPU fallback: every KvikIO read needs the CUDA driver.

The choice is :func:`choose_read_path`, a pure function of the destination, whether the chunk was located on this
host, and :class:`GpuSupport`. :func:`probe` imports a GPU library only where an NVIDIA device node exists, so a
CPU-only process that uses kvclient loads none of them.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import glob
import importlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvfs.errors import KvfsError
from kvfs.kvclient.buffers import DeviceSpan


_MIN_STAGING = 4 << 20


class ReadPath(enum.Enum):
    LOCAL_HOST = "local-host"  # pread from the replica's slot file into the caller's host buffer
    NETWORK_HOST = "network-host"  # chunk server -> the caller's host buffer
    LOCAL_GDS = "local-gds"  # KvikIO/cuFile: slot file -> GPU memory
    LOCAL_STAGED = "local-staged"  # pread into a pinned host buffer, then a copy to the GPU
    NETWORK_STAGED = "network-staged"  # chunk server -> pinned host buffer -> GPU


class GpuUnavailable(KvfsError):
    """A GPU destination where this process cannot reach GPU memory (no device, no cupy/torch)."""

    default_errno = errno.ENODEV


@dataclass(frozen=True)
class GpuSupport:
    """What this process can do with GPU memory. ``copier``: the library that copies between host and device
    ("cupy" or "torch"), None without one; ``gds``: KvikIO is importable; ``gds_direct``: and it reads through
    the cuFile driver rather than its compatibility mode."""

    gpu: bool = False
    copier: str | None = None
    gds: bool = False
    gds_direct: bool = False
    reason: str = ""


def choose_read_path(to_gpu: bool, located: bool, support: GpuSupport) -> ReadPath:
    """How one chunk's bytes reach the destination. ``located``: a replica on this host told where they lie."""
    if not to_gpu:
        return ReadPath.LOCAL_HOST if located else ReadPath.NETWORK_HOST
    if not support.gpu or support.copier is None:  # the GDS path checks CRCs on a copy back, so it needs one too
        raise GpuUnavailable(f"a GPU destination, but {support.reason or 'no GPU support'}")
    if located:
        return ReadPath.LOCAL_GDS if support.gds else ReadPath.LOCAL_STAGED
    return ReadPath.NETWORK_STAGED


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
    try:
        kvikio = importlib.import_module("kvikio")
    except Exception as exc:  # noqa: BLE001
        return GpuSupport(True, copier, reason=f"no GPUDirect Storage: kvikio: {type(exc).__name__}: {exc}; reads"
                                               " into GPU memory go through a pinned host buffer")
    direct = not _compat_mode(kvikio)
    reason = "" if direct else ("kvikio runs in compatibility mode (no cuFile driver): it reads through its own host"
                                " bounce buffers")
    return GpuSupport(True, copier, True, direct, reason)


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
