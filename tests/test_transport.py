"""The RDMA bulk-data transport: detection and fallback, handshake, registered buffers, work requests.

Everything except the last class runs without an RDMA device (and without pyverbs); the last class needs a
real device with an active port and is skipped, with the detection reason, everywhere else.
"""

from __future__ import annotations

import errno
import sys
import threading
from types import SimpleNamespace

import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfs import wire
from kvfs.errors import ConnectionLost, KvfsError, ProtocolError
from kvfs.rpc import RpcClient, RpcServer
from kvfs.transport import verbs
from kvfs.transport.buffers import BufferPool, LocalSge, RemoteBuffer, buffer_address
from kvfs.transport.errors import BufferExhausted, RdmaError, RdmaUnavailable, UnregisteredMemory
from kvfs.transport.handshake import (
    RDMA_CONNECT,
    RdmaAccept,
    RdmaOffer,
    decode_accept,
    decode_offer,
    encode,
)
from kvfs.transport.select import ActivePort, RdmaAvailability, TransportMode, choose_transport
from kvfs.transport.verbs import WrOp, build_rdma_wr, detect_rdma, plan_connect, to_pyverbs_wr, wc_error

PAGE = 4096
NO_DEVICE = RdmaAvailability(False, "no RDMA devices found")
HAS_DEVICE = RdmaAvailability(True, "active", ["mlx5_0"], [ActivePort("mlx5_0", 1, 3, "infiniband", 4096)])


def offer(**kw) -> RdmaOffer:
    base = dict(device="mlx5_0", port=1, lid=3, gid=bytes(16), gid_index=0, qp_num=0x11, psn=0x1234, mtu=4096)
    base.update(kw)
    return RdmaOffer(**base)


# ------------------------------------------------------------------------------------------- detection


def test_detect_on_this_machine_reports_a_reason_without_raising():
    result = detect_rdma()
    assert isinstance(result, RdmaAvailability)
    if not result.available:
        assert result.reason
        assert not result.ports


def test_detect_when_pyverbs_import_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # makes `import pyverbs.x` raise ImportError
    result = detect_rdma()
    assert not result.available
    assert "pyverbs is not importable" in result.reason


def test_detect_when_pyverbs_is_broken(monkeypatch):
    def broken():
        raise OSError("libibverbs.so.1: cannot open shared object file")

    monkeypatch.setattr(verbs, "load_pyverbs", broken)
    result = detect_rdma()
    assert not result.available and "libibverbs" in result.reason


class FakePyverbsRDMAError(Exception):
    def __init__(self, msg, error_code=-1):
        super().__init__(msg)
        self.error_code = error_code


def fake_pv(devices=None, list_raises=False, ports=None):
    """A pyverbs stand-in: ``ports`` maps device name to a list of (state, lid, active_mtu enum, link_layer)."""
    ports = ports or {}

    def get_device_list():
        if list_raises:
            raise FakePyverbsRDMAError("Failed to get devices list")
        return [SimpleNamespace(name=n.encode()) for n in devices or []]

    class Context:
        def __init__(self, name):
            self.name = name
            self.closed = False

        def query_device(self):
            return SimpleNamespace(phys_port_cnt=len(ports.get(self.name, [])))

        def query_port(self, port):
            state, lid, mtu, layer = ports[self.name][port - 1]
            return SimpleNamespace(state=state, lid=lid, active_mtu=mtu, link_layer=layer)

        def close(self):
            self.closed = True

    return SimpleNamespace(device=SimpleNamespace(get_device_list=get_device_list, Context=Context))


def test_detect_when_get_device_list_raises(monkeypatch):
    monkeypatch.setattr(verbs, "load_pyverbs", lambda: fake_pv(list_raises=True))
    result = detect_rdma()
    assert not result.available
    assert "cannot list RDMA devices" in result.reason and "Failed to get devices list" in result.reason


def test_detect_with_no_devices(monkeypatch):
    monkeypatch.setattr(verbs, "load_pyverbs", lambda: fake_pv(devices=[]))
    assert detect_rdma() == RdmaAvailability(False, "no RDMA devices found")


def test_detect_with_no_active_port(monkeypatch):
    monkeypatch.setattr(verbs, "load_pyverbs", lambda: fake_pv(["mlx5_0"], ports={"mlx5_0": [(1, 0, 3, 1)]}))
    result = detect_rdma()
    assert not result.available and result.devices == ["mlx5_0"]
    assert "no active RDMA port on mlx5_0" in result.reason and "not ACTIVE" in result.reason


def test_detect_with_an_active_port(monkeypatch):
    pv = fake_pv(["mlx5_0", "mlx5_1"], ports={"mlx5_0": [(1, 0, 3, 1), (4, 7, 5, 1)], "mlx5_1": [(4, 0, 3, 2)]})
    monkeypatch.setattr(verbs, "load_pyverbs", lambda: pv)
    result = detect_rdma()
    assert result.available
    assert result.ports == [
        ActivePort("mlx5_0", 2, 7, "infiniband", 4096),
        ActivePort("mlx5_1", 1, 0, "ethernet", 1024),
    ]


# ------------------------------------------------------------------------------------ choosing


@pytest.mark.parametrize("mode", ["auto", "tcp", "rdma", TransportMode.AUTO])
@pytest.mark.parametrize("local", [NO_DEVICE, HAS_DEVICE], ids=["nodev", "dev"])
@pytest.mark.parametrize("peer", [None, offer()], ids=["peer-none", "peer-offers"])
def test_choose_transport_truth_table(mode, local, peer, caplog):
    mode = TransportMode.parse(mode)
    both = local.available and peer is not None
    if mode is TransportMode.TCP:
        assert choose_transport(mode, local, peer) == "tcp"
    elif mode is TransportMode.AUTO:
        with caplog.at_level("INFO", logger="kvfs.transport.select"):
            got = choose_transport(mode, local, peer)
        assert got == ("rdma" if both else "tcp")
        if not both:  # the fallback says why
            assert "bulk data over TCP" in caplog.text
            if not local.available:
                assert local.reason in caplog.text
    elif both:
        assert choose_transport(mode, local, peer) == "rdma"
    else:
        with pytest.raises(RdmaUnavailable) as info:
            choose_transport(mode, local, peer)
        assert isinstance(info.value, KvfsError)
        assert info.value.errno == (errno.ENODEV if not local.available else errno.EOPNOTSUPP)


def test_forced_rdma_without_device_is_a_clear_error():
    with pytest.raises(KvfsError) as info:
        choose_transport("rdma", detect_rdma() if not detect_rdma().available else NO_DEVICE, offer())
    assert info.value.errno == errno.ENODEV
    assert "forced" in info.value.message and "cannot use RDMA" in info.value.message


def test_transport_mode_parse():
    assert TransportMode.parse(" RDMA ") is TransportMode.RDMA
    with pytest.raises(ValueError, match="auto, tcp, rdma"):
        TransportMode.parse("infiniband")


# ------------------------------------------------------------------------------------ handshake

offers = st.builds(
    RdmaOffer,
    device=st.from_regex(r"[A-Za-z0-9_]{1,64}", fullmatch=True),
    port=st.integers(1, 255),
    lid=st.integers(0, 0xFFFF),
    gid=st.binary(min_size=16, max_size=16),
    gid_index=st.integers(0, 255),
    qp_num=st.integers(1, 0xFFFFFF),
    psn=st.integers(0, 0xFFFFFF),
    mtu=st.sampled_from([256, 512, 1024, 2048, 4096]),
    max_rd_atomic=st.integers(1, 255),
)


@settings(max_examples=100, deadline=None)
@given(offers)
def test_handshake_round_trip(o):
    assert decode_offer(encode(o)) == o
    accept = RdmaAccept(True, o)
    assert decode_accept(encode(accept)) == accept


def test_refusal_round_trip():
    refusal = RdmaAccept.refuse("no RDMA device: x" * 100)
    assert decode_accept(encode(refusal)) == refusal and not refusal.accepted


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_handshake_garbage_is_a_protocol_error(raw):
    for decode in (decode_offer, decode_accept):
        try:
            decode(raw)
        except ProtocolError:
            pass


_FIELDS = list(RdmaOffer.__struct_fields__)


@pytest.mark.parametrize(
    "field,value",
    [
        ("device", ""),
        ("device", "x" * 65),
        ("device", "../etc"),
        ("port", 0),
        ("port", 256),
        ("lid", 0x10000),
        ("gid", b"\x00" * 15),
        ("gid", b"\x00" * 17),
        ("qp_num", 0),
        ("qp_num", 1 << 24),
        ("psn", -1),
        ("psn", 1 << 24),
        ("mtu", 1500),
        ("mtu", 8192),
        ("max_rd_atomic", 0),
        ("version", 2),
        ("psn", "12"),
    ],
)
def test_out_of_bounds_offer_is_a_protocol_error(field, value):
    fields = msgspec.structs.asdict(offer())
    fields[field] = value
    raw = msgspec.msgpack.encode([fields[f] for f in _FIELDS])
    with pytest.raises(ProtocolError):
        decode_offer(raw)
    with pytest.raises(ProtocolError):  # nested inside an accept, too
        decode_accept(msgspec.msgpack.encode([True, [fields[f] for f in _FIELDS], ""]))


def test_accept_consistency_is_checked():
    with pytest.raises(ProtocolError):
        decode_accept(msgspec.msgpack.encode([True, None, ""]))
    with pytest.raises(ProtocolError):
        decode_accept(msgspec.msgpack.encode([False, list(msgspec.structs.astuple(offer())), "no"]))


async def test_handshake_travels_over_the_tcp_rpc():
    """The accepting side refuses (no device here) and the connecting side falls back to TCP."""
    server = RpcServer("tok")
    local = detect_rdma()

    async def rdma_connect(request: RdmaOffer, data, ctx):
        if choose_transport("auto", local, request) == "tcp":
            return RdmaAccept.refuse(f"no RDMA device: {local.reason}")
        raise AssertionError("this test expects no device")  # pragma: no cover

    server.register(RDMA_CONNECT, rdma_connect)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        async with RpcClient("tok") as client:
            answer = await client.call(f"127.0.0.1:{port}", RDMA_CONNECT, offer())
        nursery.cancel_scope.cancel()
    if local.available:  # pragma: no cover
        pytest.skip("a device is present")
    assert isinstance(answer, RdmaAccept) and not answer.accepted
    assert "no RDMA device" in answer.reason
    assert choose_transport("auto", local, answer.endpoint) == "tcp"


# ------------------------------------------------------------------------------------ buffers


class FakeMR:
    def __init__(self, view, addr, n):
        self.addr, self.length = addr, view.nbytes
        self.lkey, self.rkey = 0x100 + n, 0x200 + n
        self.closed = False

    def close(self):
        self.closed = True


class FakeRegistrar:
    def __init__(self, fail_after=None):
        self.mrs: list[FakeMR] = []
        self.fail_after = fail_after

    def __call__(self, view, addr):
        assert isinstance(view, memoryview) and addr == buffer_address(view)
        assert addr % PAGE == 0
        if self.fail_after is not None and len(self.mrs) >= self.fail_after:
            raise RdmaError("ibv_reg_mr failed", errno.ENOMEM)
        mr = FakeMR(view, addr, len(self.mrs))
        self.mrs.append(mr)
        return mr


def small_pool(reg=None, **kw) -> BufferPool:
    kw = {"slab_size": PAGE, "slabs_per_region": 4, "max_regions": 3, **kw}
    return BufferPool(reg or FakeRegistrar(), **kw)


def test_pool_registers_lazily_and_exhausts_at_its_bound():
    reg = FakeRegistrar()
    pool = small_pool(reg)
    assert pool.registered_bytes == 0 and not reg.mrs
    slabs = [pool.acquire() for _ in range(pool.capacity)]
    assert len(reg.mrs) == 3 and pool.in_use == 12
    with pytest.raises(BufferExhausted) as info:
        pool.acquire()
    assert info.value.errno == errno.ENOBUFS
    slabs.pop().release()
    slabs.append(pool.acquire())  # a released slab is reusable, no new registration
    assert len(reg.mrs) == 3
    for s in slabs:
        pool.release(s)
    assert pool.in_use == 0


def test_slab_descriptors_and_lookup():
    reg = FakeRegistrar()
    pool = small_pool(reg)
    with pool.slab() as slab:
        slab.view[:5] = b"hello"
        mr = reg.mrs[0]
        assert mr.addr <= slab.addr < mr.addr + mr.length
        remote = slab.remote(100, 200)
        assert remote == RemoteBuffer(slab.addr + 100, mr.rkey, 200)
        assert pool.lookup(slab.view[100:300]) == LocalSge(slab.addr + 100, 200, mr.lkey)
        assert pool.describe(slab.view[100:300]) == remote
        assert slab.sge() == LocalSge(slab.addr, PAGE, mr.lkey)
        with pytest.raises(ValueError):
            slab.remote(PAGE - 10, 11)
        # the descriptor travels in an RPC body
        assert wire.decode_body(RemoteBuffer, wire.encode_body(remote)) == remote
    assert pool.in_use == 0


def test_foreign_memory_is_refused():
    pool = small_pool(slabs_per_region=2, max_regions=2)
    a = [pool.acquire(), pool.acquire(), pool.acquire()]  # two regions
    for foreign in (bytearray(64), memoryview(bytearray(PAGE))[10:20]):
        with pytest.raises(UnregisteredMemory) as info:
            pool.lookup(foreign)
        assert info.value.errno == errno.EFAULT
    with pytest.raises(UnregisteredMemory):
        pool.lookup(memoryview(b"read-only bytes"))
    with pytest.raises(UnregisteredMemory):
        pool.lookup(a[0].view[:0])
    with pytest.raises(UnregisteredMemory):
        pool.describe(bytearray(8))
    # a view spanning both slabs of one region is registered memory; nothing spans two registrations
    region_view = a[0].region.memory
    assert pool.lookup(memoryview(region_view)).length == 2 * PAGE


def test_release_errors_and_close():
    reg = FakeRegistrar()
    pool, other = small_pool(reg), small_pool()
    slab = pool.acquire()
    with pytest.raises(ValueError, match="another pool"):
        other.release(slab)
    pool.release(slab)
    with pytest.raises(ValueError, match="twice"):
        pool.release(slab)
    pool.close()
    assert all(mr.closed for mr in reg.mrs)
    with pytest.raises(BufferExhausted):
        pool.acquire()


def test_failed_registration_leaves_no_region():
    pool = small_pool(FakeRegistrar(fail_after=1), slabs_per_region=1)
    pool.acquire()
    with pytest.raises(RdmaError):
        pool.acquire()
    assert pool.registered_bytes == PAGE and pool.in_use == 1


def test_pool_rejects_bad_geometry():
    with pytest.raises(ValueError):
        BufferPool(FakeRegistrar(), slab_size=1000)
    with pytest.raises(ValueError):
        BufferPool(FakeRegistrar(), slab_size=PAGE, max_regions=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=60))
def test_pool_never_hands_out_overlapping_slabs(ops):
    reg = FakeRegistrar()
    pool = small_pool(reg, slabs_per_region=3, max_regions=2)
    held = []
    for acquire, pick in ops:
        if acquire:
            if len(held) == pool.capacity:
                with pytest.raises(BufferExhausted):
                    pool.acquire()
                continue
            slab = pool.acquire()
            slab.view[:8] = slab.addr.to_bytes(8, "little")  # mark ownership
            held.append(slab)
        elif held:
            held.pop(pick % len(held)).release()
        spans = sorted((s.addr, s.addr + s.size) for s in held)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        for s in held:  # inside a registration, and nobody else wrote into it
            assert any(mr.addr <= s.addr and s.addr + s.size <= mr.addr + mr.length for mr in reg.mrs)
            assert int.from_bytes(s.view[:8], "little") == s.addr
        assert pool.in_use == len(held) <= pool.capacity


def test_remote_buffer_bounds():
    rb = RemoteBuffer(0x1000, 7, 100)
    assert rb.slice(10, 20) == RemoteBuffer(0x100A, 7, 20)
    assert rb.slice(90) == RemoteBuffer(0x105A, 7, 10)
    with pytest.raises(ValueError):
        rb.slice(90, 11)
    for bad in ([-1, 7, 1], [0, 1 << 32, 1], [0, 7, (1 << 31) + 1], [(1 << 64) - 1, 7, 2]):
        with pytest.raises(ProtocolError):
            wire.decode_body(RemoteBuffer, msgspec.msgpack.encode(bad))


# ------------------------------------------------------------------------------ work requests


def sges(*lengths, lkey=5):
    out, addr = [], 0x10000
    for n in lengths:
        out.append(LocalSge(addr, n, lkey))
        addr += n
    return out


def test_build_rdma_read_and_write():
    remote = RemoteBuffer(0x7F0000000000, 0xABC, 300)
    rd = build_rdma_wr("read", sges(100, 200), remote, wr_id=42)
    assert rd.op is WrOp.READ and rd.opcode == verbs.IBV_WR_RDMA_READ == 4
    assert (rd.remote_addr, rd.rkey, rd.length, rd.wr_id) == (remote.addr, 0xABC, 300, 42)
    assert rd.send_flags == verbs.IBV_SEND_SIGNALED and len(rd.sges) == 2
    wr = build_rdma_wr(WrOp.WRITE, sges(300), remote, wr_id=(1 << 64) - 1, signaled=False)
    assert wr.opcode == verbs.IBV_WR_RDMA_WRITE == 0 and wr.send_flags == 0


@pytest.mark.parametrize(
    "local,remote_len,wr_id,match",
    [
        ([], 0, 1, "at least one"),
        (sges(100), 101, 1, "remote buffer is 101"),
        (sges(*[1] * 17), 17, 1, "limit of 16"),
        (sges(0), 0, 1, "0 bytes"),
        (sges(10), 10, -1, "64 bits"),
        (sges(10), 10, 1 << 64, "64 bits"),
        ([LocalSge(0, 10, 1)], 10, 1, "not a user address"),
        ([LocalSge(0x1000, 10, 1 << 32)], 10, 1, "lkey"),
    ],
)
def test_build_rdma_wr_rejects(local, remote_len, wr_id, match):
    with pytest.raises(ValueError, match=match):
        build_rdma_wr("write", local, RemoteBuffer(0x1000, 1, remote_len), wr_id)
    with pytest.raises(ValueError):
        build_rdma_wr("send", sges(10), RemoteBuffer(0x1000, 1, 10), 1)


def test_to_pyverbs_wr_with_a_stand_in():
    calls = {}

    class SendWR:
        def __init__(self, **kw):
            calls["wr"] = kw

        def set_wr_rdma(self, rkey, addr):
            calls["rdma"] = (rkey, addr)

    pv = SimpleNamespace(wr=SimpleNamespace(SGE=lambda a, n, k: (a, n, k), SendWR=SendWR))
    desc = build_rdma_wr("read", sges(100, 28), RemoteBuffer(0x5000, 9, 128), 7)
    to_pyverbs_wr(desc, pv)
    assert calls["wr"] == dict(
        wr_id=7, opcode=4, num_sge=2, sg=[(0x10000, 100, 5), (0x10064, 28, 5)], send_flags=verbs.IBV_SEND_SIGNALED
    )
    assert calls["rdma"] == (9, 0x5000)


def test_plan_connect():
    a = offer(qp_num=10, psn=111, mtu=4096, lid=1)
    b = offer(qp_num=20, psn=222, mtu=1024, lid=2, max_rd_atomic=4)
    plan = plan_connect(a, b)
    assert plan.dest_qp_num == 20 and plan.rq_psn == 222 and plan.sq_psn == 111 and plan.dlid == 2
    assert plan.path_mtu == verbs.MTU_ENUM[1024] == 3 and plan.max_rd_atomic == 4
    assert plan.max_dest_rd_atomic == 16 and not plan.use_grh
    gid = bytes.fromhex("fe800000000000000202c9fffe000001")
    roce = plan_connect(offer(gid=gid, gid_index=3), offer(gid=gid[::-1], lid=0))
    assert roce.use_grh and roce.sgid_index == 3 and verbs.gid_bytes(roce.dgid) == gid[::-1]
    assert verbs.gid_text(gid) == "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    with pytest.raises(RdmaUnavailable):
        plan_connect(offer(gid=gid), offer())
    with pytest.raises(RdmaUnavailable):
        plan_connect(offer(), offer(lid=0))


def test_error_mapping():
    assert wc_error(0) is None
    err = wc_error(10, 0x88, 5, "RDMA READ of 4096 bytes")
    assert isinstance(err, RdmaError) and err.errno == errno.EACCES
    assert "IBV_WC_REM_ACCESS_ERR" in err.message and "0x88" in err.message
    assert isinstance(wc_error(5), ConnectionLost) and wc_error(12).errno == errno.ETIMEDOUT
    assert wc_error(99).errno == errno.EIO
    e = verbs.verbs_error(FakePyverbsRDMAError("Failed to register a MR", errno.ENOMEM), "registering")
    assert isinstance(e, RdmaError) and e.errno == errno.ENOMEM
    assert verbs.verbs_error(FakePyverbsRDMAError("x", errno.ENODEV), "open").errno == errno.ENODEV
    assert verbs.verbs_error(RuntimeError("?"), "x").errno == errno.EIO


def test_rdma_device_without_pyverbs_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)
    with pytest.raises(RdmaUnavailable):
        verbs.RdmaDevice("mlx5_0")


def test_constants_match_pyverbs():
    """The ABI values the pure functions hard-code, checked wherever pyverbs is installed (device or not)."""
    e = pytest.importorskip("pyverbs.enums")
    assert (verbs.IBV_WR_RDMA_READ, verbs.IBV_WR_RDMA_WRITE) == (e.IBV_WR_RDMA_READ, e.IBV_WR_RDMA_WRITE)
    assert (verbs.IBV_SEND_SIGNALED, verbs.IBV_PORT_ACTIVE) == (e.IBV_SEND_SIGNALED, e.IBV_PORT_ACTIVE)
    assert all(verbs.MTU_ENUM[m] == getattr(e, f"IBV_MTU_{m}") for m in verbs.MTU_ENUM)
    assert all(getattr(e, "IBV_WC_" + name) == s for s, name in verbs.WC_STATUS_NAMES.items())


# ---------------------------------------------------------------------------- completion poller


class FakeCQ:
    """Completes posted work requests from another thread, like a NIC would."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ready = []
        self.raise_on_poll = None

    def complete(self, wr_id, status=0, byte_len=0):
        with self.lock:
            self.ready.append(SimpleNamespace(wr_id=wr_id, status=status, vendor_err=0, byte_len=byte_len))

    def poll(self, n=1):
        if self.raise_on_poll:
            raise self.raise_on_poll
        with self.lock:
            out, self.ready = self.ready[:n], self.ready[n:]
        return len(out), out


async def test_poller_delivers_completions_to_their_waiters():
    cq = FakeCQ()
    poller = verbs.CompletionPoller(cq)
    try:
        events = {i: poller.expect(i) for i in range(1, 6)}
        with pytest.raises(ValueError):
            poller.expect(3)
        for i in reversed(range(1, 6)):
            cq.complete(i, byte_len=i * 100)
        results = {}
        async with trio.open_nursery() as nursery:
            for i, ev in events.items():

                async def one(i=i, ev=ev):
                    results[i] = await poller.wait(i, ev, "test")

                nursery.start_soon(one)
        assert results == {i: i * 100 for i in range(1, 6)}
        ev = poller.expect(9)
        cq.complete(9, status=12)
        with pytest.raises(ConnectionLost) as info:
            await poller.wait(9, ev, "RDMA WRITE")
        assert info.value.errno == errno.ETIMEDOUT
    finally:
        poller.close()


async def test_poller_wait_is_shielded_until_the_nic_is_done():
    cq = FakeCQ()
    poller = verbs.CompletionPoller(cq)
    try:
        ev = poller.expect(1)
        got = []

        async def late():
            await trio.sleep(0.2)
            cq.complete(1, byte_len=7)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(late)
            with trio.move_on_after(0.05) as scope:
                got.append(await poller.wait(1, ev, "test"))
                await trio.sleep(0)  # the deferred cancellation lands here
                got.append("not reached")
        assert got == [7]  # the buffer was not given back before the completion arrived
        assert scope.cancelled_caught
    finally:
        poller.close()


async def test_poller_gives_up_on_a_wedged_device():
    poller = verbs.CompletionPoller(FakeCQ(), completion_timeout_s=0.1)
    try:
        ev = poller.expect(1)
        with pytest.raises(RdmaError) as info:
            await poller.wait(1, ev, "RDMA READ")
        assert info.value.errno == errno.ETIMEDOUT
        with pytest.raises(RdmaError):  # the poller (and its QP) is done for
            poller.expect(2)
    finally:
        poller.close()


async def test_poller_failure_fails_every_waiter():
    cq = FakeCQ()
    cq.raise_on_poll = FakePyverbsRDMAError("Failed to poll CQ", errno.EIO)
    poller = verbs.CompletionPoller(cq)
    try:
        ev = poller.expect(1)
        with pytest.raises(RdmaError):
            await poller.wait(1, ev, "test")
        with pytest.raises(RdmaError):
            poller.expect(2)
    finally:
        poller.close()


# ----------------------------------------------------------------------------- real hardware

_DETECTED = detect_rdma()


@pytest.mark.skipif(not _DETECTED.available, reason=f"no RDMA device: {_DETECTED.reason}")
class TestRealDevice:
    """Loopback RDMA between two queue pairs on the first active port (needs a device; skipped elsewhere)."""

    @pytest.fixture
    def device(self):
        port = _DETECTED.ports[0]
        dev = verbs.RdmaDevice(port.device, port.port, gid_index=1 if port.link_layer == "ethernet" else 0)
        yield dev
        dev.close()

    def test_device_opens_and_offers_a_valid_endpoint(self, device):
        qp = verbs.RdmaQueuePair(device)
        try:
            assert decode_offer(encode(qp.offer())) == qp.offer()
        finally:
            qp.close()

    async def test_loopback_write_then_read(self, device):
        pool = device.buffer_pool(slab_size=1 << 20, slabs_per_region=4, max_regions=1)
        a, b = verbs.RdmaQueuePair(device), verbs.RdmaQueuePair(device)
        try:
            # what the RDMA_CONNECT RPC carries, through its codec
            offer_a = decode_offer(encode(a.offer()))
            accept = decode_accept(encode(RdmaAccept(True, b.offer())))
            b.connect(offer_a)
            a.connect(accept.endpoint)
            src, dst, back = pool.acquire(), pool.acquire(), pool.acquire()
            payload = bytes(range(256)) * 4096
            src.view[:] = payload
            end_a = verbs.RdmaEndpoint(a, pool)
            assert await end_a.write(src.view, dst.remote()) == len(payload)
            assert bytes(dst.view) == payload
            await end_a.read(back.view[:4096], dst.remote(4096, 4096))
            assert bytes(back.view[:4096]) == payload[4096:8192]
            with pytest.raises(RdmaError) as info:  # a wrong rkey is refused by the responder
                await end_a.read(back.view[:16], RemoteBuffer(dst.addr, dst.rkey ^ 0xFF, 16))
            assert info.value.errno == errno.EACCES
        finally:
            a.close()
            b.close()
            pool.close()
