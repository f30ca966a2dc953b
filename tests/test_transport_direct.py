"""GPUDirect RDMA's transport side without a GPU or a NIC: a real RpcServer/RpcClient pair on loopback over the fake
fabric of test_transport_rpc.py (memmove between registered ranges, rkeys checked like a NIC), with host memory
standing in for the caller's GPU region. What is checked is what a GPU would not change: the request names the
region, the server's WRITE lands there and nowhere else, every way the answer cannot go there puts it in the staging
buffer, and no WRITE can reach the region once it is unregistered or its call was given up."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from types import ModuleType, SimpleNamespace

import pytest
import trio

from kvfs.errors import KvfsError
from kvfs.kvclient.buffers import DeviceSpan
from kvfs.kvclient.gpu import GpuBackend, probe
from kvfs.transport import verbs
from kvfs.rpc import RpcClient, RpcServer
from kvfs.transport.direct import DirectInto, DirectRegion, DmaBuf
from kvfs.transport.errors import RdmaError, UnregisteredMemory
from kvfs.transport.verbs import detect_rdma
from kvfs.wire import Limits, Method

from test_transport_rpc import (ECHO, MIN, SLAB, TOKEN, Calls, Fabric, FakeFactory, Req, Resp, pattern,
                                rdma_pair, start_server)


@pytest.fixture
def fabric() -> Fabric:
    return Fabric()


class Memory:
    """Host memory playing the caller's GPU buffer: a region over it, and a staging buffer beside it."""

    def __init__(self, size: int = 4 * SLAB, **region_kw) -> None:
        self.raw = (ctypes.c_char * size)()
        self.region = DirectRegion(ctypes.addressof(self.raw), size, **region_kw)
        self.staging = memoryview(bytearray(size))

    def target(self, offset: int, length: int) -> DirectInto:
        return DirectInto(self.region, offset, length, self.staging)

    def bytes(self, offset: int, length: int) -> bytes:
        return self.raw.raw[offset : offset + length]


async def test_the_answer_lands_in_the_region_named_by_the_request(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    mem = Memory()
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        target = mem.target(SLAB, 50_000)
        resp, data = await client.call_with_data(address, ECHO, Req("gdr", want=50_000), into=target)
    assert resp == Resp("gdr", 0) and data is None
    assert target.written == 50_000 and mem.bytes(SLAB, 50_000) == pattern(50_000, seed=3)
    assert mem.bytes(0, SLAB) == bytes(SLAB) and bytes(mem.staging) == bytes(len(mem.staging))  # nothing staged
    (write,) = fabric.writes
    (addr, length, dmabuf), = cf.direct  # registered once, with the client's protection domain, as peer memory
    assert (addr, length, dmabuf) == (mem.region.addr, mem.region.length, None)
    assert (write.addr, write.length) == (mem.region.addr + SLAB, 50_000)
    assert fabric.regions[write.rkey][2] is cf and cf.pool.in_use == 0  # the region's rkey, not a slab's


@pytest.mark.parametrize("why", ["registration refused", "answer below the RDMA threshold", "TCP transport",
                                 "server cannot RDMA", "answer larger than the server's slab"])
async def test_every_other_way_the_answer_lands_in_the_staging_buffer(nursery, fabric, caplog, why):
    sf = FakeFactory(fabric, available=why != "server cannot RDMA")
    server, address, calls = await start_server(nursery, sf)
    cf = FakeFactory(fabric)
    cf.fail_direct = "Bad address (no peer-memory client)" if why == "registration refused" else None
    n = {"answer below the RDMA threshold": MIN // 2, "answer larger than the server's slab": SLAB + 1}.get(why,
                                                                                                       50_000)
    mem = Memory()
    transport = "tcp" if why == "TCP transport" else None
    with caplog.at_level(logging.WARNING, "kvfs.transport"):
        async with RpcClient(TOKEN, rdma_factory=cf, transport=transport) as client:
            for _ in range(2):
                target = mem.target(0, n)
                resp, data = await client.call_with_data(address, ECHO, Req("x", want=n), into=target)
                assert target.written == 0 and bytes(mem.staging[:n]) == pattern(n, seed=3)
                assert data is not None and data.obj is mem.staging.obj
                mem.staging[:n] = bytes(n)
    assert mem.bytes(0, len(mem.raw)) == bytes(len(mem.raw))  # the region itself was never written
    if why == "registration refused":
        assert len(cf.direct) == 1  # tried once for this domain, not per call
        assert "Bad address" in mem.region.refusal(cf) and caplog.text.count("registering DirectRegion") == 1
    elif why in ("TCP transport", "server cannot RDMA", "answer below the RDMA threshold"):
        assert not fabric.writes


async def test_a_dmabuf_export_that_fails_leaves_the_domain_to_staging(nursery, fabric, caplog):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)

    def export(addr: int, length: int) -> DmaBuf:
        raise KvfsError("cuMemGetHandleForAddressRange failed: CUresult 1", errno.EIO)

    mem = Memory(export=export)
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        target = mem.target(0, 50_000)
        await client.call_with_data(address, ECHO, Req(want=50_000), into=target)
    assert target.written == 0 and bytes(mem.staging[:50_000]) == pattern(50_000, seed=3) and not cf.direct
    assert "CUresult 1" in mem.region.refusal(cf)


async def test_an_unregistered_region_refuses_before_anything_is_sent(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    mem = Memory()
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        await client.call_with_data(address, ECHO, Req("first", want=50_000), into=mem.target(0, 50_000))
        (mr_rkey,) = [k for k, (_, _, owner) in fabric.regions.items() if owner is cf and k not in
                      {r.rkey for r in cf.pool._regions}]
        await mem.region.close()
        assert mr_rkey not in fabric.regions  # deregistered: a WRITE with that rkey fails at the NIC
        count = calls.count
        with pytest.raises(UnregisteredMemory) as e:
            await client.call_with_data(address, ECHO, Req("after", want=50_000), into=mem.target(0, 50_000))
        assert e.value.errno == errno.EFAULT and calls.count == count


async def test_unregistering_waits_for_the_calls_in_flight(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    gate = trio.Event()

    async def slow(req, data, ctx):
        await gate.wait()
        return Resp("slow", 0), pattern(req.want, seed=3)

    method = Method(9121, "test.gdr_slow", Req, Resp, idempotent=True)
    server.register(method, slow)
    mem = Memory()
    closed = trio.Event()
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        target = mem.target(0, 50_000)

        async def unregister() -> None:
            await mem.region.close()
            closed.set()

        async with trio.open_nursery() as inner:
            inner.start_soon(lambda: client.call_with_data(address, method, Req(want=50_000), into=target))
            with trio.fail_after(5):
                while not calls.count and not server.peers:
                    await trio.sleep(0.01)
                await trio.sleep(0.05)
            inner.start_soon(unregister)
            await trio.sleep(0.1)
            assert not closed.is_set() and mem.region.closed  # new calls refused, this one still served
            gate.set()
        assert closed.is_set() and target.written == 50_000 and mem.bytes(0, 50_000) == pattern(50_000, seed=3)


async def test_a_given_up_call_destroys_the_queue_pair_before_returning(nursery, fabric):
    """A late WRITE into memory the caller has moved on to use is impossible: the queue pair is gone by the time
    the call returns; the next call connects afresh and reuses the domain's registration."""
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    gate = trio.Event()

    async def stuck(req, data, ctx):
        await gate.wait()
        return Resp("late", 0), pattern(req.want, seed=3)

    method = Method(9122, "test.gdr_stuck", Req, Resp)
    server.register(method, stuck)
    mem = Memory()
    async with RpcClient(TOKEN, rdma_factory=cf, retries=0) as client:
        conn = await client.connection(address)
        with pytest.raises(KvfsError):
            await client.call_with_data(address, method, Req(want=50_000), into=mem.target(0, 50_000), timeout=0.2)
        assert all(e.closed for e in cf.endpoints) and conn.closed
        gate.set()  # the server's late WRITE now fails against a destroyed queue pair
        target = mem.target(SLAB, 50_000)
        await client.call_with_data(address, ECHO, Req(want=50_000), into=target)
        assert target.written == 50_000 and len(cf.endpoints) == 2 and len(cf.direct) == 1
    with trio.fail_after(5):
        while len(server.peers) > 1:
            await trio.sleep(0.01)
    assert mem.bytes(0, 50_000) == bytes(50_000)  # the abandoned call's answer never landed


async def test_a_new_protection_domain_registers_the_region_again(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    mem = Memory()
    for factory in (cf, cf, FakeFactory(fabric)):  # a new connection on one domain reuses its registration
        async with RpcClient(TOKEN, rdma_factory=factory) as client:
            target = mem.target(0, 50_000)
            await client.call_with_data(address, ECHO, Req(want=50_000), into=target)
            assert target.written == 50_000
    assert len(cf.direct) == 1 and mem.region.registered_domains == 2
    await mem.region.close()
    assert mem.region.registered_domains == 0


async def test_a_dmabuf_region_registers_the_exported_fd_and_closes_it(nursery, fabric, tmp_path):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    exported: list[tuple[int, int, int]] = []

    def export(addr: int, length: int) -> DmaBuf:  # a plain file's fd stands in for the CUDA driver's dma-buf
        fd = os.open(tmp_path / "dmabuf", os.O_CREAT | os.O_RDWR)
        exported.append((addr, length, fd))
        return DmaBuf(fd, 123)

    mem = Memory(export=export)
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        await client.call_with_data(address, ECHO, Req(want=50_000), into=mem.target(0, 50_000))
    ((addr, length, fd),) = exported
    assert mem.region.method == "dmabuf" and cf.direct == [(addr, length, DmaBuf(fd, 123))]
    with pytest.raises(OSError):  # the MR holds the dma-buf; the exported fd is not leaked
        os.fstat(fd)


# ------------------------------------------------------------------------- the verbs calls, on fakes


class _MRCall:
    def __init__(self, *args, **kw) -> None:
        if _MRCall.error_code is not None:
            exc = Exception("Failed to register a MR")
            exc.error_code = _MRCall.error_code  # what PyverbsRDMAError carries
            raise exc
        self.args, self.kw = args, kw

    error_code: int | None = None


def _device(monkeypatch) -> verbs.RdmaDevice:
    """An RdmaDevice with a fake pyverbs behind it (opening a real one needs a NIC)."""
    enums = SimpleNamespace(IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_READ=4, IBV_ACCESS_REMOTE_WRITE=2)
    device = object.__new__(verbs.RdmaDevice)
    device.pv, device.pd, device.name = SimpleNamespace(mr=SimpleNamespace(MR=_MRCall), enums=enums), "PD", "mlx5_0"
    module = ModuleType("pyverbs.providers.mlx5.mlx5dv_dmabuf")
    module.Mlx5DmaBufMR = _MRCall
    monkeypatch.setitem(sys.modules, "pyverbs.providers.mlx5.mlx5dv_dmabuf", module)
    monkeypatch.setattr(_MRCall, "error_code", None)
    return device


def test_peer_memory_registers_the_device_address(monkeypatch):
    mr = _device(monkeypatch).register_direct(0x7F00_0000_0000, 1 << 20, None)
    assert mr.args == ("PD", 1 << 20, 7) and mr.kw == {"address": 0x7F00_0000_0000}


def test_a_dmabuf_is_registered_at_the_gpu_address_as_its_iova(monkeypatch):
    mr = _device(monkeypatch).register_direct(0x7F00_0000_0010, 1 << 20, DmaBuf(9, 0x10))
    assert mr.args == ("PD", 0x10, 1 << 20) and mr.kw == {"iova": 0x7F00_0000_0010, "fd": 9, "access": 7}


@pytest.mark.parametrize("dmabuf", [None, DmaBuf(9, 0)])
def test_a_refused_registration_is_an_rdma_error_saying_how(monkeypatch, dmabuf):
    device = _device(monkeypatch)
    _MRCall.error_code = errno.EFAULT  # ibv_reg_mr on GPU memory without nvidia-peermem
    with pytest.raises(RdmaError) as e:
        device.register_direct(0x7F00_0000_0000, 4096, dmabuf)
    assert e.value.errno == errno.EFAULT
    assert ("peer memory" if dmabuf is None else "a dma-buf") in str(e.value)


# ------------------------------------------------------------------------------- real hardware

def _gdr_missing() -> str:
    rdma = detect_rdma()
    if not rdma.available:
        return f"no RDMA device: {rdma.reason}"
    support = probe()
    if support.gdr is None:
        return support.gdr_reason or support.reason
    return ""


_MISSING = _gdr_missing()


@pytest.mark.skipif(bool(_MISSING), reason=f"needs an RDMA NIC and a GPU it can reach: {_MISSING}")
class TestGdrOnHardware:
    """A real RpcServer/RpcClient pair over the verbs factory: the server's RDMA WRITE lands in GPU memory."""

    async def test_answer_lands_in_gpu_memory(self, nursery):
        support = probe()
        backend = GpuBackend(support)
        lib = backend._lib
        if support.copier == "cupy":
            array = lib.zeros(4 * SLAB, dtype=lib.uint8)
        else:
            array = lib.zeros(4 * SLAB, dtype=lib.uint8, device="cuda:0")
        ptr = int(array.__cuda_array_interface__["data"][0])
        region = backend.direct_region(ptr, 4 * SLAB)
        assert region is not None
        server = RpcServer(TOKEN, limits=Limits(max_data=8 << 20), transport="rdma")
        calls = Calls()
        server.register(ECHO, calls.handler)
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        staging = memoryview(bytearray(4 * SLAB))
        async with RpcClient(TOKEN, transport="rdma") as client:
            target = DirectInto(region, SLAB, 1 << 20, staging)
            await client.call_with_data(f"127.0.0.1:{port}", ECHO, Req(want=1 << 20), into=target)
        await region.close()
        back = memoryview(bytearray(1 << 20))
        backend.to_host(back, DeviceSpan(ptr + SLAB, 1 << 20, 0))
        assert target.written == 1 << 20 and bytes(back) == pattern(1 << 20, seed=3)
        assert bytes(staging) == bytes(len(staging))
