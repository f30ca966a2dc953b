"""Same-host bulk data through shared memory (kvfs.transport.shm): the arena, the handshake's checks, lent calls
and one-way sends between a real RpcServer and RpcClient, and a server that survives every malformed use of it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import sys

import msgspec
import prometheus_client
import pytest
import trio

from kvfs import wire
from kvfs.errors import KvfsError, ProtocolError
from kvfs.pool import BufferPool
from kvfs.rpc import RpcClient, RpcServer
from kvfs.transport import shm
from kvfs.wire import Limits, Method

from harness import RecordingProxy, authenticated, frames, send_until_closed

TOKEN = "tok"
MIB = 1 << 20


class Req(msgspec.Struct, array_like=True):
    text: str = ""


class Resp(msgspec.Struct, array_like=True):
    got: int
    sample: bytes


LENT = Method(9111, "test.shm_lent", Req, Resp)
ONEWAY = Method(9112, "test.shm_oneway", Req, Resp)


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 13 + seed) & 0xFF for i in range(n))


def shm_bytes() -> float:
    return prometheus_client.REGISTRY.get_sample_value("kvfs_shm_bytes_total") or 0.0


@pytest.fixture
def arena():
    a = shm.Arena(capacity=64 * MIB)
    yield a
    os.close(a.fd)


@pytest.fixture
def shared():
    """Lent buffers in this process's arena, as the mount's write buffers are."""
    return BufferPool(capacity=64 * MIB, allocate=shm.PROCESS_ARENA.allocate)


# -------------------------------------------------------------------------------------------- the arena


def test_arena_buffers_are_found_by_address_and_nothing_else_is(arena):
    a, b = arena.allocate(MIB), arena.allocate(3 * 4096 + 1)  # rounded up to whole pages
    assert len(a) == MIB and len(b) == 4 * 4096
    assert arena.locate(memoryview(memoryview(a)[7:])[-10:]) == mmap.PAGESIZE + MIB - 10  # a view of a view
    assert arena.locate(a) == mmap.PAGESIZE  # the first page holds the header
    assert arena.locate(memoryview(a)[100:200]) == mmap.PAGESIZE + 100
    assert arena.locate(memoryview(b)[5:].cast("B")) == mmap.PAGESIZE + MIB + 5
    assert arena.locate(bytearray(MIB)) is None  # ordinary memory
    assert arena.locate(b"read-only bytes") is None
    assert arena.locate(object()) is None
    assert arena.allocate(64 * MIB) is None  # used up: the pool falls back to a bytearray
    assert fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK  # no client can shrink it under a server


def test_a_pool_over_the_arena_reuses_free_buffers_and_falls_back_to_bytearray(arena):
    pool = BufferPool(capacity=2 * MIB, allocate=arena.allocate)
    first = pool.take(MIB)
    assert isinstance(first, mmap.mmap) and arena.locate(first) is not None
    first_id, view = id(first), memoryview(first)[10:]
    del first
    assert id(pool.take(MIB)) != first_id  # a view keeps its buffer taken
    del view
    assert id(pool.take(MIB)) == first_id  # free again: reused
    held = [pool.take(MIB) for _ in range(3)]  # beyond the capacity: plain memory, not kept
    assert sum(isinstance(b, bytearray) for b in held) == 1
    assert isinstance(pool.take(MIB + 1), bytearray)  # sizes the pool does not keep


# ----------------------------------------------------------------------------------------- the handshake


def test_a_server_maps_an_offered_arena_and_copies_out_of_it(arena):
    buf = arena.allocate(MIB)
    buf[:5] = b"hello"
    peer = shm.PeerArena(arena.offer())
    try:
        out = bytearray(5)
        peer.copy_out(arena.locate(buf), memoryview(out))
        assert out == b"hello"
        with pytest.raises(ProtocolError, match="outside"):
            peer.copy_out(0, memoryview(bytearray(16)))  # the header page is never data
        with pytest.raises(ProtocolError, match="outside"):
            peer.copy_out(arena.capacity - 8, memoryview(bytearray(16)))
    finally:
        peer.close()
    with pytest.raises(ProtocolError, match="unmapped"):
        peer.copy_out(mmap.PAGESIZE, memoryview(bytearray(1)))


@pytest.mark.parametrize("change, reason", [
    (dict(boot_id="another-host"), "another host"),
    (dict(pid=2**31 - 1), "cannot open"),
    (dict(fd=2**31 - 1), "cannot open"),
    (dict(nonce=bytes(16)), "not the client's arena"),
    (dict(size=32 * MIB), "not the size it offered"),
])
def test_a_server_refuses_an_offer_it_cannot_verify(arena, change, reason):
    with pytest.raises(shm.ShmRefused, match=reason):
        shm.PeerArena(msgspec.structs.replace(arena.offer(), **change))


def test_a_server_refuses_a_descriptor_that_is_not_a_sealed_memfd(arena, tmp_path):
    with open(tmp_path / "plain", "wb") as f:
        f.truncate(64 * MIB)
        with pytest.raises(shm.ShmRefused, match="not a sealed memfd"):
            shm.PeerArena(msgspec.structs.replace(arena.offer(), fd=f.fileno()))
    fd = os.memfd_create("unsealed")  # a client that could shrink it under the server's mapping
    try:
        os.ftruncate(fd, 64 * MIB)
        with pytest.raises(shm.ShmRefused, match="not sealed"):
            shm.PeerArena(msgspec.structs.replace(arena.offer(), fd=fd))
    finally:
        os.close(fd)


def test_resolve_enabled(monkeypatch):
    monkeypatch.delenv(shm.ENV_SHM, raising=False)
    assert shm.resolve_enabled(None) and not shm.resolve_enabled(False)
    for off in ("0", "off", "false", "No"):
        monkeypatch.setenv(shm.ENV_SHM, off)
        assert not shm.resolve_enabled(None) and shm.resolve_enabled(True)
    monkeypatch.setenv(shm.ENV_SHM, "1")
    assert shm.resolve_enabled(None)


def test_config_field_and_its_environment_override(monkeypatch):
    from kvfs.config import ClusterConfig

    monkeypatch.delenv(shm.ENV_SHM, raising=False)
    assert ClusterConfig().resolved_shared_memory() and not ClusterConfig(shared_memory=False).resolved_shared_memory()
    monkeypatch.setenv(shm.ENV_SHM, "0")
    assert not ClusterConfig().resolved_shared_memory()


# ------------------------------------------------------------------------------- lent data through RPC


class Received:
    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.arrived = trio.Event()

    async def handler(self, req: Req, data: memoryview | None, ctx) -> Resp:
        got = b"" if data is None else bytes(data)
        self.data.append(got)
        self.arrived.set()
        return Resp(len(got), got[:8])


async def start_server(nursery, **kw) -> tuple[RpcServer, str, Received]:
    received = Received()
    server = RpcServer(TOKEN, limits=Limits(max_data=8 * MIB), **kw)
    server.register(LENT, received.handler)
    server.register(ONEWAY, received.handler)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{port}", received


async def test_lent_data_goes_through_shared_memory_both_for_calls_and_one_way_sends(nursery, shared):
    server, address, received = await start_server(nursery, shared_memory=True)
    buf = shared.take(4 * MIB)
    memoryview(buf)[:] = pattern(4 * MIB)
    before = shm_bytes()
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB), shared_memory=True) as client:
        resp = await client.call(address, LENT, Req(), data=memoryview(buf)[MIB:], lend=True)
        assert resp.got == 3 * MIB and received.data[-1] == pattern(4 * MIB)[MIB:]
        assert (await client.connection(address)).shared_memory
        received.arrived = trio.Event()
        await client.send(address, ONEWAY, Req(), data=memoryview(buf)[:MIB], lend=True)
        await received.arrived.wait()
        assert received.data[-1] == pattern(MIB)
    assert shm_bytes() - before == 4 * MIB  # none of it went over TCP
    assert [p.shared_memory for p in server.peers] in ([True], [])


async def test_pieces_back_to_back_in_the_arena_go_as_one_shared_section(nursery, shared):
    """A batch's values copied into one buffer, or a forward of one received section's pieces: one trailer names
    them all. Pieces out of order, or with a gap, go over TCP, byte for byte."""
    server, address, received = await start_server(nursery, shared_memory=True)
    buf = shared.take(4 * MIB)
    view = memoryview(buf)
    view[:] = pattern(4 * MIB)
    before = shm_bytes()
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB), shared_memory=True) as client:
        await client.call(address, LENT, Req(), data=[view[:MIB], view[MIB:MIB + 5], view[MIB + 5:3 * MIB]], lend=True)
        assert received.data[-1] == pattern(3 * MIB) and shm_bytes() - before == 3 * MIB
        await client.call(address, LENT, Req(), data=[view[MIB:2 * MIB], view[:MIB]], lend=True)  # out of order
        await client.call(address, LENT, Req(), data=[view[:MIB], view[MIB + 1:2 * MIB]], lend=True)  # a gap
    assert shm_bytes() - before == 3 * MIB
    assert received.data[1:] == [pattern(2 * MIB)[MIB:] + pattern(MIB), pattern(MIB) + pattern(2 * MIB)[MIB + 1:]]


def test_contiguous_offset(arena):
    a = memoryview(arena.allocate(MIB))
    b = memoryview(arena.allocate(MIB))  # the next buffer of the arena starts where ``a`` ends
    assert shm.contiguous_offset(arena, [a[:10], a[10:], b[:3]]) == mmap.PAGESIZE
    assert shm.contiguous_offset(arena, [a[10:20]]) == mmap.PAGESIZE + 10
    assert shm.contiguous_offset(arena, [a[:10], a[11:20]]) is None
    assert shm.contiguous_offset(arena, [a[:10], bytearray(10)]) is None
    assert shm.contiguous_offset(arena, [bytearray(10), a[:10]]) is None


async def test_unlent_small_or_foreign_data_stays_on_tcp(nursery, shared):
    server, address, received = await start_server(nursery, shared_memory=True)
    buf = shared.take(MIB)
    memoryview(buf)[:] = pattern(MIB)
    before = shm_bytes()
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB), shared_memory=True) as client:
        await client.call(address, LENT, Req(), data=memoryview(buf))  # not lent
        await client.call(address, LENT, Req(), data=memoryview(buf)[: shm.SHM_MIN_BYTES - 1], lend=True)
        await client.call(address, LENT, Req(), data=pattern(MIB), lend=True)  # not in the arena
        await client.call(address, LENT, Req(), data=[memoryview(buf)] * 2, lend=True)  # two pieces
        assert not (await client.connection(address)).shared_memory  # nothing needed the handshake yet
    assert shm_bytes() == before
    assert received.data == [pattern(MIB), pattern(MIB)[: shm.SHM_MIN_BYTES - 1], pattern(MIB), pattern(MIB) * 2]


@pytest.mark.parametrize("server_on, client_on", [(False, True), (True, False)])
async def test_either_side_turned_off_keeps_lent_data_on_tcp(nursery, shared, caplog, server_on, client_on):
    caplog.set_level(logging.INFO)
    server, address, received = await start_server(nursery, shared_memory=server_on)
    buf = shared.take(MIB)
    memoryview(buf)[:] = pattern(MIB, 5)
    before = shm_bytes()
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB), shared_memory=client_on) as client:
        for _ in range(2):
            assert (await client.call(address, LENT, Req(), data=memoryview(buf), lend=True)).got == MIB
        assert not (await client.connection(address)).shared_memory
    assert shm_bytes() == before and received.data == [pattern(MIB, 5)] * 2
    if client_on:
        assert "over TCP: shared memory is off on this server" in caplog.text
        assert caplog.text.count("shared memory is off") == 1  # asked once per connection


async def test_a_server_that_predates_shared_memory(nursery, shared, caplog):
    caplog.set_level(logging.INFO)
    server, address, received = await start_server(nursery)

    async def old(offer, data, ctx):
        raise KvfsError("unknown method id 7002", errno.ENOSYS)

    server._handlers[shm.SHM_CONNECT.id] = (shm.SHM_CONNECT, old)
    buf = shared.take(MIB)
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB)) as client:
        assert (await client.call(address, LENT, Req(), data=memoryview(buf), lend=True)).got == MIB
        assert not (await client.connection(address)).shared_memory
    assert "unknown method id 7002" in caplog.text


async def test_concurrent_first_lent_calls_ask_once(nursery, shared):
    server, address, received = await start_server(nursery)
    asked = 0
    builtin = server._shm_connect

    async def counting(offer, data, ctx):
        nonlocal asked
        asked += 1
        await trio.sleep(0.05)
        return await builtin(offer, data, ctx)

    server._handlers[shm.SHM_CONNECT.id] = (shm.SHM_CONNECT, counting)
    bufs = [shared.take(MIB) for _ in range(8)]
    for i, b in enumerate(bufs):
        memoryview(b)[:] = pattern(MIB, i)
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB)) as client, trio.open_nursery() as calls:
        for b in bufs:
            calls.start_soon(lambda b=b: client.call(address, LENT, Req(), data=memoryview(b), lend=True))
    assert asked == 1 and sorted(received.data) == sorted(pattern(MIB, i) for i in range(8))


# ---------------------------------------------------------------------------- malformed shared-memory frames


async def raw_frames(address: str, frames: list[bytes]) -> bytes:
    """Send raw frames, sealed in turn, on a fresh authenticated connection; what the server answered after the
    handshake, before closing the connection."""
    sock, signer = await authenticated(address, TOKEN)
    for frame in frames:
        await sock.send(signer.seal(frame))
    got = b""
    with trio.move_on_after(5):
        while chunk := await sock.recv(1 << 16):
            got += chunk
    sock.close()
    return got


def request(body: bytes, data_len: int = 0, flags=wire.Flags.SHM, request_id: int = 1, method: Method = LENT) -> bytes:
    return wire.encode_frame(wire.FrameType.REQUEST, request_id, method.id, body, data_len, flags)


@pytest.mark.parametrize("frame, reason", [
    (request(wire.encode_body(Req()) + shm.encode_trailer(mmap.PAGESIZE, MIB)), "whose arena is not mapped"),
    (request(b"\x00" * 3), "shorter than its trailer"),
    (request(wire.encode_body(Req()) + shm.encode_trailer(mmap.PAGESIZE, 0)), "data section of 0 bytes"),
    (request(wire.encode_body(Req()) + shm.encode_trailer(mmap.PAGESIZE, 9 * MIB)), "limit"),
    (request(wire.encode_body(Req()) + shm.encode_trailer(mmap.PAGESIZE, 10), data_len=10), "also carries"),
    (request(wire.encode_body(Req()) + shm.encode_trailer(mmap.PAGESIZE, 10), flags=wire.Flags.SHM | wire.Flags.RDMA),
     "also carries"),
])
async def test_a_malformed_shared_memory_frame_costs_only_its_connection(nursery, shared, caplog, frame, reason):
    server, address, received = await start_server(nursery)
    assert await raw_frames(address, [frame]) == b""
    assert reason in caplog.text and received.data == []
    buf = shared.take(MIB)
    memoryview(buf)[:] = pattern(MIB, 9)
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB)) as client:  # the server still serves others
        assert (await client.call(address, LENT, Req(), data=memoryview(buf), lend=True)).got == MIB
    assert received.data == [pattern(MIB, 9)]


async def test_a_section_outside_the_mapped_arena_closes_the_connection(nursery, caplog):
    """A client whose arena is mapped names bytes outside it: the connection goes, the server stays."""
    server, address, received = await start_server(nursery)
    arena = shm.PROCESS_ARENA.get()
    assert arena is not None
    offer = request(wire.encode_body(arena.offer()), flags=wire.Flags.NONE, method=shm.SHM_CONNECT)
    outside = request(wire.encode_body(Req()) + shm.encode_trailer(arena.capacity - 10, 20), request_id=2)
    answer = await raw_frames(address, [offer, outside])
    assert answer  # the handshake was answered, then the connection closed
    assert "outside the client's arena" in caplog.text and received.data == []


async def test_a_recorded_shared_memory_setup_replayed_on_another_connection_maps_nothing(nursery, shared, caplog):
    """SHM_CONNECT travels as a tagged frame of its connection: a recording of it and of a lent call, replayed on
    another connection (even by a token holder, after a handshake of its own), is refused before anything runs."""
    server, address, received = await start_server(nursery, shared_memory=True)
    proxy = RecordingProxy(address)
    via_proxy = await nursery.start(proxy.serve)
    buf = shared.take(MIB)
    memoryview(buf)[:] = pattern(MIB, 5)
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB), shared_memory=True) as client:
        assert (await client.call(via_proxy, LENT, Req(), data=memoryview(buf), lend=True)).got == MIB
        assert (await client.connection(via_proxy)).shared_memory
    recorded = [raw for header, raw in frames(proxy.recorded[0]) if header.method in (shm.SHM_CONNECT.id, LENT.id)]
    assert len(recorded) == 2 and len(received.data) == 1
    sock, _ = await authenticated(address, TOKEN)
    await send_until_closed(sock, b"".join(recorded))
    assert "does not match this connection's key and sequence" in caplog.text
    assert len(received.data) == 1 and not any(peer.shared_memory for peer in server.peers)


# --------------------------------------------------------------------------------------- another process


CHILD = """
import sys, trio
sys.path.insert(0, {tests!r})
from test_transport_shm import LENT, Req, TOKEN, pattern
from kvfs.rpc import RpcClient
from kvfs.transport import shm
from kvfs.wire import Limits

async def main():
    buf = shm.SHARED.take(1 << 20)
    memoryview(buf)[:] = pattern(1 << 20, 7)
    async with RpcClient(TOKEN, limits=Limits(max_data=8 << 20)) as client:
        resp = await client.call({address!r}, LENT, Req(), data=memoryview(buf), lend=True)
        print(resp.got, (await client.connection({address!r})).shared_memory)

trio.run(main)
"""


async def test_a_client_in_another_process_lends_through_its_own_arena(nursery):
    server, address, received = await start_server(nursery)
    before = shm_bytes()
    code = CHILD.format(tests=os.path.dirname(__file__), address=address)
    result = await trio.run_process([sys.executable, "-c", code], capture_stdout=True, capture_stderr=True,
                                    check=False)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.split() == [str(MIB).encode(), b"True"]
    assert received.data == [pattern(MIB, 7)] and shm_bytes() - before == MIB


def test_idle_shared_buffers_give_their_pages_back_and_stay_usable(arena):
    pool = BufferPool(capacity=8 * MIB, allocate=arena.allocate)
    busy, idle = pool.take(4 * MIB), pool.take(4 * MIB)
    memoryview(busy)[:] = memoryview(idle)[:] = b"x" * (4 * MIB)
    idle_id = id(idle)
    del idle
    assert pool.trim(idle=3600) == 0  # taken from a moment ago
    assert pool.trim(idle=0) == 4 * MIB  # only the buffer nothing refers to
    assert pool.trim(idle=0) == 0  # nothing taken since
    assert bytes(busy[:1]) == b"x"
    again = pool.take(4 * MIB)
    assert id(again) == idle_id and again[:4] == bytes(4)  # its pages came back as zeros
    assert isinstance(BufferPool().take(MIB), bytearray) and BufferPool().trim(idle=0) == 0


# ------------------------------------------------------------------- answers' data through shared memory

READ = Method(9113, "test.shm_read", Req, Resp, idempotent=True)


async def start_reader(nursery, payload: bytes | memoryview, *, delay: float = 0.0, arrived: trio.Event | None = None,
                       **kw) -> tuple[RpcServer, str]:
    """A server whose READ answers with ``payload`` as its data section (after ``delay`` seconds; ``arrived`` is set
    when a READ comes in)."""
    server = RpcServer(TOKEN, limits=Limits(max_data=8 * MIB), **kw)

    async def read(req: Req, data, ctx):
        if arrived is not None:
            arrived.set()
        await trio.sleep(delay)
        return Resp(len(payload), b""), payload

    server.register(READ, read)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{port}"


async def test_answers_data_is_written_into_the_clients_arena(nursery):
    payload = pattern(3 * MIB + 5, 7)  # bytes: a read-only source, as a loan of a mapped slot file is
    server, address = await start_reader(nursery, payload, shared_memory=True)
    before = shm_bytes()
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB), shared_memory=True) as client:
        into = memoryview(bytearray(4 * MIB))
        resp, data = await client.call_with_data(address, READ, Req(), into=into)
        assert resp.got == len(payload) and bytes(data) == payload and data.obj is into.obj  # in the caller's buffer
        assert shm_bytes() - before == len(payload)  # none of it over TCP
        small = memoryview(bytearray(shm.SHM_MIN_BYTES - 1))  # too small to be worth it: TCP
        _, data = await client.call_with_data(address, READ, Req(), into=small)
        assert bytes(data) == payload
        assert shm_bytes() - before == len(payload)


async def test_a_server_that_writes_no_answers_into_arenas_answers_over_tcp(nursery):
    payload = pattern(MIB, 8)
    server, address = await start_reader(nursery, payload, shared_memory=True)

    async def older(offer, data, ctx):  # a server from before SHM_REPLY: maps the arena, answers without `replies`
        accept = await server._shm_connect(offer, data, ctx)
        return shm.ShmAccept(accept.accepted, accept.reason)

    server._handlers[shm.SHM_CONNECT.id] = (shm.SHM_CONNECT, older)
    before = shm_bytes()
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB), shared_memory=True) as client:
        _, data = await client.call_with_data(address, READ, Req(), into=memoryview(bytearray(MIB)))
        assert bytes(data) == payload
    assert shm_bytes() == before


async def test_a_given_up_calls_arena_buffer_stays_out_of_use_until_its_late_answer(nursery):
    payload = pattern(MIB, 9)
    arrived = trio.Event()
    server, address = await start_reader(nursery, payload, delay=0.3, arrived=arrived, shared_memory=True)
    async with RpcClient(TOKEN, limits=Limits(max_data=8 * MIB), shared_memory=True) as client:
        conn = await client.connection(address)
        with trio.CancelScope() as call:

            async def give_up_once_the_server_has_it() -> None:  # not on a timer: a busy machine may not have sent it
                await arrived.wait()
                call.cancel()

            nursery.start_soon(give_up_once_the_server_has_it)
            await client.call_with_data(address, READ, Req(), into=memoryview(bytearray(MIB)))
        (held,) = conn._held_replies.values()  # the server will still write into it
        assert shm.SHARED.take(MIB) is not held
        with trio.fail_after(30):  # the late answer arrives: written, then dropped
            while conn._held_replies:
                await trio.sleep(0.05)
        assert bytes(memoryview(held)[:MIB]) == payload
