"""kvclient's GPU side on a host without a GPU: the read-path choice (a pure function), what ``probe`` reports and
imports, and how values and buffers are classified as host or GPU memory. Runs without a cluster."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfs.kvclient import gpu
from kvfs.kvclient.buffers import DeviceSpan, RegisteredBuffer, as_buffer, host_values, parse_device
from kvfs.errors import KvfsError
from kvfs.kvclient.gpu import GpuSupport, GpuUnavailable, ReadPath, choose_read_path
from kvfs.transport.direct import DirectInto, DirectRegion

P = ReadPath
NONE = GpuSupport(reason="no NVIDIA GPU on this host")
NO_COPIER = GpuSupport(gpu=True, reason="neither cupy nor torch")
STAGED = GpuSupport(gpu=True, copier="torch", reason="no kvikio")
GDS = GpuSupport(gpu=True, copier="cupy", gds=True, gds_direct=True)
GDS_COMPAT = GpuSupport(gpu=True, copier="cupy", gds=True, gds_direct=False, reason="compatibility mode")
GDR = GpuSupport(gpu=True, copier="torch", gdr="dmabuf", reason="no kvikio")
GDS_GDR = GpuSupport(gpu=True, copier="cupy", gds=True, gds_direct=True, gdr="peer-memory")


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


@pytest.mark.parametrize(("to_gpu", "located", "support", "gdr_region", "path"), [
    (True, False, GDR, True, P.NETWORK_GDR),  # remote replica, registered region, GDR here: straight in
    (True, False, GDS_GDR, True, P.NETWORK_GDR),
    (True, False, GDR, False, P.NETWORK_STAGED),  # a GPU array outside every registered region
    (True, False, STAGED, True, P.NETWORK_STAGED),  # a registered region, but no way to register GPU memory
    (True, True, GDS_GDR, True, P.LOCAL_GDS),  # a replica on this host keeps GDS: no network at all
    (True, True, GDR, True, P.LOCAL_STAGED),
    (False, False, GDR, True, P.NETWORK_HOST),  # host destinations never touch the GPU paths
    (False, True, GDR, True, P.LOCAL_HOST),
])
def test_gdr_read_path_choice(to_gpu: bool, located: bool, support: GpuSupport, gdr_region: bool,
                              path: ReadPath) -> None:
    assert choose_read_path(to_gpu, located, support, gdr_region) is path


def test_gdr_region_without_gpu_support_is_still_a_clear_error() -> None:
    with pytest.raises(GpuUnavailable):
        choose_read_path(True, False, NONE, True)


@pytest.mark.parametrize(("rdma", "dmabuf", "peer", "mode", "says"), [
    ("", "", True, "dmabuf", ""),  # dma-buf preferred even where peer memory is there too
    ("", "", False, "dmabuf", ""),
    ("", "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0", True, "peer-memory", "through nvidia-peermem"),
    ("", "mlx5dv_dmabuf: ModuleNotFoundError", False, None, "nvidia_peermem"),
    ("no RDMA devices found", "", True, None, "no RDMA devices found"),
])
def test_choose_gdr(rdma: str, dmabuf: str, peer: bool, mode: str | None, says: str) -> None:
    got, reason = gpu.choose_gdr(rdma, dmabuf, peer)
    assert got == mode and says in reason
    if mode is None:
        assert reason.startswith("no GPUDirect RDMA")
    if dmabuf and mode is None:
        assert dmabuf in reason


class _FakeLibcuda:
    """The libcuda entry points CudaDriver calls, answering as a driver would (by ctypes byref)."""

    def __init__(self, dmabuf_supported: int = 1, result: int = 0) -> None:
        self.supported, self.result, self.exports = dmabuf_supported, result, []

    def cuInit(self, flags): return 0  # noqa: E704,N802
    def cuDeviceGet(self, out, ordinal): return 0  # noqa: E704,N802

    def cuDeviceGetAttribute(self, out, attribute, device):  # noqa: N802
        assert attribute == 124
        out._obj.value = self.supported
        return 0

    def cuMemGetHandleForAddressRange(self, out, base, size, kind, flags):  # noqa: N802
        self.exports.append((base.value, size.value, kind))
        out._obj.value = 42
        return self.result


def test_cuda_driver_exports_page_aligned_dmabufs(monkeypatch) -> None:
    fake = _FakeLibcuda()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    driver = gpu.CudaDriver()
    assert driver.dmabuf_supported()
    got = driver.export_dmabuf(0x7000_0000_1010, 8192)
    assert got == gpu.DmaBuf(42, 0x10) and fake.exports == [(0x7000_0000_1000, 12288, 1)]
    fake.result = 1  # CUDA_ERROR_INVALID_VALUE: the range is not one allocation
    with pytest.raises(GpuUnavailable, match="cuMemGetHandleForAddressRange.*CUresult 1"):
        driver.export_dmabuf(0x7000_0000_0000, 4096)
    fake.supported = 0
    assert not driver.dmabuf_supported()


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


class HostAsGpu:
    """A GPU backend whose "GPU memory" is host memory, so kvclient's GPU read paths run on a CPU up to the device
    copy (a memmove here). Regions open for GPUDirect RDMA as peer memory."""

    support = GpuSupport(gpu=True, copier="torch", gdr="peer-memory")

    def __init__(self) -> None:
        self.copied = 0

    @contextlib.contextmanager
    def staging(self, nbytes: int) -> Iterator[memoryview]:
        yield memoryview(bytearray(nbytes))

    def to_device(self, dst: DeviceSpan, src: memoryview) -> None:
        ctypes.memmove(dst.ptr, bytes(src), len(src))
        self.copied += len(src)

    def direct_region(self, ptr: int, size: int) -> DirectRegion:
        return DirectRegion(ptr, size)

    def close(self) -> None:
        pass


class _DirectStorage:
    """StorageClient.read_direct as each way of answering leaves the target: straight into the region (as an RDMA
    WRITE would), or into the staging buffer (a TCP link); ``have`` bytes of data, the rest of the range a hole."""

    def __init__(self, data: bytes, have: int, direct: bool, written: int | None = None) -> None:
        self.data, self.have, self.direct, self.written = data, have, direct, written

    async def read_direct(self, ino, layout, offset: int, target: DirectInto) -> None:
        chunk = self.data[offset : offset + self.have]
        if self.direct:
            ctypes.memmove(target.region.addr + target.offset, chunk, len(chunk))
            target.written = len(chunk) if self.written is None else self.written
        else:
            target.staging[: len(chunk)] = chunk
        target.filled = len(chunk)


@pytest.mark.parametrize(("direct", "have"), [(True, 4096), (True, 1000), (True, 0), (False, 4096), (False, 1000)])
async def test_gdr_read_fills_the_gpu_range_whichever_way_the_answer_came(direct: bool, have: int) -> None:
    from kvfs.kvclient.local import ChunkReader

    data = bytes(range(256)) * 16
    raw = (ctypes.c_char * 8192)(*([b"\xee"] * 8192))  # stale bytes: a hole must come out as zeros
    region = DirectRegion(ctypes.addressof(raw), 8192)
    backend = HostAsGpu()
    reader = ChunkReader(_DirectStorage(data, have, direct), short_circuit=False,  # type: ignore[arg-type]
                         gpu_support=lambda: backend.support, gpu=lambda: backend)  # type: ignore[arg-type,return-value]
    part = DeviceSpan(region.addr + 4096, 4096, 0, region=region)
    with backend.staging(4096) as staging:
        await reader._read_direct(1, None, 0, part, staging)  # type: ignore[arg-type]
    assert raw.raw[4096:] == data[:have] + bytes(4096 - have) and raw.raw[:4096] == b"\xee" * 4096
    assert backend.copied == (4096 - have if direct else 4096)  # a direct answer copies only the hole


async def test_gdr_read_refuses_a_write_that_disagrees_with_the_answer() -> None:
    from kvfs.kvclient.local import ChunkReader

    raw = (ctypes.c_char * 4096)()
    region = DirectRegion(ctypes.addressof(raw), 4096)
    backend = HostAsGpu()
    reader = ChunkReader(_DirectStorage(bytes(4096), 4096, True, written=100), short_circuit=False,  # type: ignore
                         gpu_support=lambda: backend.support, gpu=lambda: backend)  # type: ignore
    with pytest.raises(KvfsError) as e, backend.staging(4096) as staging:
        await reader._read_direct(1, None, 0, DeviceSpan(region.addr, 4096, 0, region=region), staging)  # type: ignore
    assert e.value.errno == errno.EIO


def test_a_batch_of_values_is_copied_back_to_back_into_shared_memory() -> None:
    """So the chain's head copies the batch out of this process's arena in one piece (kvfs.transport.shm)."""
    from kvfs.pool import BufferPool
    from kvfs.transport import shm

    shared = BufferPool(capacity=64 << 20, allocate=shm.PROCESS_ARENA.allocate)
    values = [memoryview(bytes([i]) * (100_000 + i)) for i in range(3)]
    copied: list[int] = []

    def to_host(host: memoryview, span: DeviceSpan) -> None:
        copied.append(span.nbytes)
        host[:] = b"g" * span.nbytes

    staged = host_values([*values, DeviceSpan(1 << 20, 7, 0)], to_host, shared)
    assert [bytes(v) for v in staged] == [*map(bytes, values), b"g" * 7] and copied == [7]
    arena = shm.PROCESS_ARENA.get()
    assert arena is not None and shm.contiguous_offset(arena, staged) is not None
    # without shared memory (or for a batch too small to gain) host values stay where they are, GPU ones are copied
    for pool, batch in ((None, values), (shared, [memoryview(b"x" * 100)])):
        plain = host_values(batch, to_host, pool)
        assert all(p.obj is v.obj for p, v in zip(plain, batch))
    spent = BufferPool(capacity=0, allocate=shm.PROCESS_ARENA.allocate)  # no room: nothing gained by a copy
    assert all(p.obj is v.obj for p, v in zip(host_values(values, to_host, spent), values))
