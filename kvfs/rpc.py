"""Multiplexed RPC over TCP on trio.

One connection carries many concurrent calls, matched by request id. Each side runs one reader task and one
writer task per connection. A frame is written by its caller when nothing is queued and nothing follows it,
else the writer drains the queue into one ``writev`` (a request while others are in flight, an inline handler's
reply while more requests are already read: small calls in flight only pay off when frames are batched), and a
queue of 16 frames goes out at once, so the peer works on one part while this side makes the next; the
reader parses frames out of a reused buffer (those already buffered without awaiting anything) and hands each
data section straight to the buffer its caller supplied, so bulk bytes are copied once, from the kernel into
their destination. Both read and write the non-blocking descriptor directly and wait for readiness only when it
is empty or full: a small call's round trip is mostly scheduler passes, and this leaves one per side where trio's
socket methods took several. Handlers registered ``inline`` run in the reader task (no task per call). A client's
small calls on an open connection are bounded by one deadline timer per connection rather than a cancel scope
each.

Every connection opens with the handshake of :mod:`kvfs.auth`, which proves both sides hold the cluster token and
gives the connection its own frame keys; every later frame is tagged with them and an implicit sequence number.
Servers survive bad peers: a malformed, truncated, oversized or unauthenticated frame (a replayed one included)
closes that one connection with a logged reason; every other connection keeps being served.

Data sections may travel another way, negotiated per connection by :mod:`kvfs.transport.negotiate` (the
handshakes and the link state they leave; this module only asks it, per frame, how a section goes):

* lent data sections (``lend=True``: chunk writes and their forwards) through shared memory when client and server
  share a host (:mod:`kvfs.transport.shm`, ``$KVFS_SHM``): the frame names where the bytes lie in the client's
  arena and the server copies them out, one memcpy instead of two copies and a TCP stack on each side;
* answers' data sections (``into=``: chunk reads) to a client on the same host: the request names a buffer in the
  client's arena, the server writes the data there and the client copies it into ``into`` (``Flags.SHM_REPLY``);
* large data sections by RDMA (``transport=`` ``auto``/``tcp``/``rdma``, or ``$KVFS_TRANSPORT``): the frame carries
  a descriptor of a registered slab in place of the bytes and the server RDMA-READs/WRITEs it
  (:mod:`kvfs.transport.link`).

Control messages always stay on TCP, any set-up failure leaves that connection on TCP, and a connection that
negotiated nothing sends exactly the bytes it always did.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import math
import os
import select
import socket as _socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgspec
import prometheus_client
import trio

from kvfs import auth, wire
from kvfs.errors import (
    AuthError,
    ConnectionLost,
    KvfsError,
    ProtocolError,
    RpcTimeout,
    ServiceUnavailable,
    from_wire,
)
from kvfs.pool import RECEIVED
from kvfs.transport import link as rdma
from kvfs.transport import negotiate, shm
from kvfs.transport.buffers import Slab
from kvfs.transport.direct import DirectInto
from kvfs.transport.errors import BufferExhausted, RdmaError
from kvfs.transport.handshake import RDMA_CONNECT, RdmaAccept, RdmaOffer
from kvfs.transport.negotiate import ClientLinks, PeerConnection, TransportChoice
from kvfs.transport.select import TransportMode
from kvfs.wire import FrameType, Limits, Method, Signer

log = logging.getLogger(__name__)

Buffer: TypeAlias = bytes | bytearray | memoryview
#: What a handler may send back: a body, or a body and its data section (one buffer or several, sent
#: back to back without joining them).
HandlerResult: TypeAlias = msgspec.Struct | tuple[msgspec.Struct, Buffer | Sequence[Buffer]]
Handler: TypeAlias = Callable[[Any, memoryview | None, "CallContext"], Awaitable[HandlerResult]]
#: Sends one whole frame: a socket's sendall, or a connection writer's ``put``.
SendFrame: TypeAlias = Callable[[bytes], Awaitable[None]]

RPC_CALLS = prometheus_client.Counter("kvfs_rpc_calls", "RPC calls served", ["method", "errno"])
RPC_SECONDS = prometheus_client.Histogram("kvfs_rpc_seconds", "Time spent in RPC handlers", ["method"])

# labels() hashes and looks up its arguments on every call; the children are few (methods x errnos), kept here.
_call_counter = functools.cache(RPC_CALLS.labels)
_call_timer = functools.cache(RPC_SECONDS.labels)

_IOV_MAX = 512
_READ_BUFFER = 256 * 1024
_YIELD_EVERY = 64
_QUEUE_LIMIT = 4 * 1024 * 1024
#: Queued frames that go out at once, without waiting for the writer task's pass: the peer starts on them while
#: this side makes the rest. Without it many calls in flight moved as one batch, each side idle while the other
#: worked through it.
_FLUSH_FRAMES = 16
#: Handshake frames are a nonce or a MAC in a few bytes of msgpack; anything larger is not a handshake.
_HANDSHAKE_LIMITS = Limits(max_body=256)


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` too) into its parts."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class _EndOfStream(Exception):
    pass


class FrameReader:
    """Buffered reads from a socket that can hand large payloads directly to a caller's buffer.

    Reads go straight to the non-blocking descriptor and wait for readiness only when it has nothing: trio's
    socket methods yield to the scheduler after every successful call, a scheduler pass per frame that was a
    good part of a small call's round trip. A reader that keeps finding data yields every ``_YIELD_EVERY``
    reads, so one busy connection cannot starve the others. After a read that took less than it asked for (the
    socket was empty then) the next one waits for readiness first: trying it would almost always find nothing,
    a failed ``readv`` on each side of every lone call's round trip.
    """

    def __init__(self, sock: trio.socket.SocketType, size: int = _READ_BUFFER) -> None:
        self._fd = sock.fileno()
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._reads = 0
        self._drained = False  # the last read emptied the socket

    @property
    def buffered(self) -> int:
        """Bytes read from the socket and not yet consumed: more frames may be waiting right behind this one."""
        return self._end - self._start

    async def _recv_into(self, dst: memoryview) -> int:
        self._reads += 1
        if self._reads % _YIELD_EVERY == 0:
            await trio.lowlevel.checkpoint()
        if self._drained:
            await trio.lowlevel.wait_readable(self._fd)
        while True:
            try:
                n = os.readv(self._fd, [dst])
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._fd)
                continue
            self._drained = n < len(dst)
            return n

    async def _fill(self, need: int) -> None:
        if self._start + need > len(self._buf):
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        while self._end - self._start < need:
            n = await self._recv_into(self._view[self._end :])
            if n == 0:
                if self._end == self._start:
                    raise _EndOfStream
                raise ProtocolError(f"connection closed inside a frame ({self._end - self._start} of {need} bytes)")
            self._end += n

    def take(self, n: int) -> memoryview | None:
        """The next ``n`` bytes if they are buffered already (a view, valid until the next read), else None and
        nothing consumed: most frames of a busy connection are, and parsing them needs no coroutine at all."""
        start = self._start
        if self._end - start < n:
            return None
        self._start = start + n
        return self._view[start : start + n]

    async def read(self, n: int) -> memoryview | bytes:
        """Return the next ``n`` bytes; a view into the shared buffer, valid until the next read."""
        if n > len(self._buf):
            out = bytearray(n)
            await self.read_into(memoryview(out))
            return bytes(out)
        await self._fill(n)
        view = self._view[self._start : self._start + n]
        self._start += n
        return view

    async def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` exactly: first from what is buffered, then straight from the socket."""
        buffered = min(self._end - self._start, len(dst))
        dst[:buffered] = self._view[self._start : self._start + buffered]
        self._start += buffered
        pos = buffered
        while pos < len(dst):
            n = await self._recv_into(dst[pos:])
            if n == 0:
                raise ProtocolError(f"connection closed inside a data section ({pos} of {len(dst)} bytes)")
            pos += n

    async def discard(self, n: int) -> None:
        while n:
            await self._fill(1)
            step = min(n, self._end - self._start)
            self._start += step
            n -= step


def _write_available(fd: int, views: list[Buffer]) -> int:
    """Write from the front of ``views`` until they are all sent or the socket is full; trims ``views`` in
    place and returns the bytes written. Errors other than a full socket propagate."""
    total = 0
    while views:
        try:
            sent = os.writev(fd, views[:_IOV_MAX])
        except BlockingIOError:
            break
        total += sent
        done = 0
        while sent and done < len(views):
            head = views[done]
            if sent >= len(head):
                sent -= len(head)
                done += 1
            else:
                views[done] = head[sent:]
                sent = 0
        del views[:done]
    return total


class _Writer:
    """Serialises frames onto one socket.

    A frame that finds nothing queued is written by its caller at once, with no task switch or scheduler pass;
    what the socket does not take is queued, and the writer task sends the queue as the socket drains, many
    frames per ``writev`` (small calls in flight only pay off when their frames batch). A caller that knows more
    frames follow right behind its own (``batch``) queues it instead of writing it: a write per frame was most of
    what a connection with many small calls in flight spent. Frames never interleave.
    ``put`` returns once its frame is written or queued, except that a frame holding caller-owned buffers
    (anything but ``bytes``), or one that finds more than ``_QUEUE_LIMIT`` bytes queued, waits until its bytes
    are in the kernel: callers may reuse their buffers, and a peer that stops reading pushes back.
    """

    def __init__(self, sock: trio.socket.SocketType, signer: Signer | None = None) -> None:
        self._fd = sock.fileno()
        #: Seals each frame as it is queued, so sequence numbers follow the byte stream by construction; None
        #: until the connection's handshake gave it keys (handshake frames go untagged).
        self.signer = signer
        self._queue: list[Buffer] = []  # bytes, or byte-format views of the callers' buffers
        self._queued = 0  # bytes ever queued
        self._sent = 0  # bytes of those written so far
        self._wake = trio.Event()  # the queue has something, or close() was called
        self._progress = trio.Event()  # set (and replaced) whenever queued bytes are written
        self._closed = False
        self._stopped = False
        self._error: OSError | None = None

    @property
    def stopped(self) -> bool:
        """Nothing more will be sent: the writer task has ended."""
        return self._stopped

    async def put(self, buffers: list[Buffer], *, seal: bool = True, batch: bool = False,
                  deadline: float = math.inf) -> None:
        """Send one frame (from :func:`kvfs.wire.encode_frame`) and its data buffers; ``seal=False`` only for the
        one frame a peer reads untagged (an authentication refusal). ``batch``: more frames are on their way
        (other calls in flight, more requests already read), so leave this one to the writer task, which sends
        all that queued up by its next pass in one ``writev``. ``deadline`` (trio time): RpcTimeout if the frame
        must wait for its bytes to reach the kernel until then."""
        if self._closed or self._stopped or self._error is not None:
            raise ConnectionLost("connection closed before the frame was sent")
        frame = buffers[0]
        if seal and self.signer is not None:
            frame = self.signer.seal(frame)
        if len(buffers) == 1 and type(frame) is bytes:  # most frames: nothing but the sealed header and body
            views: list[Buffer] = [frame]
            borrowed = False
        else:
            buffers = [frame, *buffers[1:]]
            views = [b if type(b) is bytes else memoryview(b).cast("B") for b in buffers if len(b)]
            borrowed = any(type(b) is not bytes for b in buffers)  # caller-owned: wait until they are sent
        if not self._queue and not batch:
            try:
                _write_available(self._fd, views)
            except OSError as exc:  # the writer task raises it too, which ends the connection
                self._error = exc
                self._wake.set()
                raise ConnectionLost(f"sending failed: {exc}") from None
            if not views:
                return
        self._queue.extend(views)
        self._queued += sum(map(len, views))
        if len(self._queue) >= _FLUSH_FRAMES:
            try:
                self._send_queued()
            except OSError as exc:
                self._error = exc
                self._wake.set()
                raise ConnectionLost(f"sending failed: {exc}") from None
        if self._queue:
            self._wake.set()
        if borrowed or self._queued - self._sent > _QUEUE_LIMIT:
            end = self._queued
            with trio.move_on_at(deadline):
                while self._sent < end:
                    if self._stopped:
                        raise ConnectionLost("connection closed before the frame was sent")
                    await self._progress.wait()
                return
            raise RpcTimeout("the peer took in no more bytes before the call's deadline")

    async def run(self) -> None:
        """Send what ``put`` queued until :meth:`close` (flushing first) or until a send fails."""
        try:
            while True:
                if self._error is not None:
                    raise self._error
                if self._queue:
                    self._send_queued()
                    if self._queue:
                        await trio.lowlevel.wait_writable(self._fd)
                    continue
                if self._closed:
                    return
                self._wake = trio.Event()
                await self._wake.wait()
        finally:
            self._stopped = True
            self._progress.set()

    def _send_queued(self) -> None:
        """Write as much of the queue as the socket takes; OSError for a broken connection."""
        sent = _write_available(self._fd, self._queue)
        if sent:
            self._sent += sent
            self._progress.set()
            self._progress = trio.Event()

    def close(self) -> None:
        self._closed = True
        self._wake.set()


def _data_buffers(data: Buffer | Sequence[Buffer] | None) -> tuple[list[Buffer], int]:
    if data is None:
        return [], 0
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [data], memoryview(data).nbytes
    parts = list(data)
    return parts, sum(memoryview(p).nbytes for p in parts)


async def _connect(address: str, timeout: float) -> trio.socket.SocketType:
    host, port = parse_address(address)
    with trio.move_on_after(timeout) as scope:
        stream = await trio.open_tcp_stream(host, port)
    if scope.cancelled_caught:
        raise ServiceUnavailable(f"connecting to {address} timed out after {timeout:g}s")
    sock = stream.socket
    sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
    return sock


async def _read_frame(reader: FrameReader, limits: Limits, signer: Signer) -> tuple[wire.Header, memoryview | bytes]:
    """The next frame's header and body, its tag checked (AuthError otherwise); the body is a view into the read
    buffer, valid until the next read. Frames already buffered are parsed without awaiting anything."""
    raw = reader.take(wire.HEADER_SIZE)
    raw = bytes(raw if raw is not None else await reader.read(wire.HEADER_SIZE))
    header = wire.decode_header(raw, limits)
    body = reader.take(header.body_len)
    if body is None:
        body = await reader.read(header.body_len)
    wire.check_tag(signer, raw, header, body)
    return header, body


async def _read_handshake(reader: FrameReader, expect: Method, request: bool, peer: str) -> Any:
    """The next handshake frame, which must be ``expect``'s request (server side) or response (client side)."""
    raw = bytes(await reader.read(wire.HEADER_SIZE))
    header = wire.decode_header(raw, _HANDSHAKE_LIMITS)
    body = await reader.read(header.body_len)
    if header.type is FrameType.ERROR and not request:  # the server refuses us, or is going away
        err = wire.decode_error(body)
        if wire.Flags.AUTH_REFUSED in header.flags:
            raise AuthError(f"{peer} refused us: {err.message}")
        raise from_wire(err.errno, f"{peer}: {err.message}")
    wanted = FrameType.REQUEST if request else FrameType.RESPONSE
    if header.type is not wanted or header.method != expect.id:
        raise AuthError(f"expected the authentication handshake's {expect.name} {wanted.name.lower()}, got a"
                        f" {header.type.name.lower()} of method {header.method} (a kvfs before protocol"
                        f" {wire.PROTOCOL_VERSION}, or not kvfs)")
    if header.data_len or header.request_id or any(header.tag):
        raise ProtocolError(f"{expect.name} with a data section, request id or tag (handshake frames have none)")
    return wire.decode_body(expect.request if request else expect.response, body)


async def authenticate_client(reader: FrameReader, send: SendFrame, address: str, token: bytes) -> Signer:
    """The client's side of the :mod:`kvfs.auth` handshake on a fresh connection; returns its signer. Public for
    tools and tests that speak frames by hand."""
    nonce = auth.new_nonce()
    await send(_handshake_frame(auth.AUTH_HELLO, FrameType.REQUEST, auth.Hello(nonce)))
    server_nonce = (await _read_handshake(reader, auth.AUTH_HELLO, False, address)).nonce
    session = auth.Session.derive(token, nonce, server_nonce)
    await send(_handshake_frame(auth.AUTH_PROVE, FrameType.REQUEST, auth.Proof(session.client_proof)))
    proof = await _read_handshake(reader, auth.AUTH_PROVE, False, address)
    if not auth.proof_matches(session.server_proof, proof.mac):
        raise AuthError(f"{address} does not hold the cluster token (its handshake proof does not match)")
    return session.client_signer()


async def authenticate_server(reader: FrameReader, send: SendFrame, peer: str, token: bytes) -> Signer:
    """The server's side of the :mod:`kvfs.auth` handshake; raises AuthError for a peer without the token. It
    answers the client's proof only once it checked it, so a peer without the token gets no proof to study."""
    hello = await _read_handshake(reader, auth.AUTH_HELLO, True, peer)
    nonce = auth.new_nonce()
    await send(_handshake_frame(auth.AUTH_HELLO, FrameType.RESPONSE, auth.Hello(nonce)))
    session = auth.Session.derive(token, hello.nonce, nonce)
    proof = await _read_handshake(reader, auth.AUTH_PROVE, True, peer)
    if not auth.proof_matches(session.client_proof, proof.mac):
        raise AuthError("handshake proof does not match the cluster token")
    await send(_handshake_frame(auth.AUTH_PROVE, FrameType.RESPONSE, auth.Proof(session.server_proof)))
    return session.server_signer()


def _handshake_frame(method: Method, kind: FrameType, body: msgspec.Struct) -> bytes:
    return wire.encode_frame(kind, 0, method.id, wire.encode_body(body))


async def send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    """Write all of ``data`` to a trio socket (its ``send`` may take only part)."""
    view = memoryview(data)
    while view:
        view = view[await sock.send(view):]


# --------------------------------------------------------------------------------------------- client


class _Pending:
    """One call awaiting its answer. The caller parks on it with trio's low-level primitives, not a
    ``trio.Event``: an event's parking lot cost about a microsecond a call on each side of the wait."""

    __slots__ = ("method", "into", "deadline", "response", "data", "error", "finished", "_task", "dst", "direct",
                 "offered", "reply", "reply_offset")

    def __init__(self, method: Method, into: memoryview | None, deadline: float = math.inf, *, dst: Slab | None = None,
                 direct: DirectInto | None = None, offered: int = 0) -> None:
        self.method = method
        self.into = into
        #: when the connection's timer fails the call with RpcTimeout (inf: the caller's cancel scope bounds it)
        self.deadline = deadline
        self.response: Any = None
        self.data: memoryview | None = None
        self.error: BaseException | None = None
        self.finished = False
        self._task: trio.lowlevel.Task | None = None
        self.dst = dst  # RDMA: the slab the server may write the response's data into
        self.direct = direct  # RDMA: or the caller's registered region, named in the request instead
        self.offered = offered  # RDMA: how many bytes of it were offered
        self.reply: Any = None  # SHM_REPLY: this process's arena buffer the server may write the answer's data into
        self.reply_offset = 0  # its arena offset

    def finish(self, error: BaseException | None = None) -> None:
        """The answer (or ``error``) is in: wake the caller. Only the first finish counts."""
        if self.finished:
            return
        self.finished = True
        if error is not None:
            self.error = error
        task, self._task = self._task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        """Until :meth:`finish`; a cancellation point like ``Event.wait``."""
        if self.finished:
            await trio.lowlevel.checkpoint()
            return
        self._task = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED


#: Arena buffers of calls given up on connections that closed before their answers came: a server may write into
#: them until it notices the close, so they are never reused (rare: a call given up, then its connection lost).
_ABANDONED_REPLIES: list[Any] = []


class _RdmaNotMoved(KvfsError):
    """The server could not move a request's data by RDMA and did not run the handler: resend over TCP."""


class Connection:
    """A client's multiplexed connection to one server."""

    def __init__(self, sock: trio.socket.SocketType, reader: FrameReader, address: str, signer: Signer,
                 limits: Limits, *, shared_memory: bool = False) -> None:
        """``reader`` and ``signer``: what the handshake (:func:`authenticate_client`) left for this socket."""
        self.address = address
        self._sock = sock
        self._reader = reader
        self._signer = signer
        self._limits = limits
        self._writer = _Writer(sock, signer)
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._closed: BaseException | None = None
        self._going_away = False  # the server sent GOAWAY: no new calls on this connection
        self._cancel = trio.CancelScope()
        self._timer_due = math.inf  # when the timer next looks for calls past their deadline
        self._timer_wake = trio.Event()  # a call's deadline comes before that
        #: What the handshakes negotiated: how this connection's data sections travel besides TCP.
        self.links = ClientLinks(address, self.call, shared_memory=shared_memory)
        self._held: dict[int, list[Slab]] = {}  # slabs the server may still touch, by request id
        #: arena buffers of calls given up before their answer, which the server may still write: out of the pool
        #: until the late answer arrives
        self._held_replies: dict[int, Any] = {}

    @property
    def transport(self) -> str:
        """``"rdma"`` while bulk data to this server moves by RDMA, else ``"tcp"``."""
        return self.links.transport

    @property
    def shared_memory(self) -> bool:
        """Lent data sections to this server go through shared memory (the server mapped this process's arena)."""
        return self.links.shared_memory

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def peer_gone(self) -> bool:
        """True if an idle connection's peer has already hung up (e.g. the server was restarted).

        Checked before reusing an idle connection so that a non-idempotent call is not sent into a socket
        that is known to be dead, where its failure would be ambiguous.
        """
        if self._closed is not None or self._going_away:
            return True
        if self._pending:
            return False  # the reader owns the socket's input while answers are due
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN | select.POLLRDHUP)
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the reader and writer until the connection breaks or :meth:`close` is called."""
        try:
            with self._cancel:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._run_writer)
                    nursery.start_soon(self._run_timer)
                    task_status.started()
                    await self._run_reader()
        finally:
            self._fail_pending(ConnectionLost(f"connection to {self.address} closed"))
            self._writer.close()
            self._close_rdma()
            self._sock.close()

    def _close_rdma(self) -> None:
        """Destroy the queue pair first: only then can no server operation touch the held slabs any more."""
        self.links.close()
        # the server may still write an abandoned call's answer into these until it notices the close, which this
        # side cannot see: they never go back to the pool
        _ABANDONED_REPLIES.extend(self._held_replies.values())
        self._held_replies.clear()
        held, self._held = self._held, {}
        for slabs in held.values():
            for slab in slabs:
                slab.release()

    async def _run_reader(self) -> None:
        try:
            await self._read_loop()
        except _EndOfStream:
            if self._going_away:  # the server answered all it read before closing: the rest never ran
                self._fail_pending(ServiceUnavailable(f"{self.address} shut down before reading the call"))
            else:
                self._fail_pending(ConnectionLost(f"{self.address} closed the connection"))
        except KvfsError as exc:
            self._fail_pending(exc)
        except (OSError, trio.ClosedResourceError) as exc:
            self._fail_pending(ConnectionLost(f"{self.address}: {exc}"))

    async def _run_writer(self) -> None:
        try:
            await self._writer.run()
        except OSError as exc:
            self._fail_pending(ConnectionLost(f"sending to {self.address} failed: {exc}"))

    async def _run_timer(self) -> None:
        """Fail the calls past their ``deadline`` (see :meth:`call`). It sleeps until the earliest deadline it saw
        and is woken only by a call due before that, which with one timeout per client is rare: a call's
        deadline costs a comparison, where a cancel scope per call was a good part of a small call's CPU."""
        while True:
            now, due = trio.current_time(), math.inf
            for pending in list(self._pending.values()):
                if pending.deadline <= now:
                    pending.finish(RpcTimeout(f"{pending.method.name} to {self.address} passed its deadline"))
                elif pending.deadline < due:
                    due = pending.deadline
            self._timer_due = due
            with trio.move_on_at(due):
                await self._timer_wake.wait()
            self._timer_wake = trio.Event()

    def _fail_pending(self, reason: BaseException) -> None:
        """Mark the connection dead and wake every caller still waiting on it."""
        if self._closed is None:
            self._closed = reason
        self._cancel.cancel()
        for pending in self._pending.values():
            pending.finish(self._closed)
            if pending.reply is not None:  # unanswered: the server may still write into it (see _close_rdma)
                _ABANDONED_REPLIES.append(pending.reply)
        self._pending.clear()

    def close(self) -> None:
        self._fail_pending(ConnectionLost(f"connection to {self.address} closed by this side"))

    async def _read_loop(self) -> None:
        reader = self._reader
        while True:
            try:
                header, body = await _read_frame(reader, self._limits, self._signer)
            except AuthError as exc:
                log.warning("closing connection to %s: %s", self.address, exc.message)
                raise
            flags = header.flags  # most frames have none: Flag membership tests cost ~0.5 us each, so skip them
            if flags and wire.Flags.GOAWAY in flags:
                self._going_away = True  # answers to what we sent still come; nothing new goes out here
                continue
            pending = self._pending.pop(header.request_id, None)
            if flags and wire.Flags.AUTH_REFUSED in flags:
                err = wire.decode_error(body)
                raise AuthError(f"{self.address} refused us: {err.message}")
            if pending is None:  # the caller gave up (deadline); drop the late answer
                if self._held:
                    self._release_held(header.request_id)
                self._held_replies.pop(header.request_id, None)
                await reader.discard(header.data_len)
                continue
            try:
                if flags and wire.Flags.SHM_REPLY in flags:
                    self._shm_answer(header, body, pending)
                elif flags and wire.Flags.RDMA in flags:
                    self._rdma_answer(header, body, pending)
                elif header.type is FrameType.ERROR:
                    err = wire.decode_error(body)
                    pending.error = from_wire(err.errno, err.message)
                elif header.type is FrameType.RESPONSE:
                    pending.response = wire.decode_body(pending.method.response, body)
                else:
                    raise ProtocolError(f"server sent a {header.type.name} frame")
            except ProtocolError as exc:
                pending.finish(exc)
                raise
            if header.data_len:
                target = pending.into
                if target is None or len(target) < header.data_len:
                    target = RECEIVED.view(header.data_len)
                else:
                    target = target[: header.data_len]
                await reader.read_into(target)
                pending.data = target
            if self._held:
                self._release_held(header.request_id)
            pending.finish()

    def _rdma_answer(self, header: wire.Header, body: memoryview | bytes, pending: _Pending) -> None:
        """A flagged answer: an RDMA-ERROR (handler not run), or a response whose data the server RDMA-WROTE."""
        if header.type is FrameType.ERROR:
            err = wire.decode_error(body)
            pending.error = _RdmaNotMoved(err.message, err.errno)
            return
        if header.type is not FrameType.RESPONSE:
            raise ProtocolError(f"server sent a {header.type.name} frame")
        if (pending.dst is None and pending.direct is None) or pending.into is None:
            raise ProtocolError("RDMA response to a request that offered no RDMA destination")
        if header.data_len:
            raise ProtocolError("RDMA response also carries a TCP data section")
        body, written = rdma.split_response(body, pending.offered)
        pending.response = wire.decode_body(pending.method.response, body)
        if pending.direct is not None:
            pending.direct.written = written  # already where the caller wants it: nothing to copy
        elif written:
            target = pending.into[:written]
            target[:] = pending.dst.view[:written]  # the WRITE completed before the server sent this frame
            pending.data = target

    def _shm_answer(self, header: wire.Header, body: memoryview | bytes, pending: _Pending) -> None:
        """A response whose data section the server wrote into the arena buffer the call named: one copy from
        there into the caller's buffer (the arena buffer cannot be the caller's own: a call given up may still be
        written into, see kvfs/transport/README.md)."""
        if header.type is not FrameType.RESPONSE or header.data_len:
            raise ProtocolError("a shared-memory answer must be a RESPONSE without a TCP data section")
        body, offset, length = shm.split_trailer(body, self._limits.max_data)
        if pending.reply is None or pending.into is None or offset != pending.reply_offset or length > len(pending.into):
            raise ProtocolError(f"shared-memory answer at [{offset}, +{length}) is not where the call asked")
        pending.response = wire.decode_body(pending.method.response, body)
        target = pending.into[:length]
        target[:] = memoryview(pending.reply)[:length]
        pending.data = target

    def _release_held(self, request_id: int) -> None:
        for slab in self._held.pop(request_id, ()):
            slab.release()

    def _outgoing(self, data: Buffer | Sequence[Buffer] | None) -> tuple[list[Buffer], int]:
        """The data section's buffers and length, once this connection may send a new request at all."""
        if self._going_away:
            raise ServiceUnavailable(f"{self.address} is shutting down; request not sent")
        if self._closed is not None:
            raise ConnectionLost(f"connection to {self.address} is closed: {self._closed}")
        buffers, data_len = _data_buffers(data)
        if data_len > self._limits.max_data:
            raise KvfsError(f"data section of {data_len} bytes exceeds the limit", errno.EMSGSIZE)
        return buffers, data_len

    async def call(
        self,
        method: Method,
        request: msgspec.Struct,
        *,
        data: Buffer | Sequence[Buffer] | None = None,
        into: memoryview | DirectInto | None = None,
        lend: bool = False,
        deadline: float = math.inf,
    ) -> tuple[Any, memoryview | None]:
        """Send one request and wait for its answer. The deadline is the caller's cancel scope, or ``deadline`` (trio
        time): past it the connection's timer fails the call with RpcTimeout, which costs a call less than a cancel
        scope of its own would. ``deadline`` bounds the wait for the answer and for a full socket to take the request,
        nothing before that, so it suits calls that have nothing to negotiate (no data section).

        ``lend``: ``data`` stays unchanged until the answer arrives and carries its own checksum, so a server on
        this host may copy it straight out of this process's shared memory (:mod:`kvfs.transport.shm`).
        ``into`` a :class:`DirectInto`: over an RDMA link the server writes the answer's data straight into the
        caller's registered region (``into.written`` says so afterwards); otherwise it lands in ``into.staging``."""
        direct = None
        if isinstance(into, DirectInto):
            direct, into = into, into.staging
            direct.written = 0
        buffers, data_len = self._outgoing(data)
        request_id = next(self._ids)
        body, flags = wire.encode_body(request), wire.Flags.NONE
        if lend:
            body, buffers, data_len, flags = await self.links.share_lent(lend, body, buffers, data_len, flags)
        shared = bool(flags)  # the data section lies in shared memory (the only flag set so far)
        if not shared and (
            planned := self.links.rdma_plan(data_len, None if into is None else len(into))
        ) is not None:
            answer = await self._call_rdma(*planned, method, body, buffers, data_len, into, direct)
            if answer is not None:
                return answer
            # no slab free, or the server could not move the data: this call goes over TCP
        pending = _Pending(method, into, deadline)
        if into is not None and not shared and (reply := await self.links.reply_buffer(len(into))):
            pending.reply, pending.reply_offset = reply
            body += shm.encode_trailer(pending.reply_offset, len(into))
            flags |= wire.Flags.SHM_REPLY
        frame = wire.encode_frame(FrameType.REQUEST, request_id, method.id, body, data_len, flags)
        batch = bool(self._pending)  # other calls in flight: their callers are likely sending too
        self._pending[request_id] = pending
        if deadline < self._timer_due:
            self._timer_wake.set()
        try:
            await self._writer.put([frame, *buffers], batch=batch, deadline=deadline)
            await pending.wait()
        finally:
            if self._pending.pop(request_id, None) is not None and pending.reply is not None:
                self._held_replies[request_id] = pending.reply  # given up: the server may still write into it
        if pending.error is not None:
            raise pending.error
        return pending.response, pending.data

    async def send(self, method: Method, request: msgspec.Struct, *, data: Buffer | Sequence[Buffer] | None = None,
                   lend: bool = False) -> None:
        """Send one request that is not answered (``Flags.ONEWAY``); returns once it is written or queued (once its
        data is in the kernel, for a caller-owned buffer). Never by RDMA, which needs an answer; by shared memory
        when ``lend`` (as for :meth:`call`, the data stays unchanged until the server has handled the message)."""
        buffers, data_len = self._outgoing(data)
        body, buffers, data_len, flags = await self.links.share_lent(
            lend, wire.encode_body(request), buffers, data_len, wire.Flags.ONEWAY)
        frame = wire.encode_frame(FrameType.REQUEST, next(self._ids), method.id, body, data_len, flags)
        await self._writer.put([frame, *buffers])

    async def _call_rdma(
        self,
        link: rdma.RdmaLink,
        plan: rdma.CallPlan,
        method: Method,
        body: bytes,
        buffers: list[Buffer],
        data_len: int,
        into: memoryview | None,
        direct: DirectInto | None = None,
    ) -> tuple[Any, memoryview | None] | None:
        """One call whose data sections move by RDMA; None when it must be sent over TCP instead. ``direct``: the
        answer's data may be written into the caller's region, where this link's domain registered it."""
        with contextlib.nullcontext() if direct is None else direct.region.hold():
            held: list[Slab] = []
            src = dst = None
            dst_slab = None
            if direct is not None and plan.receive:
                dst = link.direct(direct)
            if dst is None:
                direct = None  # the answer goes to a slab, or over TCP, and from there into ``into`` (its staging)
            try:
                if plan.send:
                    slab, src = link.stage(buffers, data_len)
                    held.append(slab)
            except BufferExhausted:
                pass
            try:
                if plan.receive and dst is None:
                    assert into is not None
                    dst_slab, dst = link.reserve(len(into))
                    held.append(dst_slab)
            except BufferExhausted:
                pass
            if src is None and dst is None:
                return None
            tcp_buffers, tcp_len = ([], 0) if src is not None else (buffers, data_len)
            request_id = next(self._ids)
            body += rdma.encode_request_trailer(src, dst)
            frame = wire.encode_frame(FrameType.REQUEST, request_id, method.id, body, tcp_len, wire.Flags.RDMA)
            pending = _Pending(method, into, dst=dst_slab, direct=direct, offered=0 if dst is None else dst.length)
            self._pending[request_id] = pending
            self._held[request_id] = held
            sent = False
            try:
                await self._writer.put([frame, *tcp_buffers])
                sent = True
                await pending.wait()
            finally:
                given_up = self._pending.pop(request_id, None) is not None
                if not sent:  # the server never saw the descriptors
                    self._release_held(request_id)
                # else: released when the answer arrives (late or not) or the connection closes
                elif direct is not None and (given_up or self._closed is not None):
                    self._abandon_direct(link, method)
            error = pending.error
            if error is None:
                return pending.response, pending.data
            if not isinstance(error, _RdmaNotMoved):
                raise error
            if error.errno not in rdma.TRANSIENT_ERRNOS:
                self._rdma_failed(link, f"{self.address} could not RDMA-READ a request's data: {error.message}")
            return None

    def _abandon_direct(self, link: rdma.RdmaLink, method: Method) -> None:
        """A call that named the caller's own region ended without its answer (given up, or its connection lost):
        the server could still WRITE into memory the caller is about to reuse or retry into. Destroying the queue
        pair now, before this returns to the caller, makes that impossible (the queue pair would otherwise go only
        when the connection's tasks finish); the connection goes with it and the next call connects afresh."""
        link.fail(f"a {method.name} call naming a caller's registered region ended without its answer")
        self.close()

    def _rdma_failed(self, link: rdma.RdmaLink, reason: str) -> None:
        """Leave RDMA for this connection (auto), or close it and fail the call (forced ``rdma``)."""
        try:
            self.links.leave_rdma(link, reason)
        except RdmaError:
            self.close()
            raise


class RpcClient(TransportChoice):
    """Connections to any number of servers, one multiplexed connection per address, in one nursery.

    Use as ``async with RpcClient(token) as client:``; every connection's tasks live and die inside it.
    Calls to methods marked idempotent are retried (with backoff, on a fresh connection) when the
    connection breaks or the deadline passes; others fail with the error so the caller can decide.

    ``transport`` (``auto``/``tcp``/``rdma``; default ``$KVFS_TRANSPORT``, else ``auto``) says whether bulk data
    may move by RDMA; ``rdma`` on a host without a usable device raises RdmaUnavailable here, with the reason.
    ``rdma_factory`` makes the RDMA endpoints (the real verbs one by default; tests inject fakes).
    ``shared_memory`` (default ``$KVFS_SHM``, else on) lets lent data go through shared memory to servers on
    this host.
    """

    def __init__(
        self,
        token: bytes | str,
        *,
        limits: Limits = Limits(),
        connect_timeout: float = 5.0,
        call_timeout: float = 30.0,
        retries: int = 3,
        transport: TransportMode | str | None = None,
        rdma_factory: rdma.EndpointFactory | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        super().__init__(transport, rdma_factory)
        self.shared_memory = shm.resolve_enabled(shared_memory)
        self._token = auth.token_key(token)
        self._limits = limits
        self._connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self._retries = retries
        self._connections: dict[str, Connection] = {}
        self._connecting: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        self._exit_stack: Any = None

    async def __aenter__(self) -> RpcClient:
        self._exit_stack = trio.open_nursery()
        self._nursery = await self._exit_stack.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        self.close()
        assert self._exit_stack is not None
        try:
            return await self._exit_stack.__aexit__(*exc_info)
        except BaseExceptionGroup as group:
            # The nursery wraps whatever the body raised; callers of a client expect the error itself.
            if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
                raise group.exceptions[0] from None
            raise

    def close(self) -> None:
        for conn in list(self._connections.values()):
            conn.close()
        self._connections.clear()

    async def connection(self, address: str, *, check_peer: bool = True) -> Connection:
        """The open connection to ``address``, or a new one. ``check_peer`` first asks the kernel whether an
        idle connection's peer already hung up (a syscall; callers that can retry skip it)."""
        conn = self._connections.get(address)
        if conn is not None:
            if not (conn.closed or check_peer and conn.peer_gone()):
                return conn
            conn.close()
        if self._nursery is None:
            raise RuntimeError("RpcClient is used outside its 'async with' block")
        lock = self._connecting.setdefault(address, trio.Lock())
        async with lock:
            conn = self._connections.get(address)
            if conn is None or conn.closed:
                sock, reader, signer = await self._open(address)
                conn = Connection(sock, reader, address, signer, self._limits, shared_memory=self.shared_memory)
                await self._nursery.start(conn.run)
                if self.transport is not TransportMode.TCP:
                    try:
                        await conn.links.offer_rdma(self)
                    except BaseException:
                        conn.close()
                        raise
                self._connections[address] = conn
        return conn

    async def _open(self, address: str) -> tuple[trio.socket.SocketType, FrameReader, Signer]:
        """Connect and authenticate, both within the connect timeout."""
        try:
            sock = await _connect(address, self._connect_timeout)
        except OSError as exc:
            raise ServiceUnavailable(f"cannot connect to {address}: {exc.strerror or exc}") from None
        reader = FrameReader(sock)
        try:
            with trio.fail_after(self._connect_timeout):
                signer = await authenticate_client(reader, functools.partial(send_all, sock), address, self._token)
        except trio.TooSlowError:
            sock.close()
            raise ServiceUnavailable(f"{address} did not finish the authentication handshake within"
                                     f" {self._connect_timeout:g}s") from None
        except KvfsError:  # refused, or not a kvfs server (KvfsError is an OSError: first)
            sock.close()
            raise
        except (_EndOfStream, OSError) as exc:
            sock.close()
            raise ConnectionLost(f"{address} closed the connection during the authentication handshake"
                                 + (f": {exc}" if isinstance(exc, OSError) else " (a kvfs before protocol"
                                    f" {wire.PROTOCOL_VERSION} closes so)")) from None
        except BaseException:
            sock.close()
            raise
        return sock, reader, signer

    async def call(
        self,
        address: str,
        method: Method,
        request: msgspec.Struct,
        *,
        data: Buffer | Sequence[Buffer] | None = None,
        timeout: float | None = None,
        lend: bool = False,
    ) -> Any:
        """Call ``method`` at ``address`` and return its response body (``lend``: see :meth:`Connection.call`)."""
        response, _ = await self.call_with_data(address, method, request, data=data, timeout=timeout, lend=lend)
        return response

    async def call_with_data(
        self,
        address: str,
        method: Method,
        request: msgspec.Struct,
        *,
        data: Buffer | Sequence[Buffer] | None = None,
        into: memoryview | DirectInto | None = None,
        timeout: float | None = None,
        lend: bool = False,
    ) -> tuple[Any, memoryview | None]:
        """Call ``method``; the response's data section lands in ``into`` when it is large enough."""
        attempts = 1 + (self._retries if method.idempotent else 0)
        deadline = self.call_timeout if timeout is None else timeout
        # No data section: nothing to negotiate before sending, so the connection's timer can keep the deadline.
        small = data is None and into is None and not lend
        for attempt in range(attempts):
            conn = self._connections.get(address) if small else None
            if conn is not None and not (conn.closed or not method.idempotent and conn.peer_gone()):
                try:
                    return await conn.call(method, request, deadline=trio.current_time() + deadline)
                except (ConnectionLost, ServiceUnavailable) as exc:
                    error: KvfsError = exc
                except RpcTimeout:
                    error = RpcTimeout(f"{method.name} to {address} took longer than {deadline:g}s")
            else:  # connecting, or a data section: one cancel scope bounds it all
                with trio.CancelScope(deadline=trio.current_time() + deadline) as scope:
                    try:
                        conn = await self.connection(address, check_peer=not method.idempotent)
                        return await conn.call(method, request, data=data, into=into, lend=lend)
                    except (ConnectionLost, ServiceUnavailable) as exc:
                        error = exc
                if scope.cancelled_caught:
                    error = RpcTimeout(f"{method.name} to {address} took longer than {deadline:g}s")
            if attempt + 1 < attempts:
                await trio.sleep(min(0.05 * 2**attempt, 1.0))
        raise error

    async def send(self, address: str, method: Method, request: msgspec.Struct, *,
                   data: Buffer | Sequence[Buffer] | None = None, timeout: float | None = None,
                   lend: bool = False) -> None:
        """Send ``method`` at ``address`` without waiting for (or getting) an answer: a one-way message whose loss
        the caller repairs itself. Not retried; ``timeout`` bounds connecting and handing the bytes to the kernel."""
        deadline = self.call_timeout if timeout is None else timeout
        try:
            with trio.fail_after(deadline):
                conn = await self.connection(address, check_peer=False)
                await conn.send(method, request, data=data, lend=lend)
        except trio.TooSlowError:
            raise RpcTimeout(f"sending {method.name} to {address} took longer than {deadline:g}s") from None


# --------------------------------------------------------------------------------------------- server


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a handler knows about the call besides its body."""

    peer: str
    method: Method
    connection: PeerConnection | None = field(default=None, repr=False, compare=False)
    _after_reply: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False, compare=False)

    def after_reply(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the reply's bytes are in the kernel (or the call ended without one): for a handler
        that answers with a view of memory it must keep unchanged until then (``ChunkEngine.lend``)."""
        self._after_reply.append(fn)


class RpcServer(TransportChoice):
    """Serves registered handlers on one TCP port; every connection runs in the server's nursery.

    ``transport`` (``auto``/``tcp``/``rdma``; default ``$KVFS_TRANSPORT``, else ``auto``) says whether this server
    accepts clients' RDMA offers; ``rdma`` on a host without a usable device raises RdmaUnavailable here. The
    ``RDMA_CONNECT`` handler is built in (unless one is registered) and refuses when this side cannot do RDMA.
    ``shared_memory`` (default ``$KVFS_SHM``, else on): whether it maps same-host clients' arenas
    (``SHM_CONNECT``, built in too) to copy lent data out of them.
    """

    #: After GOAWAY, how long connections keep answering calls that were already on their way.
    GOAWAY_LINGER = 0.5
    #: How long a new connection may take to authenticate before it is closed (a silent peer holds nothing).
    HANDSHAKE_TIMEOUT = 10.0

    def __init__(
        self,
        token: bytes | str,
        *,
        limits: Limits = Limits(),
        max_in_flight: int = 1024,
        name: str = "rpc",
        transport: TransportMode | str | None = None,
        rdma_factory: rdma.EndpointFactory | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        super().__init__(transport, rdma_factory)
        self.shared_memory = shm.resolve_enabled(shared_memory)
        self._token = auth.token_key(token)
        self._limits = limits
        self._max_in_flight = max_in_flight
        self._handlers: dict[int, tuple[Method, Handler]] = {}
        self._inline: set[int] = set()
        self.log = logging.getLogger(f"kvfs.{name}")
        self.port: int | None = None
        self.connections_refused = 0
        self.peers: set[PeerConnection] = set()
        self._accepting: trio.CancelScope | None = None
        self._writers: set[_Writer] = set()  # one per open connection, to say GOAWAY
        self._draining = False
        self._running = 0  # handlers in progress
        self._idle = trio.Event()

    async def _rdma_connect(self, offer: RdmaOffer, data: memoryview | None, ctx: CallContext) -> RdmaAccept:
        """The built-in RDMA handshake (:func:`kvfs.transport.negotiate.accept_rdma`) for the caller's connection."""
        assert ctx.connection is not None
        return negotiate.accept_rdma(self, offer, ctx.connection, self.log)

    async def _shm_connect(self, offer: shm.ShmOffer, data: memoryview | None, ctx: CallContext) -> shm.ShmAccept:
        """The built-in shared-memory handshake (:func:`kvfs.transport.negotiate.accept_shm`) for the caller's
        connection."""
        assert ctx.connection is not None
        return negotiate.accept_shm(self.shared_memory, offer, ctx.connection, self.log)

    def register(self, method: Method, handler: Handler, *, inline: bool = False) -> None:
        """Serve ``method`` with ``handler``. An ``inline`` handler runs in the connection's reader task instead
        of a task of its own, which saves a task start and a scheduler pass per call; only for handlers that
        never wait on anything slow, since the connection reads nothing else while one runs."""
        if method.id in self._handlers:
            raise ValueError(f"{method.name} already has a handler")
        self._handlers[method.id] = (method, handler)
        if inline:
            self._inline.add(method.id)

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled; ``nursery.start`` returns the bound port."""
        if RDMA_CONNECT.id not in self._handlers:
            self._handlers[RDMA_CONNECT.id] = (RDMA_CONNECT, self._rdma_connect)
        if shm.SHM_CONNECT.id not in self._handlers:  # inline: the lent frames that follow find the mapping
            self._handlers[shm.SHM_CONNECT.id] = (shm.SHM_CONNECT, self._shm_connect)
            self._inline.add(shm.SHM_CONNECT.id)
        self.note_tcp_only()
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as self._accepting:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(self._accept_loop, listener, nursery)
                    task_status.started(self.port)

    async def drain(self, grace: float) -> None:
        """Stop gracefully: accept no new connections, refuse calls that arrive from now on with ESHUTDOWN (they
        did not run, so any client may send them elsewhere), and wait up to ``grace`` seconds for the handlers
        already running, so a restart never leaves a caller unsure whether its call happened."""
        self._draining = True
        if self._accepting is not None:
            self._accepting.cancel()
        with trio.move_on_after(grace):
            while self._running:
                await self._idle.wait()
        # Tell every client to stop sending here, then keep answering (ESHUTDOWN) what was already on its way, so
        # closing never resets a connection with an unread call in it (the client could not know it never ran).
        body = wire.encode_body(wire.ErrorBody(errno.ESHUTDOWN, f"{self.log.name} is shutting down"))
        goaway = wire.encode_frame(FrameType.ERROR, 0, 0, body, flags=wire.Flags.GOAWAY)
        for writer in list(self._writers):
            with contextlib.suppress(ConnectionLost):  # sealed per connection; untagged mid-handshake
                await writer.put([goaway])
        await trio.sleep(self.GOAWAY_LINGER)

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept until :meth:`drain`; connections live in the server's nursery, so they outlive accepting."""
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:  # EMFILE and friends: back off instead of spinning
                    self.log.warning("accept failed: %s", exc)
                    await trio.sleep(0.1)
                    continue
                nursery.start_soon(self._serve_connection, stream.socket)

    async def _serve_connection(self, sock: trio.socket.SocketType) -> None:
        try:
            peer = "%s:%s" % sock.getpeername()[:2]
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            return
        writer = _Writer(sock)
        self._writers.add(writer)
        limiter = trio.CapacityLimiter(self._max_in_flight)
        conn = PeerConnection(peer)
        self.peers.add(conn)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_writer, writer, peer, nursery.cancel_scope)
                try:
                    reader = FrameReader(sock)
                    with trio.fail_after(self.HANDSHAKE_TIMEOUT):
                        signer = await authenticate_server(reader, lambda f: writer.put([f]), peer, self._token)
                    writer.signer = signer  # every frame from here on is tagged
                    await self._read_requests(reader, signer, peer, writer, limiter, nursery, conn)
                except _EndOfStream:
                    pass
                except trio.TooSlowError:
                    self.log.warning("closing connection from %s: no authentication handshake within %gs", peer,
                                     self.HANDSHAKE_TIMEOUT)
                except AuthError as exc:
                    self.connections_refused += 1
                    self.log.warning("refusing %s: %s", peer, exc)
                    await self._refuse(writer, exc)
                except ProtocolError as exc:
                    self.log.warning("closing connection from %s: %s", peer, exc.message)
                except OSError as exc:
                    self.log.info("connection from %s broke: %s", peer, exc)
                except Exception:  # a bug must cost one connection, never the server
                    self.log.exception("closing connection from %s after an internal error", peer)
                nursery.cancel_scope.cancel()
        finally:
            self._writers.discard(writer)
            self.peers.discard(conn)
            conn.close()
            writer.close()
            sock.close()

    async def _run_writer(self, writer: _Writer, peer: str, scope: trio.CancelScope) -> None:
        try:
            await writer.run()
        except OSError as exc:
            self.log.info("sending to %s failed: %s", peer, exc)
            scope.cancel()

    async def _refuse(self, writer: _Writer, exc: AuthError) -> None:
        """Tell an unauthenticated peer why it is refused, in the one frame it can read without the token."""
        body = wire.encode_body(wire.ErrorBody(exc.errno, exc.message))
        frame = wire.encode_frame(FrameType.ERROR, 0, 0, body, flags=wire.Flags.AUTH_REFUSED)
        with trio.move_on_after(1), contextlib.suppress(ConnectionLost):
            await writer.put([frame], seal=False)
            writer.close()
            await trio.sleep(0.05)  # let the writer flush before the socket closes

    async def _read_requests(
        self,
        reader: FrameReader,
        signer: Signer,
        peer: str,
        writer: _Writer,
        limiter: trio.CapacityLimiter,
        nursery: trio.Nursery,
        conn: PeerConnection,
    ) -> None:
        while True:
            header, body = await _read_frame(reader, self._limits, signer)
            if header.type is not FrameType.REQUEST:
                raise ProtocolError(f"client sent a {header.type.name} frame")
            flags = header.flags  # most requests have none: skip the Flag tests (~0.5 us each)
            oneway = bool(flags) and wire.Flags.ONEWAY in flags
            if oneway and wire.Flags.RDMA in flags:
                raise ProtocolError("a one-way request cannot move its data by RDMA")
            buffers = None
            shared = 0  # length of a data section in the client's arena
            reply_to = None  # (offset, capacity) of the client's arena buffer for the answer's data section
            if flags:
                if wire.Flags.SHM_REPLY in flags:
                    if conn.shm is None or oneway or flags & (wire.Flags.SHM | wire.Flags.RDMA):
                        raise ProtocolError("a shared-memory answer asked without a mapped arena, or with another"
                                            " trailer")
                    body, *reply_to = shm.split_trailer(body, self._limits.max_data)
                if wire.Flags.SHM in flags:
                    if header.data_len or wire.Flags.RDMA in flags:
                        raise ProtocolError("a shared-memory request also carries a TCP or RDMA data section")
                    body, offset, shared = shm.split_trailer(body, self._limits.max_data)
                elif wire.Flags.RDMA in flags:  # data by RDMA: descriptors of the client's slabs end the body
                    body, src, dst = rdma.split_request(body, self._limits.max_data)
                    if src is not None and header.data_len:
                        raise ProtocolError("request has both an RDMA source and a TCP data section")
                    buffers = (src, dst)
            entry = self._handlers.get(header.method)
            request: Any = None
            failure: KvfsError | None = None
            if self._draining:
                failure = ServiceUnavailable(f"{self.log.name} is shutting down; call not run", errno.ESHUTDOWN)
            elif entry is None:
                failure = KvfsError(f"unknown method id {header.method}", errno.ENOSYS)
            else:
                try:  # decode before the data section arrives: the body is a view into the read buffer
                    request = wire.decode_body(entry[0].request, body)
                except ProtocolError as exc:
                    failure = exc
            data = None
            if header.data_len:
                data = memoryview(RECEIVED.take(header.data_len))
                await reader.read_into(data)
            elif shared:
                if conn.shm is None:
                    raise ProtocolError("shared-memory data section from a client whose arena is not mapped")
                data = shm.SHARED.view(shared)  # in our own arena: a handler may lend it on
                conn.shm.copy_out(offset, data)
            args = (writer, peer, header.request_id, entry, request, data, failure, conn, buffers, oneway, reply_to)
            if buffers is None and (failure is not None or header.method in self._inline):
                # Run by this task, which reads nothing more meanwhile: no slot of the limiter needed. More
                # requests already read: their replies join this one in the writer's next writev.
                await self._dispatch(*args, batch=reader.buffered > 0)
            else:
                try:
                    limiter.acquire_on_behalf_of_nowait(header.request_id)
                except trio.WouldBlock:
                    await limiter.acquire_on_behalf_of(header.request_id)
                nursery.start_soon(self._dispatch, *args, limiter)

    async def _dispatch(
        self,
        writer: _Writer,
        peer: str,
        request_id: int,
        entry: tuple[Method, Handler] | None,
        request: Any,
        data: memoryview | None,
        failure: KvfsError | None,
        conn: PeerConnection | None = None,
        buffers: tuple[Any, Any] | None = None,
        oneway: bool = False,
        reply_to: list[int] | None = None,
        limiter: trio.CapacityLimiter | None = None,
        batch: bool = False,
    ) -> None:
        """Run one request's handler and send its answer; ``limiter``: the slot a call in a task of its own holds."""
        ctx: CallContext | None = None
        delivered = False  # the reply is in the kernel, or there is none to send
        try:
            frames: list[Buffer]
            if buffers is not None and buffers[0] is not None and failure is None:
                assert conn is not None
                try:
                    data = await conn.pull(buffers[0])
                except KvfsError as exc:  # the handler does not run; the client resends over TCP
                    self.log.info("RDMA-READ from %s failed: %s", peer, exc.message)
                    body = wire.encode_body(wire.ErrorBody(exc.errno or errno.EIO, exc.message))
                    frame = wire.encode_frame(FrameType.ERROR, request_id, 0, body, 0, wire.Flags.RDMA)
                    with contextlib.suppress(ConnectionLost):
                        await writer.put([frame])
                    return
            if failure is None:
                assert entry is not None
                method, handler = entry
                started = trio.current_time()
                self._running += 1
                try:
                    ctx = CallContext(peer, method, conn)
                    result = await handler(request, data, ctx)
                    if oneway:
                        frames = []
                    elif buffers is not None and buffers[1] is not None:
                        assert conn is not None
                        frames = await self._rdma_response(conn, request_id, method, result, buffers[1])
                    elif reply_to is not None:
                        assert conn is not None and conn.shm is not None
                        frames = self._shm_response(conn.shm, request_id, method, result, *reply_to)
                    else:
                        frames = self._response(request_id, method, result)
                except KvfsError as exc:
                    failure = exc
                except Exception as exc:
                    self.log.exception("%s from %s failed", method.name, peer)
                    failure = KvfsError(f"internal error in {method.name}: {type(exc).__name__}: {exc}", errno.EIO)
                finally:
                    self._running -= 1
                    if not self._running and self._draining:  # only drain() waits for it
                        self._idle.set()
                        self._idle = trio.Event()
                _call_timer(method.name).observe(trio.current_time() - started)
                _call_counter(method.name, failure.errno if failure else 0).inc()
            if oneway:
                delivered = True
                if failure is not None:
                    self.log.debug("one-way %s from %s failed: %s", entry[0].name if entry else "call", peer,
                                   failure.message)
                return
            if failure is not None:
                body = wire.encode_body(wire.ErrorBody(failure.errno or errno.EIO, failure.message))
                frames = [wire.encode_frame(FrameType.ERROR, request_id, 0, body)]
            try:
                await writer.put(frames, batch=batch)
            except ConnectionLost:
                pass
            delivered = True
        finally:
            if limiter is not None:
                limiter.release_on_behalf_of(request_id)
            if ctx is not None and ctx._after_reply:
                self._after_reply(ctx, delivered or writer.stopped)

    def _after_reply(self, ctx: CallContext, done: bool) -> None:
        """Run the handler's after-reply calls, unless the reply may still be sent from the memory they free (a
        cancelled send left it queued on a live connection): then they never run, and what they would free stays
        held, which is safe."""
        if not done:
            self.log.warning("%s to %s: reply still queued after its call ended; its buffers stay held",
                             ctx.method.name, ctx.peer)
            return
        for fn in ctx._after_reply:
            try:
                fn()
            except Exception:
                self.log.exception("after-reply call of %s failed", ctx.method.name)

    def _response(self, request_id: int, method: Method, result: HandlerResult) -> list[Buffer]:
        if isinstance(result, tuple):
            message, data = result
        else:
            message, data = result, None
        buffers, data_len = _data_buffers(data)
        body = wire.encode_body(message)
        return [wire.encode_frame(FrameType.RESPONSE, request_id, method.id, body, data_len), *buffers]

    def _shm_response(self, arena: shm.PeerArena, request_id: int, method: Method, result: HandlerResult,
                      offset: int, capacity: int) -> list[Buffer]:
        """Write the data section into the client's arena buffer it named (then answer with where), or fall back to
        the TCP response where there is none or it does not fit."""
        if not isinstance(result, tuple):
            return self._response(request_id, method, result)
        message, data = result
        buffers, data_len = _data_buffers(data)
        if not 0 < data_len <= capacity:
            return self._response(request_id, method, result)
        arena.copy_in(offset, capacity, buffers)
        body = wire.encode_body(message) + shm.encode_trailer(offset, data_len)
        return [wire.encode_frame(FrameType.RESPONSE, request_id, method.id, body, 0, wire.Flags.SHM_REPLY)]

    async def _rdma_response(
        self, conn: PeerConnection, request_id: int, method: Method, result: HandlerResult, dst: Any
    ) -> list[Buffer]:
        """RDMA-WRITE the data section into the client's ``dst`` (then answer), or fall back to the TCP response."""
        if not isinstance(result, tuple) or conn.rdma is None:
            return self._response(request_id, method, result)
        message, data = result
        buffers, data_len = _data_buffers(data)
        if not await conn.rdma.push(buffers, data_len, dst):
            return self._response(request_id, method, result)
        body = wire.encode_body(message) + rdma.encode_response_trailer(data_len)
        return [wire.encode_frame(FrameType.RESPONSE, request_id, method.id, body, 0, wire.Flags.RDMA)]


__all__ = [
    "CallContext",
    "Connection",
    "PeerConnection",
    "FrameReader",
    "Handler",
    "RpcClient",
    "RpcServer",
    "SendFrame",
    "authenticate_client",
    "authenticate_server",
    "parse_address",
    "send_all",
]
