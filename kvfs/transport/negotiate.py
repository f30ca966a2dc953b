"""Per-connection transport negotiation: which way each connection's data sections travel.

``kvfs.rpc`` frames, multiplexes and dispatches calls; this module holds the handshakes it runs and the state they
leave on a connection, so that the RPC code only asks "how does this data section go" and gets TCP unless a
handshake said otherwise:

* :class:`TransportChoice`: a client's or server's mode (``auto``/``tcp``/``rdma``) and the RDMA endpoint factory,
  resolved at construction so that forced ``rdma`` on a host that cannot do it fails at start-up;
* :class:`ClientLinks`: a client connection's side. After the TCP connect it offers a queue pair
  (``RDMA_CONNECT``, :meth:`ClientLinks.offer_rdma`); the first lent call offers this process's shared-memory
  arena (``SHM_CONNECT``); per call it says whether a lent data section goes by shared memory
  (:meth:`ClientLinks.share_lent`) or which sections go by RDMA (:meth:`ClientLinks.rdma_plan`);
* :class:`PeerConnection`, :func:`accept_rdma`, :func:`accept_shm`: a server connection's side, the built-in
  handshake handlers and the links they install.

A set-up failure leaves that connection on TCP (logged, counted in ``kvfs_rdma_fallbacks``) unless ``rdma`` is
forced, so a connection that negotiated nothing sends exactly the bytes it would without this module.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import msgspec
import prometheus_client
import trio

from kvfs import wire
from kvfs.errors import AuthError, ConnectionLost, KvfsError, ServiceUnavailable
from kvfs.transport import link as rdma
from kvfs.transport import shm
from kvfs.transport.errors import RdmaError, RdmaUnavailable
from kvfs.transport.handshake import RDMA_CONNECT, RdmaAccept, RdmaOffer
from kvfs.transport.select import TransportMode
from kvfs.wire import Method

log = logging.getLogger("kvfs.transport")

RDMA_FALLBACKS = prometheus_client.Counter(
    "kvfs_rdma_fallbacks", "Connections that left (or never reached) RDMA for bulk data", ["stage"]
)

#: A connection's call: one request, answered with its body and data section (``kvfs.rpc.Connection.call``).
Call: TypeAlias = Callable[[Method, msgspec.Struct], Awaitable[tuple[Any, memoryview | None]]]


class TransportChoice:
    """The transport mode of a client or server, and the RDMA endpoint factory it uses when RDMA is on."""

    def __init__(self, transport: TransportMode | str | None, factory: rdma.EndpointFactory | None) -> None:
        """Resolve the mode (``None``: ``$KVFS_TRANSPORT``, else ``auto``); forcing ``rdma`` on a host that cannot do
        it fails here, at start-up. ``factory`` makes the RDMA endpoints (the real verbs one by default)."""
        self.transport = rdma.resolve_mode(transport)
        self._rdma_factory = factory
        if self.transport is TransportMode.RDMA:
            rdma.require_available(self.transport, self.endpoint_factory().detect())

    def endpoint_factory(self) -> rdma.EndpointFactory:
        if self._rdma_factory is None:
            self._rdma_factory = rdma.default_factory()
        return self._rdma_factory

    def note_tcp_only(self) -> None:
        """In ``auto``, log once per process that this host keeps bulk data on TCP, and why."""
        if self.transport is TransportMode.AUTO:
            rdma.note_tcp_only(self.endpoint_factory().detect())


class _SetupFailed(KvfsError):
    pass


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, KvfsError) else f"{type(exc).__name__}: {exc}"


def _close_quietly(endpoint: rdma.Endpoint) -> None:
    try:
        endpoint.close()
    except Exception as exc:
        log.warning("closing an RDMA endpoint: %s", exc)


# --------------------------------------------------------------------------------------------- client


class ClientLinks:
    """A client connection's negotiated transports: its RDMA link (None: bulk data goes over TCP) and whether the
    server maps this process's shared-memory arena. ``call`` is the connection's own call, for the handshakes."""

    def __init__(self, address: str, call: Call, *, shared_memory: bool) -> None:
        self.address = address
        self._call = call
        self.rdma: rdma.RdmaLink | None = None
        self.forced_rdma = False
        self._shm = shared_memory  # lent data may go through this process's arena, if the server maps it
        self._shm_ok: bool | None = None  # the server's answer to SHM_CONNECT; None: not asked yet
        self._shm_replies = False  # and whether it writes answers' data into this process's arena
        self._shm_asking: trio.Event | None = None

    @property
    def transport(self) -> str:
        """``"rdma"`` while bulk data to this server moves by RDMA, else ``"tcp"``."""
        return "rdma" if self.rdma is not None and self.rdma.ready else "tcp"

    @property
    def shared_memory(self) -> bool:
        """Lent data sections to this server go through shared memory (the server mapped this process's arena)."""
        return bool(self._shm_ok)

    async def offer_rdma(self, choice: TransportChoice) -> None:
        """Offer the server a queue pair; any failure leaves this connection's bulk data on TCP (logged), or with
        forced ``rdma`` is an RdmaUnavailable (EOPNOTSUPP)."""
        factory = choice.endpoint_factory()
        local = factory.detect()
        if not local.available:
            rdma.note_tcp_only(local)  # nothing to offer (forced ``rdma`` already failed in the constructor)
            return
        forced = choice.transport is TransportMode.RDMA
        try:
            endpoint = factory.new_endpoint()
        except Exception as exc:
            return self._stay_on_tcp(f"local RDMA set-up failed: {_reason(exc)}", forced)
        try:
            try:
                answer, _ = await self._call(RDMA_CONNECT, endpoint.offer())
            except (ConnectionLost, ServiceUnavailable, AuthError):
                raise
            except KvfsError as exc:  # e.g. ENOSYS from a server that predates RDMA
                raise _SetupFailed(f"RDMA handshake failed: {exc.message}") from None
            if not answer.accepted:
                raise _SetupFailed(f"the server refused RDMA: {answer.reason}")
            assert answer.endpoint is not None
            try:
                endpoint.connect(answer.endpoint)
            except Exception as exc:
                raise _SetupFailed(f"connecting the queue pair failed: {_reason(exc)}") from None
        except _SetupFailed as exc:
            _close_quietly(endpoint)
            return self._stay_on_tcp(exc.message, forced)
        except BaseException:
            _close_quietly(endpoint)
            raise
        self.rdma = rdma.RdmaLink(endpoint, self.address, min_bytes=factory.min_bytes)
        self.forced_rdma = forced
        log.info("bulk data to %s by RDMA", self.address)

    def _stay_on_tcp(self, reason: str, forced: bool) -> None:
        RDMA_FALLBACKS.labels("setup").inc()
        if forced:
            raise RdmaUnavailable(f"transport 'rdma' is forced but {self.address} cannot use it: {reason}",
                                  errno.EOPNOTSUPP)
        log.warning("bulk data to %s over TCP: %s", self.address, reason)

    def rdma_plan(self, data_len: int, into_len: int | None) -> tuple[rdma.RdmaLink, rdma.CallPlan] | None:
        """The link and which of a call's data sections go by RDMA; None when all of it goes over TCP."""
        link = self.rdma
        if link is None or not link.ready:
            return None
        plan = link.plan(data_len, into_len)
        return (link, plan) if plan.rdma else None

    def leave_rdma(self, link: rdma.RdmaLink, reason: str) -> None:
        """Leave RDMA after a failed transfer: later calls go over TCP (logged), or with forced ``rdma`` this raises
        RdmaError and the caller closes the connection."""
        link.fail(reason)
        if self.rdma is link:
            self.rdma = None
        RDMA_FALLBACKS.labels("transfer").inc()
        if self.forced_rdma:
            raise RdmaError(f"transport 'rdma' is forced and RDMA to {self.address} failed: {reason}")
        log.warning("bulk data to %s over TCP from now on: %s", self.address, reason)

    async def share_lent(self, lend: bool, body: bytes, buffers: list[Any], data_len: int, flags: wire.Flags
                         ) -> tuple[bytes, list[Any], int, wire.Flags]:
        """A frame's body, data section and flags, with a lent data section that lies in this process's arena
        replaced by its shared-memory trailer (flag SHM) when the server maps the arena; else unchanged. A section
        of several buffers goes this way when they lie back to back in the arena (a batch's values copied into one
        buffer, or a forward of the pieces of one received section)."""
        if not lend or not self._shm or self._shm_ok is False or not buffers or data_len < shm.SHM_MIN_BYTES:
            return body, buffers, data_len, flags
        arena = shm.PROCESS_ARENA.get()
        if arena is None or (offset := shm.contiguous_offset(arena, buffers)) is None:
            return body, buffers, data_len, flags
        if self._shm_ok is None:
            await self._offer_arena(arena)
        if not self._shm_ok:
            return body, buffers, data_len, flags
        return body + shm.encode_trailer(offset, data_len), [], 0, flags | wire.Flags.SHM

    @property
    def shared_memory_replies(self) -> bool:
        """Answers' data sections from this server are written into this process's arena (``Flags.SHM_REPLY``)."""
        return self._shm_replies

    async def reply_buffer(self, length: int) -> tuple[Any, int] | None:
        """A buffer of this process's arena for an answer's data section of up to ``length`` bytes, and its arena
        offset, when the server writes answers there (``Flags.SHM_REPLY``); else None (the answer comes by TCP).
        Offers the arena first if this connection has not yet."""
        if not self._shm or self._shm_ok is False or length < shm.SHM_MIN_BYTES:
            return None
        arena = shm.PROCESS_ARENA.get()
        if arena is None:
            return None
        if self._shm_ok is None:
            await self._offer_arena(arena)
        if not self._shm_replies:
            return None
        buf = shm.SHARED.take(1 << (length - 1).bit_length())  # pooled sizes are powers of two
        offset = arena.locate(buf)
        return None if offset is None else (buf, offset)

    async def _offer_arena(self, arena: shm.Arena) -> None:
        """Ask the server to map this process's arena; concurrent first calls wait for the one answer."""
        if self._shm_asking is not None:
            await self._shm_asking.wait()
            return
        self._shm_asking = asking = trio.Event()
        try:
            answer, _ = await self._call(shm.SHM_CONNECT, arena.offer())
            self._shm_ok, self._shm_replies = answer.accepted, answer.accepted and answer.replies
            if answer.accepted:
                log.debug("lent data to %s through shared memory", self.address)
            else:
                log.info("lent data to %s over TCP: %s", self.address, answer.reason)
        except (ConnectionLost, ServiceUnavailable, AuthError):
            raise
        except KvfsError as exc:  # e.g. ENOSYS from a server that predates shared memory
            self._shm_ok = False
            log.info("lent data to %s over TCP: %s", self.address, exc.message)
        finally:
            asking.set()
            if self._shm_ok is None:  # interrupted: the next lent call asks again
                self._shm_asking = None

    def close(self) -> None:
        """Destroy the queue pair: only then can no server operation touch this connection's slabs any more."""
        if self.rdma is not None:
            self.rdma.close()


# --------------------------------------------------------------------------------------------- server


class PeerConnection:
    """A server's per-connection state: the peer and, after accepted handshakes, its RDMA link and the mapping
    of its shared-memory arena."""

    __slots__ = ("peer", "rdma", "shm")

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.rdma: rdma.RdmaLink | None = None
        self.shm: shm.PeerArena | None = None

    @property
    def transport(self) -> str:
        return "rdma" if self.rdma is not None and self.rdma.ready else "tcp"

    @property
    def shared_memory(self) -> bool:
        return self.shm is not None

    def install_shm(self, arena: shm.PeerArena) -> None:
        if self.shm is not None:
            self.shm.close()
        self.shm = arena

    def install(self, link: rdma.RdmaLink) -> None:
        if self.rdma is not None:
            self.rdma.close()
        self.rdma = link

    async def pull(self, src: Any) -> memoryview:
        link = self.rdma
        if link is None or not link.ready:
            reason = "no RDMA link on this connection" if link is None else f"RDMA link is down: {link.broken}"
            raise KvfsError(reason, errno.ENOTCONN)
        return await link.pull(src)

    def close(self) -> None:
        if self.rdma is not None:
            self.rdma.close()
        if self.shm is not None:
            self.shm.close()


def accept_rdma(choice: TransportChoice, offer: RdmaOffer, conn: PeerConnection, log: logging.Logger) -> RdmaAccept:
    """The server's side of ``RDMA_CONNECT``: create and connect a queue pair for ``conn`` and install its link, or
    refuse with why (``log`` is the server's)."""
    if choice.transport is TransportMode.TCP:
        return RdmaAccept.refuse("this server's transport is 'tcp'")
    factory = choice.endpoint_factory()
    local = factory.detect()
    if not local.available:
        return RdmaAccept.refuse(f"this server cannot use RDMA: {local.reason}")
    try:
        endpoint = factory.new_endpoint()
    except Exception as exc:
        return _refuse_rdma(conn, log, f"RDMA set-up failed on the server: {_reason(exc)}")
    try:
        endpoint.connect(offer)
        answer = endpoint.offer()
    except Exception as exc:
        _close_quietly(endpoint)
        return _refuse_rdma(conn, log, f"connecting the server's queue pair failed: {_reason(exc)}")
    conn.install(rdma.RdmaLink(endpoint, conn.peer, min_bytes=factory.min_bytes))
    log.info("bulk data with %s by RDMA", conn.peer)
    return RdmaAccept(True, answer)


def _refuse_rdma(conn: PeerConnection, log: logging.Logger, reason: str) -> RdmaAccept:
    RDMA_FALLBACKS.labels("setup").inc()
    log.warning("bulk data with %s over TCP: %s", conn.peer, reason)
    return RdmaAccept.refuse(reason)


def accept_shm(enabled: bool, offer: shm.ShmOffer, conn: PeerConnection, log: logging.Logger) -> shm.ShmAccept:
    """The server's side of ``SHM_CONNECT``: map the client's arena for ``conn``, or refuse with why (``enabled``:
    this server's shared-memory switch; ``log`` is the server's)."""
    if not enabled:
        return shm.ShmAccept(False, "shared memory is off on this server")
    try:
        arena = shm.PeerArena(offer)
    except shm.ShmRefused as exc:
        log.info("lent data from %s over TCP: %s", conn.peer, exc)
        return shm.ShmAccept(False, str(exc))
    conn.install_shm(arena)
    log.info("lent data from %s through shared memory (pid %d)", conn.peer, offer.pid)
    return shm.ShmAccept(True, replies=True)


__all__ = [
    "RDMA_FALLBACKS",
    "ClientLinks",
    "PeerConnection",
    "TransportChoice",
    "accept_rdma",
    "accept_shm",
]
