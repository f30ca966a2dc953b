"""RDMA inside kvfs.rpc, without a device: mode resolution, the handshake over a real TCP pair, descriptors,
which path a call takes, and the whole data path over an in-process fake fabric (memmove between registered
slabs, checked against rkeys like a NIC would), including every fallback.

The last class moves data between a real RpcServer/RpcClient pair over a real device and is skipped, with the
detection reason, where there is none.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import logging
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from kvfs import wire
from kvfs.config import ClusterConfig, load_config
from kvfs.errors import ConnectionLost, KvfsError, ProtocolError
from kvfs.rpc import FrameReader, RpcClient, RpcServer, authenticate_server, send_all
from kvfs.transport import link
from kvfs.transport.buffers import BufferPool, RemoteBuffer, buffer_address
from kvfs.transport.errors import RdmaError, RdmaUnavailable
from kvfs.transport.handshake import RDMA_CONNECT, RdmaOffer
from kvfs.transport.link import CallPlan, plan_call, resolve_mode
from kvfs.transport.select import ActivePort, RdmaAvailability, TransportMode
from kvfs.transport.verbs import detect_rdma
from kvfs.wire import Limits, Method

from harness import RecordingProxy, authenticated, frames, send_until_closed

TOKEN = "tok"
NO_DEVICE = RdmaAvailability(False, "no RDMA devices found")
FAKE_DEVICE = RdmaAvailability(True, "fake", ["fake0"], [ActivePort("fake0", 1, 1, "infiniband", 4096)])
SLAB = 64 << 10
MIN = 1024
REPO = Path(__file__).resolve().parent.parent


class Req(msgspec.Struct, array_like=True):
    text: str = ""
    want: int = -1  # response data length; -1 echoes the request's data back


class Resp(msgspec.Struct, array_like=True):
    text: str
    got: int


ECHO = Method(9101, "test.rdma_echo", Req, Resp, idempotent=True)
ONCE = Method(9102, "test.rdma_once", Req, Resp)


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


# ------------------------------------------------------------------------------------ fake fabric


class FakeMR:
    def __init__(self, rkey: int, fabric: Fabric | None = None) -> None:
        self.lkey = self.rkey = rkey
        self.fabric = fabric
        self.closed = False

    def close(self) -> None:
        """Deregistered: the rkey stops working, as ibv_dereg_mr makes it."""
        self.closed = True
        if self.fabric is not None:
            self.fabric.regions.pop(self.rkey, None)


class Fabric:
    """Registered regions by rkey and queue pairs by number, shared by every fake endpoint of a test."""

    def __init__(self) -> None:
        self.regions: dict[int, tuple[int, int, object]] = {}
        self.endpoints: dict[int, FakeEndpoint] = {}
        self.rkeys = itertools.count(0x1000)
        self.qp_nums = itertools.count(1)
        self.bytes_read = 0
        self.bytes_written = 0
        self.writes: list[RemoteBuffer] = []  # every RDMA WRITE's destination, as the NIC was told it

    def registrar(self, owner: object):
        def register(view: memoryview, addr: int) -> FakeMR:
            rkey = next(self.rkeys)
            self.regions[rkey] = (addr, view.nbytes, owner)
            return FakeMR(rkey)

        return register

    def check(self, remote: RemoteBuffer, owner: object) -> None:
        region = self.regions.get(remote.rkey)
        if region is None or region[2] is not owner:
            raise RdmaError(f"remote access error: rkey {remote.rkey:#x} is not the peer's", errno.EACCES)
        addr, length, _ = region
        if not (addr <= remote.addr and remote.addr + remote.length <= addr + length):
            raise RdmaError("remote access error: range outside the peer's region", errno.EACCES)


class FakeEndpoint:
    def __init__(self, factory: FakeFactory) -> None:
        self.factory = factory
        self.fabric = factory.fabric
        self.pool = factory.pool
        self.domain = factory  # one protection domain per factory, as VerbsFactory has one per process
        self.qp_num = next(self.fabric.qp_nums)
        self.fabric.endpoints[self.qp_num] = self
        self.peer: FakeEndpoint | None = None
        self.closed = False

    def offer(self) -> RdmaOffer:
        return RdmaOffer(device="fake0", port=1, lid=1, gid=bytes(16), gid_index=0, qp_num=self.qp_num, psn=1, mtu=4096)

    def connect(self, peer: RdmaOffer) -> None:
        if self.factory.fail_connect:
            raise RdmaError(f"modify QP to RTR: {self.factory.fail_connect}", errno.EINVAL)
        self.peer = self.fabric.endpoints[peer.qp_num]

    async def _op(self, local: memoryview, remote: RemoteBuffer, read: bool) -> int:
        await trio.sleep(0)
        failure = self.factory.fail_io
        if failure is not None:
            raise failure
        if self.closed or self.peer is None or self.peer.closed:
            raise ConnectionLost("transport retry counter exceeded", errno.ETIMEDOUT)
        self.pool.lookup(local)  # local memory must be registered, as with a real lkey
        self.fabric.check(remote, self.peer.factory)
        n = min(len(local), remote.length)
        here = buffer_address(local)
        if read:
            ctypes.memmove(here, remote.addr, n)
            self.fabric.bytes_read += n
        else:
            ctypes.memmove(remote.addr, here, n)
            self.fabric.bytes_written += n
            self.fabric.writes.append(remote)
        return n

    async def read(self, into: memoryview, remote: RemoteBuffer) -> int:
        return await self._op(into, remote, True)

    async def write(self, data: memoryview, remote: RemoteBuffer) -> int:
        return await self._op(data, remote, False)

    def close(self) -> None:
        self.closed = True


class FakeFactory:
    """An EndpointFactory over the fake fabric; ``fail_*`` inject set-up and transfer failures."""

    def __init__(self, fabric: Fabric, *, available: bool = True, slabs: int = 8) -> None:
        self.fabric = fabric
        self.availability = FAKE_DEVICE if available else NO_DEVICE
        self.min_bytes = MIN
        self.pool = BufferPool(fabric.registrar(self), slab_size=SLAB, slabs_per_region=slabs, max_regions=1)
        self.fail_new: str | None = None
        self.fail_connect: str | None = None
        self.fail_io: BaseException | None = None
        self.fail_direct: str | None = None
        self.endpoints: list[FakeEndpoint] = []
        self.direct: list[tuple[int, int, object]] = []  # GPU-memory registrations asked for: (addr, length, dmabuf)

    def register_direct(self, addr: int, length: int, dmabuf: object) -> FakeMR:
        """The protection domain's registration of a caller's GPU memory (here: host memory standing in for it)."""
        self.direct.append((addr, length, dmabuf))
        if self.fail_direct:
            raise RdmaError(f"ibv_reg_mr: {self.fail_direct}", errno.EFAULT)
        rkey = next(self.fabric.rkeys)
        self.fabric.regions[rkey] = (addr, length, self)
        return FakeMR(rkey, self.fabric)

    def detect(self) -> RdmaAvailability:
        return self.availability

    def new_endpoint(self) -> FakeEndpoint:
        if self.fail_new:
            raise RdmaError(f"ibv_create_qp: {self.fail_new}", errno.ENOMEM)
        endpoint = FakeEndpoint(self)
        self.endpoints.append(endpoint)
        return endpoint


class Calls:
    def __init__(self) -> None:
        self.count = 0
        self.sizes: list[int] = []

    async def handler(self, req: Req, data: memoryview | None, ctx) -> object:
        self.count += 1
        n = 0 if data is None else len(data)
        self.sizes.append(n)
        if data is not None:
            assert isinstance(data.obj, bytearray)  # the handler owns its buffer, as over TCP
        if req.want == -1:
            if data is None:
                return Resp(req.text, 0)
            half = n // 2
            return Resp(req.text, n), [data[:half], data[half:]]
        return Resp(req.text, n), pattern(req.want, seed=3)


async def start_server(nursery, factory=None, **kw) -> tuple[RpcServer, str, Calls]:
    calls = Calls()
    server = RpcServer(TOKEN, limits=Limits(max_data=8 << 20), rdma_factory=factory, **kw)
    server.register(ECHO, calls.handler)
    server.register(ONCE, calls.handler)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{port}", calls


@pytest.fixture
def fabric():
    return Fabric()


# ------------------------------------------------------------------------------------------- mode


def test_resolve_mode(monkeypatch):
    monkeypatch.delenv("KVFS_TRANSPORT", raising=False)
    assert resolve_mode(None) is TransportMode.AUTO
    assert resolve_mode("TCP") is TransportMode.TCP
    monkeypatch.setenv("KVFS_TRANSPORT", "rdma")
    assert resolve_mode(None) is TransportMode.RDMA
    assert resolve_mode("tcp") is TransportMode.TCP  # an explicit argument wins over the environment
    monkeypatch.setenv("KVFS_TRANSPORT", "infiniband")
    with pytest.raises(KvfsError) as info:
        resolve_mode(None)
    assert info.value.errno == errno.EINVAL and "KVFS_TRANSPORT" in info.value.message


def test_config_transport_field(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFS_TRANSPORT", raising=False)
    assert ClusterConfig().transport == "auto"
    path = tmp_path / "c.toml"
    path.write_text('transport = "tcp"\n')
    config = load_config(path)
    assert config.transport == "tcp" and config.resolved_transport() == "tcp"
    monkeypatch.setenv("KVFS_TRANSPORT", "auto")
    assert config.resolved_transport() == "auto"  # the environment overrides the file
    path.write_text('transport = "carrier-pigeon"\n')
    with pytest.raises(KvfsError, match="invalid config"):
        load_config(path)


def test_config_forced_rdma_without_device_is_a_start_up_error(monkeypatch):
    monkeypatch.setattr(link, "_default", link.VerbsFactory(detect=lambda: NO_DEVICE))
    monkeypatch.setenv("KVFS_TRANSPORT", "rdma")
    with pytest.raises(RdmaUnavailable) as info:
        ClusterConfig().resolved_transport()
    assert info.value.errno == errno.ENODEV and "no RDMA devices found" in info.value.message


def test_forced_rdma_without_device_fails_in_the_constructors(fabric):
    factory = FakeFactory(fabric, available=False)
    for make in (RpcClient, RpcServer):
        with pytest.raises(RdmaUnavailable, match="forced.*no RDMA devices found"):
            make(TOKEN, transport="rdma", rdma_factory=factory)
    RpcServer(TOKEN, transport="tcp", rdma_factory=factory)  # tcp and auto never need a device
    RpcClient(TOKEN, transport="auto", rdma_factory=factory)


def test_kvfs_chunkserver_forced_rdma_is_a_one_line_error(tmp_path):
    detected = detect_rdma()
    if detected.available:  # pragma: no cover
        pytest.skip("this host has RDMA, so forcing it is not an error")
    config = tmp_path / "c.toml"
    config.write_text('token = "t"\nmgmtd = ["127.0.0.1:1"]\n')
    env = dict(os.environ, KVFS_TRANSPORT="rdma")
    proc = subprocess.run(
        [sys.executable, "-m", "kvfs", "chunkserver", "--config", str(config), "--node-id", "1",
         "--target", str(tmp_path / "t0"), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "transport 'rdma' is forced" in lines[0] and detected.reason.split(" (")[0] in lines[0]


# ------------------------------------------------------------------------------------ descriptors


buffers = st.one_of(
    st.none(),
    st.builds(RemoteBuffer, st.integers(0, 2**63), st.integers(0, 2**32 - 1), st.integers(1, 8 << 20)),
)


@given(src=buffers, dst=buffers, body=st.binary(max_size=64))
def test_request_trailer_round_trip(src, dst, body):
    if src is None and dst is None:
        with pytest.raises(ValueError):
            link.encode_request_trailer(src, dst)
        return
    raw = body + link.encode_request_trailer(src, dst)
    assert link.split_request(raw, 8 << 20) == (body, src, dst)
    assert link.split_request(memoryview(raw), 8 << 20)[1:] == (src, dst)


@pytest.mark.parametrize(
    "trailer, match",
    [
        (b"\x00" * 5, "shorter than its trailer"),
        (link.REQUEST_TRAILER.pack(0, 0, 0, 0, 0, 0), "names no buffer"),
        (link.REQUEST_TRAILER.pack(0x1000, 1, 9 << 20, 0, 0, 0), "exceeds the limit"),
        (link.REQUEST_TRAILER.pack(0, 0, 0, 0x1000, 1, 0), "address but no length"),
        (link.REQUEST_TRAILER.pack(2**64 - 10, 1, 100, 0, 0, 0), "wraps"),
    ],
)
def test_malformed_request_trailer_is_a_protocol_error(trailer, match):
    with pytest.raises(ProtocolError, match=match):
        link.split_request(trailer, 8 << 20)


def test_response_trailer():
    raw = b"body" + link.encode_response_trailer(4096)
    assert link.split_response(raw, 4096) == (b"body", 4096)
    with pytest.raises(ProtocolError, match="claims"):
        link.split_response(raw, 4095)
    with pytest.raises(ProtocolError):
        link.split_response(b"abc", 10)


def test_wire_accepts_the_rdma_flag_and_no_unknown_one():
    frame = wire.encode_frame(wire.FrameType.REQUEST, 1, 1, b"x", 0, wire.Flags.RDMA)
    assert wire.decode_header(frame[: wire.HEADER_SIZE], Limits()).flags == wire.Flags.RDMA
    bad = bytearray(frame)
    bad[6] = 64  # the first bit no flag uses
    with pytest.raises(ProtocolError, match="unknown flags"):
        wire.decode_header(bytes(bad[: wire.HEADER_SIZE]), Limits())


# --------------------------------------------------------------------------------- path decision


@pytest.mark.parametrize(
    "ready, data_len, into_len, expected",
    [
        (False, 1 << 20, 1 << 20, CallPlan(False, False)),  # no link: everything on TCP
        (True, 0, None, CallPlan(False, False)),  # a plain control call
        (True, MIN - 1, MIN - 1, CallPlan(False, False)),  # small sections stay inline
        (True, MIN, None, CallPlan(True, False)),
        (True, SLAB, None, CallPlan(True, False)),
        (True, SLAB + 1, None, CallPlan(False, False)),  # does not fit a slab
        (True, 0, MIN, CallPlan(False, True)),
        (True, 0, 10 * SLAB, CallPlan(False, True)),  # offered a slab's worth; larger answers come over TCP
        (True, SLAB, SLAB, CallPlan(True, True)),
    ],
)
def test_plan_call(ready, data_len, into_len, expected):
    assert plan_call(ready, data_len, into_len, min_bytes=MIN, max_bytes=SLAB) == expected


# ----------------------------------------------------------------- handshake on a real TCP pair


async def test_no_local_device_means_no_handshake_and_plain_tcp_bytes(monkeypatch):
    """Without RDMA here, the client never offers and its frames are exactly the TCP frames of before."""
    monkeypatch.delenv("KVFS_TRANSPORT", raising=False)
    got = bytearray()
    keys = []
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    payload = pattern(100_000)

    async def serve_raw():
        sock, _ = await listener.accept()
        reader = FrameReader(sock)
        keys.append(await authenticate_server(reader, functools.partial(send_all, sock), "client", TOKEN.encode()))
        # the client sends its call only after the server's proof, so the reader holds nothing beyond it
        while len(got) < wire.HEADER_SIZE + 64 + len(payload):
            chunk = await sock.recv(1 << 16)
            if not chunk:
                break
            got.extend(chunk)
        sock.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_raw)
        async with RpcClient(TOKEN, retries=0, rdma_factory=FakeFactory(Fabric(), available=False)) as client:
            with pytest.raises(KvfsError):
                await client.call(address, ONCE, Req("x"), data=payload, timeout=1)
    body = wire.encode_body(Req("x"))
    frame = wire.encode_frame(wire.FrameType.REQUEST, 1, ONCE.id, body, len(payload))
    end = len(frame)
    assert got[:wire.HEADER_SIZE - wire.TAG_SIZE] == frame[:wire.HEADER_SIZE - wire.TAG_SIZE]
    assert got[wire.HEADER_SIZE:end] == body and got[end:] == payload
    assert keys[0].verify(got[:wire.HEADER_SIZE], got[wire.HEADER_SIZE:end])  # the first frame of the connection
    listener.close()


async def test_server_without_rdma_refuses_and_both_stay_on_tcp(nursery, fabric, caplog):
    """This host has no RDMA: a client that (falsely) has a device offers; the real server refuses with the
    detection reason; both ends keep bulk data on TCP and calls work."""
    server, address, calls = await start_server(nursery)  # real detection, auto
    local = detect_rdma()
    if local.available:  # pragma: no cover
        pytest.skip("this host has RDMA")
    caplog.set_level(logging.WARNING)
    async with RpcClient(TOKEN, rdma_factory=FakeFactory(fabric)) as client:
        payload = pattern(200_000)
        resp, data = await client.call_with_data(address, ECHO, Req("a"), data=payload,
                                                 into=memoryview(bytearray(300_000)))
        assert resp.got == len(payload) and bytes(data) == payload
        conn = await client.connection(address)
        assert conn.transport == "tcp"
    assert all(peer.transport == "tcp" for peer in server.peers)
    assert "the server refused RDMA: this server cannot use RDMA" in caplog.text
    assert local.reason in caplog.text
    assert fabric.bytes_read == fabric.bytes_written == 0


async def test_tcp_server_refuses_rdma(nursery, fabric, caplog):
    server, address, _ = await start_server(nursery, FakeFactory(fabric), transport="tcp")
    async with RpcClient(TOKEN, rdma_factory=FakeFactory(fabric)) as client:
        assert (await client.call(address, ECHO, Req("a"))).text == "a"
        assert (await client.connection(address)).transport == "tcp"
    assert "this server's transport is 'tcp'" in caplog.text


async def test_tcp_client_never_offers(nursery, fabric):
    server, address, calls = await start_server(nursery, FakeFactory(fabric))
    async with RpcClient(TOKEN, transport="tcp", rdma_factory=FakeFactory(fabric)) as client:
        await client.call(address, ECHO, Req("a"), data=pattern(SLAB))
    assert fabric.endpoints == {} and calls.count == 1


async def test_server_that_predates_rdma(nursery, fabric, caplog):
    server, address, _ = await start_server(nursery, FakeFactory(fabric))

    async def old(offer, data, ctx):
        raise KvfsError("unknown method id 7001", errno.ENOSYS)

    server._handlers[RDMA_CONNECT.id] = (RDMA_CONNECT, old)
    async with RpcClient(TOKEN, rdma_factory=FakeFactory(fabric)) as client:
        assert (await client.call(address, ECHO, Req("a"))).text == "a"
        assert (await client.connection(address)).transport == "tcp"
    assert "RDMA handshake failed: unknown method id 7001" in caplog.text


async def test_forced_client_against_a_refusing_server_is_an_error(nursery, fabric):
    server, address, _ = await start_server(nursery, FakeFactory(fabric), transport="tcp")
    async with RpcClient(TOKEN, transport="rdma", rdma_factory=FakeFactory(fabric)) as client:
        with pytest.raises(RdmaUnavailable) as info:
            await client.call(address, ECHO, Req("a"))
        assert info.value.errno == errno.EOPNOTSUPP and "this server's transport is 'tcp'" in info.value.message
        assert client._connections == {}


# ------------------------------------------------------------------------- the RDMA data path


async def rdma_pair(nursery, fabric):
    server_factory = FakeFactory(fabric)
    server, address, calls = await start_server(nursery, server_factory)
    client_factory = FakeFactory(fabric)
    return server, address, calls, server_factory, client_factory


async def test_a_recorded_rdma_setup_replayed_on_another_connection_is_refused(nursery, fabric, caplog):
    """RDMA_CONNECT and the descriptors of RDMA calls travel as tagged frames of their connection: recorded and
    replayed on another connection (by a token holder, after a handshake of its own), the offer is refused before
    any queue pair is made for it, and the call does not run."""
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    proxy = RecordingProxy(address)
    via_proxy = await nursery.start(proxy.serve)
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        assert (await client.connection(via_proxy)).transport == "rdma"
        await client.call(via_proxy, ONCE, Req("once"), data=pattern(50_000))
    recorded = [raw for header, raw in frames(proxy.recorded[0]) if header.method in (RDMA_CONNECT.id, ONCE.id)]
    assert len(recorded) == 2 and calls.count == 1
    endpoints = len(fabric.endpoints)
    sock, _ = await authenticated(address, TOKEN)
    await send_until_closed(sock, b"".join(recorded))
    assert "does not match this connection's key and sequence" in caplog.text
    assert calls.count == 1 and len(fabric.endpoints) == endpoints


async def test_bulk_data_moves_by_rdma_both_ways(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        conn = await client.connection(address)
        assert conn.transport == "rdma"
        assert [p.transport for p in server.peers] == ["rdma"]

        payload = pattern(50_000, seed=1)
        into = memoryview(bytearray(60_000))
        resp, data = await client.call_with_data(address, ECHO, Req("both"), data=payload, into=into)
        assert resp == Resp("both", len(payload)) and bytes(data) == payload
        assert data.obj is into.obj  # landed in the caller's buffer
        assert fabric.bytes_read == len(payload) and fabric.bytes_written == len(payload)

        # request data only (no into): pulled by RDMA, the echo comes back over TCP
        resp, data = await client.call_with_data(address, ECHO, Req("put"), data=payload)
        assert bytes(data) == payload and fabric.bytes_read == 2 * len(payload)
        assert fabric.bytes_written == len(payload)

        # response larger than the offered destination: TCP for that answer
        small = memoryview(bytearray(MIN))
        resp, data = await client.call_with_data(address, ECHO, Req("get", want=5000), into=small)
        assert bytes(data) == pattern(5000, seed=3) and data.obj is not small.obj

        # small calls never touch the fabric
        before = (fabric.bytes_read, fabric.bytes_written)
        assert (await client.call(address, ECHO, Req("tiny"), data=b"abc")).got == 3
        assert (fabric.bytes_read, fabric.bytes_written) == before
    assert cf.pool.in_use == 0 and sf.pool.in_use == 0


async def test_many_concurrent_calls_more_than_slabs(nursery, fabric):
    """More calls in flight than slabs: the ones without a slab go over TCP; every answer is right."""
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    results = {}
    async with RpcClient(TOKEN, rdma_factory=cf) as client:

        async def one(i: int) -> None:
            payload = pattern(MIN + i * 97, seed=i)
            into = memoryview(bytearray(len(payload)))
            resp, data = await client.call_with_data(address, ECHO, Req(str(i)), data=payload, into=into)
            results[i] = bytes(data) == payload and resp.got == len(payload)

        async with trio.open_nursery() as inner:
            for i in range(200):
                inner.start_soon(one, i)
        assert (await client.connection(address)).transport == "rdma"
    assert len(results) == 200 and all(results.values())
    assert fabric.bytes_read > 0 and calls.count == 200
    assert cf.pool.in_use == 0 and sf.pool.in_use == 0


@pytest.mark.parametrize("side", ["client new_endpoint", "server new_endpoint", "client connect",
                                  "server connect"])
async def test_set_up_failure_falls_back_to_tcp_with_the_reason(nursery, fabric, caplog, side):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    factory = cf if side.startswith("client") else sf
    if side.endswith("new_endpoint"):
        factory.fail_new = "out of QPs"
    else:
        factory.fail_connect = "bad path"
    caplog.set_level(logging.WARNING)
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        payload = pattern(SLAB)
        resp, data = await client.call_with_data(address, ONCE, Req("x"), data=payload)
        assert bytes(data) == payload
        assert (await client.connection(address)).transport == "tcp"
    reason = "out of QPs" if side.endswith("new_endpoint") else "bad path"
    assert "over TCP" in caplog.text and reason in caplog.text
    assert fabric.bytes_read == 0 and calls.count == 1
    assert all(e.closed or e.peer is None for e in cf.endpoints)  # a failed client endpoint is not left open


async def test_failed_rdma_read_resends_over_tcp_and_runs_the_handler_once(nursery, fabric, caplog):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        conn = await client.connection(address)
        sf.fail_io = RdmaError("remote access error", errno.EACCES)
        payload = pattern(SLAB, seed=5)
        resp, data = await client.call_with_data(address, ONCE, Req("x"), data=payload)  # not idempotent
        assert bytes(data) == payload and calls.count == 1
        assert conn.transport == "tcp" and not conn.closed
        assert all(p.transport == "tcp" for p in server.peers)
        sf.fail_io = None
        resp, data = await client.call_with_data(address, ONCE, Req("y"), data=payload)
        assert bytes(data) == payload and calls.count == 2 and fabric.bytes_read == 0
    assert "over TCP from now on" in caplog.text
    assert cf.pool.in_use == 0 and sf.pool.in_use == 0


async def test_failed_rdma_write_answers_over_tcp_then_the_client_follows(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        conn = await client.connection(address)
        sf.fail_io = ConnectionLost("transport retry counter exceeded", errno.ETIMEDOUT)
        into = memoryview(bytearray(SLAB))
        resp, data = await client.call_with_data(address, ECHO, Req("g", want=SLAB), into=into)
        assert bytes(data) == pattern(SLAB, seed=3) and data.obj is into.obj
        assert all(p.transport == "tcp" for p in server.peers)
        sf.fail_io = None
        # the server's link is gone; the next pull is refused (ENOTCONN) and the client leaves RDMA too
        payload = pattern(SLAB, seed=9)
        resp, data = await client.call_with_data(address, ONCE, Req("p"), data=payload)
        assert bytes(data) == payload and conn.transport == "tcp"
    assert calls.count == 2 and cf.pool.in_use == 0 and sf.pool.in_use == 0


async def test_server_pool_exhaustion_is_per_call(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    async with RpcClient(TOKEN, rdma_factory=cf) as client:
        conn = await client.connection(address)
        hog = [sf.pool.acquire() for _ in range(sf.pool.capacity)]
        payload = pattern(SLAB)
        resp, data = await client.call_with_data(address, ONCE, Req("x"), data=payload)
        assert bytes(data) == payload and calls.count == 1
        assert conn.transport == "rdma"  # a full pool is not a broken link
        for slab in hog:
            slab.release()
        read_before = fabric.bytes_read
        await client.call_with_data(address, ONCE, Req("y"), data=payload)
        assert fabric.bytes_read == read_before + SLAB


async def test_forced_rdma_transfer_failure_fails_the_call_and_the_connection(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    async with RpcClient(TOKEN, transport="rdma", rdma_factory=cf) as client:
        conn = await client.connection(address)
        assert conn.transport == "rdma"
        sf.fail_io = RdmaError("remote access error", errno.EACCES)
        with pytest.raises(RdmaError, match="forced"):
            await client.call_with_data(address, ONCE, Req("x"), data=pattern(SLAB))
        assert conn.closed and calls.count == 0
        sf.fail_io = None
        resp, data = await client.call_with_data(address, ONCE, Req("y"), data=pattern(SLAB))  # fresh handshake
        assert (await client.connection(address)).transport == "rdma" and calls.count == 1


async def test_slabs_of_a_call_given_up_are_held_until_its_late_answer(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    gate = trio.Event()

    async def slow(req, data, ctx):
        await gate.wait()
        return Resp("late", len(data)), data

    server.register(Method(9103, "test.rdma_slow", Req, Resp), slow)
    slow_method = Method.registry[9103]
    async with RpcClient(TOKEN, rdma_factory=cf, retries=0) as client:
        conn = await client.connection(address)
        with pytest.raises(KvfsError):
            await client.call_with_data(address, slow_method, Req(), data=pattern(SLAB),
                                        into=memoryview(bytearray(SLAB)), timeout=0.2)
        assert cf.pool.in_use == 2  # the server may still read one slab and write the other
        gate.set()
        with trio.fail_after(5):
            while cf.pool.in_use:
                await trio.sleep(0.01)
        assert not conn.closed
    assert sf.pool.in_use == 0


async def test_closing_the_connection_releases_held_slabs(nursery, fabric):
    server, address, calls, sf, cf = await rdma_pair(nursery, fabric)
    gate = trio.Event()

    async def stuck(req, data, ctx):
        await gate.wait()
        return Resp("never", 0)

    server.register(Method(9104, "test.rdma_stuck", Req, Resp), stuck)
    async with RpcClient(TOKEN, rdma_factory=cf, retries=0) as client:
        conn = await client.connection(address)
        failures = []

        async def caller():
            try:
                await client.call_with_data(address, Method.registry[9104], Req(), into=memoryview(bytearray(SLAB)))
            except ConnectionLost as exc:
                failures.append(exc)

        async with trio.open_nursery() as inner:
            inner.start_soon(caller)
            with trio.fail_after(5):
                while not cf.pool.in_use:
                    await trio.sleep(0.01)
            conn.close()
        assert len(failures) == 1
    with trio.fail_after(5):
        while cf.pool.in_use:
            await trio.sleep(0.01)
    assert all(e.closed for e in cf.endpoints)
    gate.set()


# ------------------------------------------------------------------------------- real hardware

_DETECTED = detect_rdma()


@pytest.mark.skipif(not _DETECTED.available, reason=f"no RDMA device: {_DETECTED.reason}")
class TestRpcOverRealDevice:
    """A real RpcServer/RpcClient pair on loopback with the verbs factory (needs a device with an active port)."""

    async def test_bulk_data_over_rdma(self, nursery):
        server = RpcServer(TOKEN, limits=Limits(max_data=8 << 20), transport="rdma")
        calls = Calls()
        server.register(ECHO, calls.handler)
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        address = f"127.0.0.1:{port}"
        async with RpcClient(TOKEN, transport="rdma") as client:
            payload = pattern(1 << 20, seed=11)
            into = memoryview(bytearray(1 << 20))
            resp, data = await client.call_with_data(address, ECHO, Req("hw"), data=payload, into=into)
            assert bytes(data) == payload and resp.got == len(payload)
            assert (await client.connection(address)).transport == "rdma"
            assert [p.transport for p in server.peers] == ["rdma"]
