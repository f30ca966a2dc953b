"""The wire protocol and RPC layer against a live server on loopback."""

from __future__ import annotations

import errno
import functools
import os
import socket
import struct

import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfs import rpc, wire
from kvfs.errors import AuthError, KvfsError, ProtocolError, RpcTimeout
from kvfs.rpc import RpcClient, RpcServer
from kvfs.wire import Limits, Method

from harness import authenticated

TOKEN = "test-token"


class EchoRequest(msgspec.Struct, array_like=True):
    text: str
    delay: float = 0.0
    fail_errno: int = 0


class EchoResponse(msgspec.Struct, array_like=True):
    text: str
    data_len: int


ECHO = Method(9001, "test.echo", EchoRequest, EchoResponse, idempotent=True)
ECHO_ONCE = Method(9002, "test.echo_once", EchoRequest, EchoResponse)
UNKNOWN = Method(9003, "test.unregistered", EchoRequest, EchoResponse)



async def echo(request: EchoRequest, data: memoryview | None, ctx) -> object:
    if request.delay:
        await trio.sleep(request.delay)
    if request.fail_errno:
        raise KvfsError(f"asked to fail: {request.text}", request.fail_errno)
    response = EchoResponse(request.text, 0 if data is None else len(data))
    if data is None:
        return response
    half = len(data) // 2
    return response, [data[:half], data[half:]]  # scatter-gather back


@pytest.fixture
async def server(nursery):
    srv = RpcServer(TOKEN, limits=Limits(max_body=64 * 1024, max_data=32 << 20), name="test")
    srv.register(ECHO, echo)
    srv.register(ECHO_ONCE, echo)
    port = await nursery.start(srv.serve, "127.0.0.1", 0)
    yield f"127.0.0.1:{port}"


@pytest.fixture
async def client():
    async with RpcClient(TOKEN, call_timeout=10) as c:
        yield c


async def test_round_trip_with_data(server, client):
    assert await client.call(server, ECHO, EchoRequest("hi")) == EchoResponse("hi", 0)
    payload = bytes(range(256)) * 4096
    into = memoryview(bytearray(len(payload) + 10))
    response, data = await client.call_with_data(server, ECHO, EchoRequest("bulk"), data=payload, into=into)
    assert response.data_len == len(payload)
    assert data.obj is into.obj  # landed in the caller's buffer, no extra copy
    assert bytes(data) == payload


async def test_errors_carry_errno(server, client):
    with pytest.raises(KvfsError) as info:
        await client.call(server, ECHO_ONCE, EchoRequest("x", fail_errno=errno.ENOENT))
    assert info.value.errno == errno.ENOENT and "asked to fail" in info.value.message
    with pytest.raises(KvfsError) as info:
        await client.call(server, UNKNOWN, EchoRequest("x"))
    assert info.value.errno == errno.ENOSYS


async def test_thousand_concurrent_calls_on_one_connection(server, client):
    results: dict[int, EchoResponse] = {}

    async def one(i: int) -> None:
        results[i] = await client.call(server, ECHO, EchoRequest(str(i), delay=0.001 * (i % 7)), data=b"x" * (i % 50))

    async with trio.open_nursery() as nursery:
        for i in range(1000):
            nursery.start_soon(one, i)
    assert len(client._connections) == 1
    assert all(results[i] == EchoResponse(str(i), i % 50) for i in range(1000))


async def test_deadline(server, client):
    with pytest.raises(RpcTimeout):
        await client.call(server, ECHO_ONCE, EchoRequest("slow", delay=5), timeout=0.2)
    # the late answer is dropped and the connection keeps working
    assert (await client.call(server, ECHO, EchoRequest("after"))).text == "after"


@pytest.mark.parametrize("token", ["wrong-token", None])
async def test_wrong_or_missing_token_is_refused(server, token):
    if token is None:  # a peer that skips the handshake and sends a request straight away
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", int(server.rsplit(":", 1)[1])))
        body = wire.encode_body(EchoRequest("no tag"))
        await sock.send(wire.encode_frame(wire.FrameType.REQUEST, 1, ECHO.id, body))
        reply = await _recv_all(sock)
        header = wire.decode_header(reply[: wire.HEADER_SIZE], Limits())
        assert header.flags & wire.Flags.AUTH_REFUSED
        assert b"authentication handshake" in reply
        return
    async with RpcClient(token, retries=0) as bad:
        with pytest.raises(AuthError, match="refused us: handshake proof does not match the cluster token"):
            await bad.call(server, ECHO_ONCE, EchoRequest("x"))


async def _recv_all(sock) -> bytes:
    chunks = []
    with trio.move_on_after(5):
        while chunk := await sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _raw_send(address: str, payload: bytes) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(2)
            while sock.recv(65536):
                pass
        except OSError:
            pass  # the server may reset us; that is the point


def _signed(header_fields: dict, body: bytes, data: bytes = b""):
    """A frame sealed for the connection, then with some header fields changed (the tag no longer matches, but
    most are refused for what they say before the tag is checked)."""
    def build(signer: wire.Signer) -> bytes:
        raw = bytearray(signer.seal(wire.encode_frame(wire.FrameType.REQUEST, 7, ECHO.id, body, len(data))))
        for name, value in header_fields.items():
            offset, fmt = {"magic": (0, "4s"), "version": (4, "B"), "type": (5, "B"), "body_len": (20, "I"),
                           "data_len": (24, "Q")}[name]
            struct.pack_into("<" + fmt, raw, offset, value)
        return bytes(raw) + data
    return build


def _cut(build, end: int):
    return lambda signer: build(signer)[:end]


BAD_FRAMES = {
    "bad magic": _signed({"magic": b"XXXX"}, wire.encode_body(EchoRequest("a"))),
    "bad version": _signed({"version": 99}, wire.encode_body(EchoRequest("a"))),
    "bad type": _signed({"type": 77}, wire.encode_body(EchoRequest("a"))),
    "oversized body": _signed({"body_len": 1 << 30}, b""),
    "oversized data": _signed({"data_len": 1 << 40}, wire.encode_body(EchoRequest("a"))),
    "truncated header": _cut(_signed({}, wire.encode_body(EchoRequest("a"))), 20),
    "truncated body": _cut(_signed({}, wire.encode_body(EchoRequest("a" * 100))), -10),
    "truncated data": _cut(_signed({}, wire.encode_body(EchoRequest("a")), b"z" * 1000), -1),
    "tampered body": lambda signer: _signed({}, wire.encode_body(EchoRequest("a")))(signer)[:-1] + b"b",
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
async def test_server_survives_bad_frame(server, client, name, caplog):
    sock, signer = await authenticated(server, TOKEN)
    await sock.send(BAD_FRAMES[name](signer))
    sock.shutdown(socket.SHUT_WR)
    await _recv_all(sock)  # the server closes (or resets) the connection
    sock.close()
    assert (await client.call(server, ECHO, EchoRequest("still here"))).text == "still here"


async def test_garbage_body_with_good_tag_gets_an_error_and_connection_survives(server):
    sock, signer = await authenticated(server, TOKEN)
    frames = signer.seal(wire.encode_frame(wire.FrameType.REQUEST, 1, ECHO.id, b"\xc1garbage"))
    frames += signer.seal(wire.encode_frame(wire.FrameType.REQUEST, 2, ECHO.id, wire.encode_body(EchoRequest("ok"))))
    await sock.send(frames)
    reader_limits = Limits()
    got = {}
    buf = b""
    with trio.fail_after(5):
        while len(got) < 2:
            buf += await sock.recv(65536)
            while len(buf) >= wire.HEADER_SIZE:
                header = wire.decode_header(buf[: wire.HEADER_SIZE], reader_limits)
                end = wire.HEADER_SIZE + header.body_len
                if len(buf) < end:
                    break
                got[header.request_id] = (header.type, buf[wire.HEADER_SIZE:end])
                buf = buf[end:]
    assert got[1][0] is wire.FrameType.ERROR
    assert wire.decode_error(got[1][1]).errno == errno.EPROTO
    assert got[2][0] is wire.FrameType.RESPONSE
    sock.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda tail: wire.MAGIC + bytes([wire.PROTOCOL_VERSION]) + tail, st.binary(max_size=512)),
))
def test_hypothesis_garbage_against_live_server(garbage):
    async def main():
        async with trio.open_nursery() as nursery:
            srv = RpcServer(TOKEN, limits=Limits(max_body=4096, max_data=1 << 20))
            srv.register(ECHO, echo)
            port = await nursery.start(srv.serve, "127.0.0.1", 0)
            address = f"127.0.0.1:{port}"
            await trio.to_thread.run_sync(_raw_send, address, garbage)
            async with RpcClient(TOKEN) as good:
                assert (await good.call(address, ECHO, EchoRequest("ok"))).text == "ok"
            nursery.cancel_scope.cancel()

    trio.run(main)


async def test_idempotent_calls_retry_after_server_restart(client):
    async with trio.open_nursery() as nursery:
        srv = RpcServer(TOKEN)
        srv.register(ECHO, echo)
        scope = trio.CancelScope()

        async def run_server(port, task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await srv.serve("127.0.0.1", port, task_status=task_status)

        port = await nursery.start(run_server, 0)
        address = f"127.0.0.1:{port}"
        assert (await client.call(address, ECHO, EchoRequest("1"))).text == "1"
        scope.cancel()
        await trio.sleep(0.05)
        scope = trio.CancelScope()
        await nursery.start(run_server, port)
        assert (await client.call(address, ECHO, EchoRequest("2"))).text == "2"
        nursery.cancel_scope.cancel()


async def test_drain_finishes_running_calls_and_refuses_new_ones(client):
    from kvfs.errors import ServiceUnavailable

    async with trio.open_nursery() as nursery:
        srv = RpcServer(TOKEN)
        srv.register(ECHO_ONCE, echo)
        port = await nursery.start(srv.serve, "127.0.0.1", 0)
        address = f"127.0.0.1:{port}"
        results = {}

        async def slow():
            results["slow"] = await client.call(address, ECHO_ONCE, EchoRequest("slow", delay=0.5))

        nursery.start_soon(slow)
        await trio.sleep(0.1)
        async with trio.open_nursery() as draining:
            draining.start_soon(srv.drain, 5)
            await trio.sleep(0.05)
            with pytest.raises(ServiceUnavailable) as info:  # not run: safe to send anywhere else
                await client.call(address, ECHO_ONCE, EchoRequest("late"))
            assert info.value.errno == errno.ESHUTDOWN
        with trio.fail_after(2):  # drain returned once the running call had answered; the answer arrives
            while "slow" not in results:
                await trio.sleep(0.01)
        assert results["slow"].text == "slow"
        nursery.cancel_scope.cancel()


async def test_drained_server_says_goaway_so_a_call_racing_the_shutdown_is_known_unrun(client):
    """A call sent while the server closes must come back as 'not run' (ServiceUnavailable), never as an
    ambiguous reset: the server tells clients to stop (GOAWAY) and answers what was already on its way."""
    from kvfs.errors import ServiceUnavailable

    async with trio.open_nursery() as nursery:
        srv = RpcServer(TOKEN)
        srv.register(ECHO_ONCE, echo)
        port = await nursery.start(srv.serve, "127.0.0.1", 0)
        address = f"127.0.0.1:{port}"
        assert (await client.call(address, ECHO_ONCE, EchoRequest("before"))).text == "before"
        outcomes = []

        async def caller():
            while True:
                try:
                    await client.call(address, ECHO_ONCE, EchoRequest("racing"), timeout=2)
                except ServiceUnavailable:
                    outcomes.append("unrun")
                    return
                outcomes.append("ok")

        nursery.start_soon(caller)
        await trio.sleep(0.05)
        await srv.drain(1)
        nursery.cancel_scope.cancel()
    assert outcomes and outcomes[-1] == "unrun" and set(outcomes) <= {"ok", "unrun"}


async def test_inline_handlers_answer_in_order_and_others_still_overlap(nursery, client):
    """An inline handler runs in the connection's reader task; a slow ordinary one must not hold it up."""
    srv = RpcServer(TOKEN, name="test-inline")
    srv.register(ECHO, echo, inline=True)
    srv.register(ECHO_ONCE, echo)
    address = f"127.0.0.1:{await nursery.start(srv.serve, '127.0.0.1', 0)}"
    done: list[str] = []

    async def slow() -> None:
        await client.call(address, ECHO_ONCE, EchoRequest("slow", delay=0.5))
        done.append("slow")

    async with trio.open_nursery() as calls:
        calls.start_soon(slow)
        await trio.sleep(0.05)
        for i in range(20):
            assert await client.call(address, ECHO, EchoRequest(str(i)), data=b"y" * i) == EchoResponse(str(i), i)
        done.append("inline")
    assert done == ["inline", "slow"]


async def test_pipelined_small_calls_share_writes_both_ways(nursery, client, monkeypatch):
    """Many small calls in flight on one connection go out, and are answered, many frames per write: a write
    per frame was most of what such a connection cost. Every call still gets its own answer."""
    srv = RpcServer(TOKEN, name="test-batch")
    srv.register(ECHO, echo, inline=True)
    address = f"127.0.0.1:{await nursery.start(srv.serve, '127.0.0.1', 0)}"
    await client.call(address, ECHO, EchoRequest("warm"))
    writes = 0
    real_writev = os.writev

    def counting_writev(fd, buffers):
        nonlocal writes
        writes += 1
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", counting_writev)
    answers: dict[int, EchoResponse] = {}

    async def one(i: int) -> None:
        answers[i] = await client.call(address, ECHO, EchoRequest(str(i)))

    async with trio.open_nursery() as calls:
        for i in range(256):
            calls.start_soon(one, i)
    assert answers == {i: EchoResponse(str(i), 0) for i in range(256)}
    # a batch goes out in parts of _FLUSH_FRAMES, so the peer can start on the first while the rest are made
    assert writes <= 2 * 512 // rpc._FLUSH_FRAMES, f"{writes} writes for 256 calls and their 256 answers"


async def test_deadlines_on_an_open_connection(server, client):
    """Small calls on an open connection are bounded by the connection's one timer, not a cancel scope each: a
    short deadline holds while a call with a long one is in flight, a caller's own cancel scope still ends its
    call, and the connection goes on working after both."""
    await client.call(server, ECHO, EchoRequest("warm"))
    long_call = functools.partial(client.call, server, ECHO_ONCE, EchoRequest("long", delay=1.0), timeout=5)
    async with trio.open_nursery() as calls:
        calls.start_soon(long_call)
        await trio.sleep(0.05)
        start = trio.current_time()
        with pytest.raises(RpcTimeout, match="took longer than 0.2s"):
            await client.call(server, ECHO_ONCE, EchoRequest("slow", delay=5), timeout=0.2)
        assert 0.2 <= trio.current_time() - start < 0.7
        with trio.move_on_after(0.1) as scope:
            await client.call(server, ECHO_ONCE, EchoRequest("slow", delay=5))
        assert scope.cancelled_caught
    assert (await client.call(server, ECHO, EchoRequest("after"))).text == "after"


async def test_one_way_messages_run_the_handler_and_get_no_answer(nursery, client):
    """``send`` (Flags.ONEWAY): the handler runs with the data, in order with inline handling; nothing comes back,
    not even for a failure, and the connection goes on serving calls."""
    got: list[tuple[str, int]] = []

    async def record(request: EchoRequest, data: memoryview | None, ctx) -> object:
        if request.fail_errno:
            raise KvfsError("refused", request.fail_errno)
        got.append((request.text, 0 if data is None else len(data)))
        return EchoResponse(request.text, 0)

    srv = RpcServer(TOKEN, name="test-oneway")
    srv.register(ECHO, echo)
    srv.register(ECHO_ONCE, record, inline=True)
    address = f"127.0.0.1:{await nursery.start(srv.serve, '127.0.0.1', 0)}"
    await client.send(address, ECHO_ONCE, EchoRequest("a"), data=b"x" * 100_000)
    await client.send(address, ECHO_ONCE, EchoRequest("bad", fail_errno=errno.EINVAL))
    await client.send(address, ECHO_ONCE, EchoRequest("b"))
    assert await client.call(address, ECHO, EchoRequest("after")) == EchoResponse("after", 0)
    assert got == [("a", 100_000), ("b", 0)]
    assert not (await client.connection(address))._pending


async def test_after_reply_runs_once_the_reply_left_and_also_after_a_failure(nursery, client):
    """A handler may answer with a view of memory it must keep until the reply is out (a lent chunk): its
    after-reply calls run only then, so clobbering the memory there cannot reach the caller; and they run when
    the handler fails after registering them, so nothing stays held."""
    lent = bytearray(os.urandom(16 << 20))  # more than a socket takes at once: the reply waits for the reader
    expected = bytes(lent)
    released: list[str] = []

    async def lend(request: EchoRequest, data: memoryview | None, ctx) -> object:
        def release() -> None:
            lent[:] = bytes(len(lent))
            released.append(request.text)

        ctx.after_reply(release)
        if request.fail_errno:
            raise KvfsError("refused", request.fail_errno)
        return EchoResponse(request.text, 0), memoryview(lent)

    srv = RpcServer(TOKEN, limits=Limits(max_data=32 << 20), name="test-lend")
    srv.register(ECHO, lend)
    address = f"127.0.0.1:{await nursery.start(srv.serve, '127.0.0.1', 0)}"
    async def released_by(names: list[str]) -> None:  # the server may run them just after the caller has the reply
        with trio.fail_after(5):
            while released != names:
                await trio.sleep(0.01)

    _, data = await client.call_with_data(address, ECHO, EchoRequest("big"))
    assert bytes(data) == expected
    await released_by(["big"])
    with pytest.raises(KvfsError):
        await client.call(address, ECHO, EchoRequest("bad", fail_errno=errno.EIO))
    await released_by(["big", "bad"])


async def test_writer_holds_caller_buffers_until_sent_and_keeps_frame_order():
    """A peer that does not read fills the socket: frames queue in order, and a frame with a caller-owned
    buffer returns only once its bytes are in the kernel (so the caller may reuse the buffer)."""
    from kvfs.rpc import _Writer

    a, b = trio.socket.socketpair()
    with a, b:
        writer = _Writer(a)
        big = bytearray(b"z" * (2 << 20))  # more than the socket buffers hold, less than the queue limit
        returned = trio.Event()
        received = bytearray()

        async def put_big() -> None:
            await writer.put([b"head", big])
            returned.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.run)
            nursery.start_soon(put_big)
            await trio.sleep(0.1)
            assert not returned.is_set()  # still in the queue, not yet in the kernel
            await writer.put([b"tail"])  # queues behind, returns at once (bytes it owns)
            while len(received) < 4 + len(big) + 4:
                received += await b.recv(1 << 20)
            await returned.wait()
            writer.close()
        assert received[:4] == b"head" and received[-4:] == b"tail" and len(received) == 8 + len(big)
        with pytest.raises(Exception, match="closed"):
            await writer.put([b"late"])


@given(ftype=st.integers(0, 255), flags=st.integers(0, 255))
def test_decode_header_knows_every_frame_type_and_flag_set_and_refuses_the_rest(ftype, flags):
    raw = wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, ftype, flags, 7, 1, 0, 0, bytes(wire.TAG_SIZE))
    if ftype not in {t.value for t in wire.FrameType} or flags & ~int(~wire.Flags(0)):
        with pytest.raises(ProtocolError, match="unknown"):
            wire.decode_header(raw, Limits())
        return
    header = wire.decode_header(raw, Limits())
    assert header.type is wire.FrameType(ftype)
    assert header.flags == wire.Flags(flags) and type(header.flags) is wire.Flags
    assert {f for f in wire.Flags if f and f in header.flags} == {f for f in wire.Flags if f & flags}
