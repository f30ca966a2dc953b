"""The connection handshake and frame keys of :mod:`kvfs.auth`: the derivation and the frame tags as pure
functions, then the handshake against a live server on loopback (wrong token, truncated, out of order, a server
without the token)."""

from __future__ import annotations

import functools
import hmac
import struct

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs import auth, wire
from kvfs.errors import AuthError, ProtocolError
from kvfs.rpc import FrameReader, RpcClient, RpcServer, authenticate_server, send_all

from harness import authenticated, send_until_closed
from test_rpc import ECHO, EchoRequest, echo

TOKEN = "auth-test-token"
nonces = st.binary(min_size=auth.NONCE_SIZE, max_size=auth.NONCE_SIZE)
bodies = st.lists(st.binary(max_size=64), min_size=1, max_size=8)


def pair(token: str = TOKEN, client_nonce: bytes = b"c" * 32, server_nonce: bytes = b"s" * 32):
    """The two ends of one connection: (client signer, server signer)."""
    session = auth.Session.derive(token.encode(), client_nonce, server_nonce)
    return session.client_signer(), session.server_signer()


def frame(body: bytes, request_id: int = 1) -> bytes:
    return wire.encode_frame(wire.FrameType.REQUEST, request_id, ECHO.id, body)


def accepts(receiver: wire.Signer, sealed: bytes) -> bool:
    """Whether ``receiver`` takes ``sealed`` as the next frame (a header it refuses to parse is refused too)."""
    try:
        header = wire.decode_header(sealed[: wire.HEADER_SIZE], wire.Limits())
        wire.check_tag(receiver, sealed[: wire.HEADER_SIZE], header, sealed[wire.HEADER_SIZE:])
    except (AuthError, ProtocolError):
        return False
    return True


# ----------------------------------------------------------------------------------------- derivation


@given(client_nonce=nonces, server_nonce=nonces)
def test_both_ends_derive_the_same_session_and_every_secret_differs(client_nonce, server_nonce):
    a = auth.Session.derive(TOKEN.encode(), client_nonce, server_nonce)
    assert a == auth.Session.derive(TOKEN.encode(), client_nonce, server_nonce)
    secrets = {a.client_proof, a.server_proof, a.client_key, a.server_key}
    assert len(secrets) == 4  # a role's proof is never the other role's, nor a key
    other = auth.Session.derive(b"another token", client_nonce, server_nonce)
    assert not secrets & {other.client_proof, other.server_proof, other.client_key, other.server_key}


@given(client_nonce=nonces, server_nonce=nonces, fresh=nonces)
def test_a_fresh_nonce_on_either_side_changes_everything(client_nonce, server_nonce, fresh):
    base = auth.Session.derive(TOKEN.encode(), client_nonce, server_nonce)
    for changed in (auth.Session.derive(TOKEN.encode(), fresh, server_nonce),
                    auth.Session.derive(TOKEN.encode(), client_nonce, fresh)):
        if changed != base:  # unless hypothesis drew the same nonce again
            assert changed.client_proof != base.client_proof and changed.client_key != base.client_key


def test_an_empty_token_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        auth.token_key("")


# ----------------------------------------------------------------------------------------- frame tags


@given(bodies=bodies)
def test_frames_in_order_are_accepted_in_both_directions(bodies):
    client, server = pair()
    for body in bodies:
        assert accepts(server, client.seal(frame(body)))
        assert accepts(client, server.seal(frame(body)))


@given(key=st.binary(min_size=1, max_size=200), bodies=bodies)
def test_a_tag_is_hmac_sha256_of_the_sequence_number_and_the_frame(key, bodies):
    """What the protocol says a tag is, whatever shortcut computes it (keys longer than SHA-256's block too)."""
    signer = wire.Signer(send_key=key, receive_key=key)
    for sequence, body in enumerate(bodies):
        unsealed = frame(body)
        expected = hmac.digest(key, struct.pack("<Q", sequence) + unsealed, "sha256")[: wire.TAG_SIZE]
        assert signer.seal(unsealed)[wire.HEADER_SIZE - wire.TAG_SIZE : wire.HEADER_SIZE] == expected


@given(bodies=bodies)
def test_a_frame_replayed_on_its_own_connection_is_refused(bodies):
    client, server = pair()
    sealed = [client.seal(frame(body)) for body in bodies]
    for one in sealed:
        assert accepts(server, one)
    assert not accepts(server, sealed[0])  # its sequence number is long gone


@given(bodies=st.lists(st.binary(max_size=64), min_size=2, max_size=8, unique=True), data=st.data())
def test_reordered_frames_are_refused(bodies, data):
    client, server = pair()
    sealed = [client.seal(frame(body)) for body in bodies]
    order = data.draw(st.permutations(range(len(sealed))).filter(lambda p: list(p) != sorted(p)))
    verdicts = [accepts(server, sealed[i]) for i in order]
    first_out_of_place = next(n for n, i in enumerate(order) if i != n)
    assert all(verdicts[:first_out_of_place]) and not verdicts[first_out_of_place]


@given(body=st.binary(max_size=64), data=st.data())
def test_any_flipped_bit_of_header_tag_or_body_is_refused(body, data):
    client, server = pair()
    sealed = bytearray(client.seal(frame(body)))
    position = data.draw(st.integers(0, len(sealed) - 1))
    sealed[position] ^= 1 << data.draw(st.integers(0, 7))
    assert not accepts(server, bytes(sealed))


def test_a_frame_of_another_connection_is_refused_even_at_the_same_sequence_number():
    client_a, _ = pair(client_nonce=b"a" * 32)
    _, server_b = pair(client_nonce=b"b" * 32)
    assert not accepts(server_b, client_a.seal(frame(b"unlink")))


def test_a_frame_sent_back_to_its_sender_is_refused():
    """The directions have different keys: a server never takes its own frame for a client's."""
    _, server = pair()
    assert not accepts(server, server.seal(frame(b"x")))


def test_an_untagged_frame_is_refused():
    _, server = pair()
    with pytest.raises(AuthError, match="no authentication tag"):
        raw = frame(b"x")
        wire.check_tag(server, raw[: wire.HEADER_SIZE], wire.decode_header(raw[: wire.HEADER_SIZE], wire.Limits()),
                       raw[wire.HEADER_SIZE:])


# ------------------------------------------------------------------------------------- live handshake


@pytest.fixture
async def server(nursery):
    srv = RpcServer(TOKEN, name="auth-test")
    srv.HANDSHAKE_TIMEOUT = 0.5
    srv.register(ECHO, echo)
    port = await nursery.start(srv.serve, "127.0.0.1", 0)
    srv.address = f"127.0.0.1:{port}"
    return srv


async def still_serves(srv: RpcServer) -> None:
    async with RpcClient(TOKEN, retries=0) as good:
        assert (await good.call(srv.address, ECHO, EchoRequest("ok"))).text == "ok"


async def test_a_client_with_another_token_is_refused_in_one_clear_error(server, caplog):
    async with RpcClient("not the token", retries=0) as bad:
        with pytest.raises(AuthError) as info:
            await bad.call(server.address, ECHO, EchoRequest("x"))
    assert info.value.message == f"{server.address} refused us: handshake proof does not match the cluster token"
    assert server.connections_refused == 1
    assert "refusing 127.0.0.1:" in caplog.text
    await still_serves(server)


async def test_a_server_without_the_token_is_found_out_by_the_client(nursery):
    """A listener that plays the server's part with another token (it cannot compute the client's expected
    proof): the client refuses it rather than talking on."""
    impostor = trio.socket.socket()
    await impostor.bind(("127.0.0.1", 0))
    impostor.listen()
    address = "127.0.0.1:%d" % impostor.getsockname()[1]

    async def pretend() -> None:
        sock, _ = await impostor.accept()
        reader = FrameReader(sock)
        hello = await reader.read(HANDSHAKE_FRAME)  # the client's HELLO
        nonce = auth.new_nonce()
        await send_all(sock, wire.encode_frame(wire.FrameType.RESPONSE, 0, auth.AUTH_HELLO.id,
                                               wire.encode_body(auth.Hello(nonce))))
        await reader.read(HANDSHAKE_FRAME)  # the client's proof, which it cannot check
        guessed = auth.Session.derive(b"a guess", bytes(hello)[-32:], nonce).server_proof
        await send_all(sock, wire.encode_frame(wire.FrameType.RESPONSE, 0, auth.AUTH_PROVE.id,
                                               wire.encode_body(auth.Proof(guessed))))
        await trio.sleep(5)

    nursery.start_soon(pretend)
    async with RpcClient(TOKEN, retries=0) as client:
        with pytest.raises(AuthError, match="does not hold the cluster token"):
            await client.call(address, ECHO, EchoRequest("x"))
    impostor.close()


async def raw(srv: RpcServer, *frames: bytes) -> bytes:
    """Send ``frames`` as they are on a fresh connection; all the server answers until it closes."""
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", srv.port))
    return await send_until_closed(sock, b"".join(frames))


def hello(nonce: bytes = b"n" * 32) -> bytes:
    return wire.encode_frame(wire.FrameType.REQUEST, 0, auth.AUTH_HELLO.id, wire.encode_body(auth.Hello(nonce)))


def prove(mac: bytes) -> bytes:
    return wire.encode_frame(wire.FrameType.REQUEST, 0, auth.AUTH_PROVE.id, wire.encode_body(auth.Proof(mac)))


HANDSHAKE_FRAME = len(hello())  # every handshake frame: a header and 32 bytes in msgpack
assert len(prove(b"p" * 32)) == HANDSHAKE_FRAME


async def test_a_truncated_handshake_costs_only_its_connection(server, caplog):
    assert await raw(server, hello()[:30]) == b""  # half a header, then the peer hangs up
    assert await raw(server, hello()) != b""  # the server's nonce, then a peer that says nothing more
    assert "no authentication handshake within" in caplog.text
    await still_serves(server)


async def test_a_proof_before_the_hello_is_refused(server, caplog):
    answer = await raw(server, prove(b"p" * 32))
    header = wire.decode_header(answer[: wire.HEADER_SIZE], wire.Limits())
    assert header.flags & wire.Flags.AUTH_REFUSED and b"transport.auth_hello" in answer
    await still_serves(server)


async def test_a_recorded_handshake_replayed_is_refused(server, caplog):
    """Everything a token holder sent on one connection, replayed on a new one: the server's fresh nonce makes
    the recorded proof wrong."""
    sock, signer = await authenticated(server.address, TOKEN)
    sock.close()
    session = auth.Session.derive(TOKEN.encode(), b"n" * 32, b"whatever the server said last time")
    answer = await raw(server, hello(), prove(session.client_proof),
                       signer.seal(wire.encode_frame(wire.FrameType.REQUEST, 1, ECHO.id,
                                                     wire.encode_body(EchoRequest("replayed")))))
    assert b"replayed" not in answer
    assert "handshake proof does not match the cluster token" in caplog.text and server.connections_refused == 1
    await still_serves(server)


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 2 * HANDSHAKE_FRAME - 1), flip=st.integers(0, 8 * HANDSHAKE_FRAME - 1))
def test_hypothesis_damaged_handshakes_never_authenticate(cut, flip):
    """A proof computed for a handshake, then cut short or with one bit flipped: never a working connection."""
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            srv = RpcServer(TOKEN, name="auth-test")
            srv.HANDSHAKE_TIMEOUT = 0.2
            srv.register(ECHO, echo)
            srv.port = await nursery.start(srv.serve, "127.0.0.1", 0)
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", srv.port))
            reader = FrameReader(sock)
            nonce = auth.new_nonce()
            await send_all(sock, hello(nonce))
            raw_header = bytes(await reader.read(wire.HEADER_SIZE))
            server_nonce = wire.decode_body(auth.Hello, await reader.read(
                wire.decode_header(raw_header, wire.Limits()).body_len)).nonce
            damaged = bytearray(prove(auth.Session.derive(TOKEN.encode(), nonce, server_nonce).client_proof))
            damaged[flip // 8 % len(damaged)] ^= 1 << flip % 8
            answer = await send_until_closed(sock, bytes(damaged)[: cut % len(damaged) or len(damaged)])
            if answer:  # the server hung up, or refused: it never sends its proof back
                header = wire.decode_header(answer[: wire.HEADER_SIZE], wire.Limits())
                assert header.type is wire.FrameType.ERROR and header.flags & wire.Flags.AUTH_REFUSED
            nursery.cancel_scope.cancel()

    trio.run(main)


async def test_the_server_side_helper_speaks_to_a_real_client(nursery):
    """authenticate_server on a bare socket is the same protocol RpcServer runs (tests and tools use it)."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    got = []

    async def serve() -> None:
        sock, _ = await listener.accept()
        got.append(await authenticate_server(FrameReader(sock), functools.partial(send_all, sock), "peer",
                                             TOKEN.encode()))
        sock.close()

    nursery.start_soon(serve)
    sock, client = await authenticated(address, TOKEN)
    await trio.sleep(0.05)
    assert accepts(got[0], client.seal(frame(b"hello")))
    sock.close()
    listener.close()
