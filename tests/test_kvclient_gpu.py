"""kvclient's GPU side on a host without a GPU: the read-path choice (a pure function), what ``probe`` reports and
imports, and how values and buffers are classified as host or GPU memory. Runs without a cluster."""

from __future__ import annotations

import ctypes
import errno
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfs.kvclient import gpu
from kvfs.kvclient.buffers import DeviceSpan, RegisteredBuffer, as_buffer, parse_device
from kvfs.kvclient.gpu import GpuSupport, GpuUnavailable, ReadPath, choose_read_path

P = ReadPath
NONE = GpuSupport(reason="no NVIDIA GPU on this host")
NO_COPIER = GpuSupport(gpu=True, reason="neither cupy nor torch")
STAGED = GpuSupport(gpu=True, copier="torch", reason="no kvikio")
GDS = GpuSupport(gpu=True, copier="cupy", gds=True, gds_direct=True)
GDS_COMPAT = GpuSupport(gpu=True, copier="cupy", gds=True, gds_direct=False, reason="compatibility mode")


@pytest.mark.parametrize(("to_gpu", "located", "support", "path"), [
    (False, True, NONE, P.LOCAL_HOST),
    (False, False, NONE, P.NETWORK_HOST),
    (False, True, GDS, P.LOCAL_HOST),  # a host destination never goes through the GPU
    (True, True, GDS, P.LOCAL_GDS),
    (True, True, GDS_COMPAT, P.LOCAL_GDS),  # KvikIO still reads (through its bounce buffers); capabilities say so
    (True, False, GDS, P.NETWORK_STAGED),  # no replica here: network into pinned memory, then a copy
    (True, True, STAGED, P.LOCAL_STAGED),  # no KvikIO: pread into pinned memory, then a copy
    (True, False, STAGED, P.NETWORK_STAGED),
])
def test_read_path_choice(to_gpu: bool, located: bool, support: GpuSupport, path: ReadPath) -> None:
    assert choose_read_path(to_gpu, located, support) is path


@pytest.mark.parametrize("support", [NONE, NO_COPIER])
@pytest.mark.parametrize("located", [True, False])
def test_gpu_destination_without_gpu_support_is_a_clear_error(support: GpuSupport, located: bool) -> None:
    with pytest.raises(GpuUnavailable) as e:
        choose_read_path(True, located, support)
    assert e.value.errno == errno.ENODEV and support.reason in str(e.value)


def test_probe_on_this_host_imports_no_gpu_library() -> None:
    if gpu._device_nodes():
        pytest.skip("this host has an NVIDIA device; the CPU-only check needs one without")
    code = ("import sys; from kvfs.kvclient import KVClient; from kvfs.kvclient.gpu import probe; s = probe();"
            "print(s.gpu, s.gds, repr(s.reason), [m for m in ('cupy', 'torch', 'kvikio') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False 'no NVIDIA GPU on this host (no /dev/nvidia<N>)' []"


def test_probe_off_switch(monkeypatch) -> None:
    monkeypatch.setenv("KVFS_GPU", "0")
    assert gpu.probe() == GpuSupport(reason="turned off by KVFS_GPU=0")


def test_probe_with_a_device_but_no_library_says_which_are_missing(monkeypatch) -> None:
    for name in ("cupy", "torch"):
        if name in sys.modules or _importable(name):
            pytest.skip(f"{name} is installed here")
    monkeypatch.setattr(gpu, "_device_nodes", lambda: ["/dev/nvidia0"])
    support = gpu.probe()
    assert support.gpu and support.copier is None and not support.gds
    assert "cupy: ModuleNotFoundError" in support.reason and "torch: ModuleNotFoundError" in support.reason
    with pytest.raises(GpuUnavailable):
        gpu.GpuBackend(support)


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize(("device", "index"), [("cpu", None), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3)])
def test_parse_device(device: str, index: int | None) -> None:
    assert parse_device(device) == index


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", "", "cuda:1:2", 0])
def test_parse_device_refuses(device) -> None:
    with pytest.raises(ValueError):
        parse_device(device)


class _CudaArray:
    """The attributes cupy and torch CUDA arrays export, for classifying buffers without a GPU (never read)."""

    def __init__(self, shape, typestr="<f4", strides=None, readonly=False, ptr=0x7000_0000) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, readonly),
                                         "strides": strides, "version": 3}


def test_gpu_arrays_become_device_spans() -> None:
    span = as_buffer(_CudaArray((4, 8)), writable=True)
    assert isinstance(span, DeviceSpan) and (span.ptr, span.nbytes, span.device) == (0x7000_0000, 128, 0)
    assert as_buffer(_CudaArray((4, 8), strides=(32, 4)), writable=True).nbytes == 128  # explicit C strides
    with pytest.raises(TypeError, match="C-contiguous"):
        as_buffer(_CudaArray((4, 8), strides=(4, 16)), writable=True)
    with pytest.raises(TypeError, match="read-only"):
        as_buffer(_CudaArray((4,), readonly=True), writable=True)
    assert isinstance(as_buffer(_CudaArray((4,), readonly=True), writable=False), DeviceSpan)


def test_registered_buffers() -> None:
    raw = (ctypes.c_char * 64)()
    host = RegisteredBuffer(ctypes.addressof(raw), 64, "cpu")
    view = as_buffer(host, writable=True)
    assert isinstance(view, memoryview) and len(view) == 64
    view[:3] = b"abc"
    assert raw.raw[:3] == b"abc"
    dev = as_buffer(RegisteredBuffer(0x7F00_0000_0000, 1 << 20, "cuda:1"), writable=True)
    assert isinstance(dev, DeviceSpan) and dev.device == 1 and len(dev) == 1 << 20
    for bad in ((0, 10, "cpu"), (1, -1, "cpu"), ("1", 10, "cpu"), (1, 10, "npu")):
        with pytest.raises(ValueError):
            RegisteredBuffer(*bad)


@given(st.integers(0, 1 << 20), st.integers(-(1 << 21), 1 << 21), st.integers(-(1 << 21), 1 << 21))
def test_device_span_slices_like_bytes(n: int, start: int, stop: int) -> None:
    span = DeviceSpan(0x1000, n, 0)
    piece = span[start:stop]
    expected = range(n)[start:stop]
    assert piece.nbytes == len(expected)
    if len(expected):
        assert piece.ptr == 0x1000 + expected[0]
    assert piece.__cuda_array_interface__["shape"] == (len(expected),)
