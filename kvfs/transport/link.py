"""RDMA bulk data inside ``kvfs.rpc``: mode resolution, descriptor trailers, call planning and per-connection links.

How a call moves its data once a connection has an RDMA link (see README.md for the whole picture):

* the request frame carries the wire flag :data:`~kvfs.wire.Flags.RDMA` and its body ends with a fixed
  :data:`REQUEST_TRAILER` (covered by the frame's tag like the rest of the body): ``src``, the client's
  registered slab holding the request's data section (the server RDMA-READs it), and/or ``dst``, a client slab
  the response's data section may be RDMA-WRITTEN into. Absent buffers are all zeros.
* the response frame to a request that offered ``dst`` carries the flag when the data went by RDMA; its body
  ends with :data:`RESPONSE_TRAILER` (the bytes written). The server sends it only after the WRITE completed.
* an ERROR frame with the flag means the server could not move the request's data by RDMA and did *not* run the
  handler, so the client may resend the call over TCP whatever the method.

Everything here is hardware-independent; the device work is behind :class:`Endpoint` (``VerbsEndpoint`` on a
real device, a fake in the tests).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvfs.errors import KvfsError, ProtocolError
from kvfs.transport.buffers import BufferPool, RemoteBuffer, Slab
from kvfs.transport.direct import DirectDomain, DirectInto
from kvfs.transport.errors import BufferExhausted, RdmaUnavailable
from kvfs.transport.handshake import RdmaOffer
from kvfs.transport.select import RdmaAvailability, TransportMode
from kvfs.transport.verbs import detect_rdma

log = logging.getLogger("kvfs.transport")

ENV_TRANSPORT = "KVFS_TRANSPORT"
#: Data sections smaller than this stay inline on TCP: one memcpy and a completion round trip cost more.
RDMA_MIN_BYTES = 64 << 10

REQUEST_TRAILER = struct.Struct("<QIIQII")  # src addr, rkey, length | dst addr, rkey, length
RESPONSE_TRAILER = struct.Struct("<Q")  # bytes RDMA-WRITTEN into the request's dst

#: Errnos of an RDMA ERROR frame after which the link is still good (only this call goes over TCP).
TRANSIENT_ERRNOS = frozenset({errno.ENOBUFS, errno.EMSGSIZE})


# ------------------------------------------------------------------------------------------ mode


def resolve_mode(value: TransportMode | str | None, *, source: str = "transport") -> TransportMode:
    """The transport mode: an explicit value, else ``$KVFS_TRANSPORT``, else ``auto``; a bad spelling is EINVAL."""
    if value is None:
        value = os.environ.get(ENV_TRANSPORT) or TransportMode.AUTO
        source = ENV_TRANSPORT
    try:
        return TransportMode.parse(value)
    except ValueError as exc:
        raise KvfsError(f"{source}: {exc}", errno.EINVAL) from None


_told: set[str] = set()


def note_tcp_only(local: RdmaAvailability) -> None:
    """Log once per process (and reason) that ``auto`` keeps bulk data on TCP because this host lacks RDMA."""
    if not local.available and local.reason not in _told:
        _told.add(local.reason)
        log.info("bulk data over TCP: this host cannot use RDMA: %s", local.reason)


def require_available(mode: TransportMode, local: RdmaAvailability) -> None:
    """Forced ``rdma`` on a host that cannot do it is a start-up error carrying the detection reason."""
    if mode is TransportMode.RDMA and not local.available:
        raise RdmaUnavailable(f"transport 'rdma' is forced but this host cannot use RDMA: {local.reason}")


# ----------------------------------------------------------------------------------- descriptors


def _buffer(addr: int, rkey: int, length: int, max_data: int, what: str) -> RemoteBuffer | None:
    if length == 0:
        if addr or rkey:
            raise ProtocolError(f"RDMA {what} buffer has an address but no length")
        return None
    if length > max_data:
        raise ProtocolError(f"RDMA {what} buffer of {length} bytes exceeds the limit of {max_data}")
    try:
        return RemoteBuffer(addr, rkey, length)
    except ValueError as exc:
        raise ProtocolError(f"RDMA {what} buffer: {exc}") from None


def encode_request_trailer(src: RemoteBuffer | None, dst: RemoteBuffer | None) -> bytes:
    if src is None and dst is None:
        raise ValueError("an RDMA request trailer needs a src or a dst buffer")
    s = (src.addr, src.rkey, src.length) if src is not None else (0, 0, 0)
    d = (dst.addr, dst.rkey, dst.length) if dst is not None else (0, 0, 0)
    if (src is not None and src.length == 0) or (dst is not None and dst.length == 0):
        raise ValueError("an RDMA buffer in a trailer must not be empty")
    return REQUEST_TRAILER.pack(*s, *d)


def split_request(
    body: bytes | memoryview, max_data: int
) -> tuple[bytes | memoryview, RemoteBuffer | None, RemoteBuffer | None]:
    """``(message body, src, dst)`` of a flagged request body; ProtocolError for anything malformed."""
    if len(body) < REQUEST_TRAILER.size:
        raise ProtocolError(f"RDMA request body of {len(body)} bytes is shorter than its trailer")
    cut = len(body) - REQUEST_TRAILER.size
    sa, sk, sl, da, dk, dl = REQUEST_TRAILER.unpack(body[cut:])
    src = _buffer(sa, sk, sl, max_data, "source")
    dst = _buffer(da, dk, dl, max_data, "destination")
    if src is None and dst is None:
        raise ProtocolError("RDMA request trailer names no buffer")
    return body[:cut], src, dst


def encode_response_trailer(written: int) -> bytes:
    return RESPONSE_TRAILER.pack(written)


def split_response(body: bytes | memoryview, offered: int) -> tuple[bytes | memoryview, int]:
    """``(message body, bytes written)``; more than the ``offered`` destination is a ProtocolError."""
    if len(body) < RESPONSE_TRAILER.size:
        raise ProtocolError(f"RDMA response body of {len(body)} bytes is shorter than its trailer")
    cut = len(body) - RESPONSE_TRAILER.size
    (written,) = RESPONSE_TRAILER.unpack(body[cut:])
    if written > offered:
        raise ProtocolError(f"server claims {written} bytes written into a {offered}-byte RDMA destination")
    return body[:cut], written


# ---------------------------------------------------------------------------------- call planning


@dataclass(frozen=True, slots=True)
class CallPlan:
    send: bool  # the request's data section goes by RDMA READ (server pulls it)
    receive: bool  # the response's data section may come by RDMA WRITE (server pushes it)

    @property
    def rdma(self) -> bool:
        return self.send or self.receive


TCP_ONLY = CallPlan(False, False)


def plan_call(link_ready: bool, data_len: int, into_len: int | None, *, min_bytes: int, max_bytes: int) -> CallPlan:
    """Which data sections of one call move by RDMA.

    Only with a working link; only sections of ``min_bytes`` or more (small ones are cheaper inline) that fit one
    slab (``max_bytes``). A response can only be received by RDMA into a caller's ``into`` buffer, since its size
    is known up front only through that; a larger response than offered simply comes over TCP.
    """
    if not link_ready:
        return TCP_ONLY
    send = min_bytes <= data_len <= max_bytes
    receive = into_len is not None and into_len >= min_bytes
    return CallPlan(send, receive)


# ----------------------------------------------------------------------------------- endpoints


class Endpoint(Protocol):
    """One connection's local RDMA end: a queue pair and the process's registered buffer pool."""

    pool: BufferPool
    #: the protection domain, for registering callers' GPU memory (:mod:`kvfs.transport.direct`)
    domain: DirectDomain

    def offer(self) -> RdmaOffer: ...

    def connect(self, peer: RdmaOffer) -> None: ...

    async def read(self, into: memoryview, remote: RemoteBuffer) -> int: ...

    async def write(self, data: memoryview, remote: RemoteBuffer) -> int: ...

    def close(self) -> None: ...


class EndpointFactory(Protocol):
    """Makes endpoints; injected into RpcClient/RpcServer (a fake in the tests, :class:`VerbsFactory` for real)."""

    min_bytes: int

    def detect(self) -> RdmaAvailability: ...

    def new_endpoint(self) -> Endpoint: ...


class VerbsEndpoint:
    """:class:`Endpoint` over pyverbs: an RC queue pair on the factory's device and its shared pool."""

    def __init__(self, device: Any, pool: BufferPool) -> None:
        from kvfs.transport import verbs

        self.pool = pool
        self.domain = device
        self._qp = verbs.RdmaQueuePair(device)
        self._io = verbs.RdmaEndpoint(self._qp, pool)

    def offer(self) -> RdmaOffer:
        return self._qp.offer()

    def connect(self, peer: RdmaOffer) -> None:
        self._qp.connect(peer)

    async def read(self, into: memoryview, remote: RemoteBuffer) -> int:
        return await self._io.read(into, remote)

    async def write(self, data: memoryview, remote: RemoteBuffer) -> int:
        return await self._io.write(data, remote)

    def close(self) -> None:
        self._qp.close()


class VerbsFactory:
    """The real factory: detection once per process, the first active port opened lazily, one pool for all QPs.

    ``KVFS_RDMA_GID_INDEX`` overrides the GID index (RoCE; default 1 on Ethernet ports, 0 on InfiniBand).
    """

    def __init__(
        self,
        *,
        slab_size: int = 4 << 20,
        slabs_per_region: int = 16,
        max_regions: int = 4,
        min_bytes: int = RDMA_MIN_BYTES,
        detect: Any = detect_rdma,
    ) -> None:
        self.min_bytes = min_bytes
        self._pool_args = dict(slab_size=slab_size, slabs_per_region=slabs_per_region, max_regions=max_regions)
        self._detect = detect
        self._detected: RdmaAvailability | None = None
        self._device: Any = None
        self._pool: BufferPool | None = None
        self._lock = threading.Lock()

    def detect(self) -> RdmaAvailability:
        with self._lock:
            if self._detected is None:
                self._detected = self._detect()
            return self._detected

    def new_endpoint(self) -> Endpoint:
        local = self.detect()
        if not local.available:
            raise RdmaUnavailable(local.reason)
        with self._lock:
            if self._device is None:
                from kvfs.transport import verbs

                port = local.ports[0]
                default = 1 if port.link_layer == "ethernet" else 0
                gid_index = int(os.environ.get("KVFS_RDMA_GID_INDEX", default))
                device = verbs.RdmaDevice(port.device, port.port, gid_index=gid_index)
                self._pool = device.buffer_pool(**self._pool_args)
                self._device = device
            assert self._pool is not None
            return VerbsEndpoint(self._device, self._pool)


_default: VerbsFactory | None = None


def default_factory() -> VerbsFactory:
    global _default
    if _default is None:
        _default = VerbsFactory()
    return _default


# ------------------------------------------------------------------------------------------ link


def _copy_into(dst: memoryview, parts: Sequence[Any]) -> int:
    pos = 0
    for part in parts:
        view = memoryview(part).cast("B")
        dst[pos : pos + view.nbytes] = view
        pos += view.nbytes
    return pos


class RdmaLink:
    """A connection's working RDMA path (one QP) and the staging through registered slabs.

    Data is always staged through slabs owned by the connection: the caller's own buffers may be reused the
    moment a call returns (even a cancelled one), while the peer may still be reading or writing the slab.
    """

    def __init__(self, endpoint: Endpoint, peer: str, *, min_bytes: int = RDMA_MIN_BYTES) -> None:
        self.endpoint = endpoint
        self.pool = endpoint.pool
        self.peer = peer
        self.min_bytes = min_bytes
        self.broken: str | None = None
        self._closed = False

    @property
    def ready(self) -> bool:
        return self.broken is None

    @property
    def max_bytes(self) -> int:
        return self.pool.slab_size

    def plan(self, data_len: int, into_len: int | None) -> CallPlan:
        return plan_call(self.ready, data_len, into_len, min_bytes=self.min_bytes, max_bytes=self.max_bytes)

    # --- client side: the peer reads from / writes into these slabs ---------------------------------

    def stage(self, parts: Sequence[Any], length: int) -> tuple[Slab, RemoteBuffer]:
        """Copy a request's data section into a slab the server will RDMA-READ (BufferExhausted if none)."""
        slab = self.pool.acquire()
        _copy_into(slab.view, parts)
        return slab, slab.remote(0, length)

    def direct(self, target: DirectInto) -> RemoteBuffer | None:
        """The descriptor of a caller's registered region for the server to RDMA-WRITE an answer straight into, or
        None when the answer goes to a slab instead (this domain could not register the region)."""
        return target.region.remote(self.endpoint.domain, target.offset, target.length)

    def reserve(self, into_len: int) -> tuple[Slab, RemoteBuffer]:
        """A slab the server may RDMA-WRITE a response's data section into."""
        slab = self.pool.acquire()
        return slab, slab.remote(0, min(into_len, slab.size))

    # --- server side: one-sided operations against the client's slabs -------------------------------

    async def pull(self, src: RemoteBuffer) -> memoryview:
        """RDMA-READ a request's data section; returned in a fresh buffer the handler owns, as over TCP."""
        if src.length > self.max_bytes:
            raise KvfsError(f"RDMA source of {src.length} bytes exceeds a {self.max_bytes}-byte slab", errno.EMSGSIZE)
        slab = self.pool.acquire()
        try:
            await self.endpoint.read(slab.view[: src.length], src)
            return memoryview(bytearray(slab.view[: src.length]))
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            slab.release()

    async def push(self, parts: Sequence[Any], length: int, dst: RemoteBuffer) -> bool:
        """RDMA-WRITE a response's data section into ``dst``; False when it must go over TCP instead.

        Returns only once the WRITE has completed, so the response frame sent after it cannot overtake the data.
        """
        if not self.ready or length == 0 or length > dst.length or length > self.max_bytes:
            return False
        try:
            slab = self.pool.acquire()
        except BufferExhausted:
            return False
        try:
            _copy_into(slab.view, parts)
            await self.endpoint.write(slab.view[:length], dst.slice(0, length))
            return True
        except KvfsError as exc:
            self._failed(exc)
            log.warning("RDMA to %s failed, data goes over TCP from now on: %s", self.peer, exc.message)
            return False
        finally:
            slab.release()

    def _failed(self, exc: BaseException) -> None:
        """Any failed RDMA operation leaves the QP in ERROR: this link is done (a full pool is not a failure)."""
        if isinstance(exc, KvfsError) and exc.errno in TRANSIENT_ERRNOS:
            return
        if isinstance(exc, (KvfsError, OSError)):
            self.fail(str(getattr(exc, "message", exc)))

    def fail(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason or "RDMA failed"
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.endpoint.close()
        except Exception as exc:  # closing must never take the connection with it
            log.warning("closing the RDMA endpoint to %s: %s", self.peer, exc)
