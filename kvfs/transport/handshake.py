"""Queue-pair setup messages, exchanged over the existing TCP RPC before any RDMA traffic.

The connecting side creates an RC queue pair (state INIT) and sends an :class:`RdmaOffer` describing it; the
accepting side creates its own, moves it to RTR/RTS against the offer and answers :class:`RdmaAccept`
(its own endpoint, or a refusal with a reason, after which both ends keep bulk data on TCP). The
connecting side then moves its queue pair to RTR/RTS against the accept.

Every field is bounded to what the verbs API can take (24-bit QP numbers and PSNs, 16-bit LIDs, 16-byte
GIDs, the five IB MTUs), so a malformed or hostile message is a :class:`~kvfs.errors.ProtocolError`
before anything is handed to the device.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvfs import wire
from kvfs.errors import ProtocolError
from kvfs.wire import Method

HANDSHAKE_VERSION = 1
VALID_MTUS = (256, 512, 1024, 2048, 4096)
GID_SIZE = 16
MAX_DEVICE_NAME = 64
MAX_REASON = 512

DeviceName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_DEVICE_NAME, pattern=r"^[A-Za-z0-9_.:\-]+$")]
PortNum = Annotated[int, msgspec.Meta(ge=1, le=255)]
Lid = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
Gid = Annotated[bytes, msgspec.Meta(min_length=GID_SIZE, max_length=GID_SIZE)]
GidIndex = Annotated[int, msgspec.Meta(ge=0, le=255)]
QpNum = Annotated[int, msgspec.Meta(ge=1, le=0xFFFFFF)]
Psn = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFF)]
Mtu = Annotated[int, msgspec.Meta(ge=256, le=4096)]
RdAtomic = Annotated[int, msgspec.Meta(ge=1, le=255)]
Version = Annotated[int, msgspec.Meta(ge=1, le=0xFFFF)]


def _check_mtu(mtu: int) -> None:
    if mtu not in VALID_MTUS:
        raise ValueError(f"mtu {mtu} is not one of {VALID_MTUS}")


class RdmaOffer(msgspec.Struct, array_like=True, frozen=True):
    """One end's RC queue pair, as the other end needs it to connect: where, which QP, which PSN."""

    device: DeviceName
    port: PortNum
    lid: Lid
    gid: Gid  # all zeros on InfiniBand without GRH; the RoCE GID otherwise
    gid_index: GidIndex
    qp_num: QpNum
    psn: Psn
    mtu: Mtu  # active path MTU in bytes
    max_rd_atomic: RdAtomic = 16  # outstanding RDMA READs this end accepts as a responder
    version: Version = HANDSHAKE_VERSION

    def __post_init__(self) -> None:
        _check_mtu(self.mtu)

    @property
    def uses_grh(self) -> bool:
        """RoCE (and routed IB) need a global route header: the GID is set."""
        return any(self.gid)


class RdmaAccept(msgspec.Struct, array_like=True, frozen=True):
    """The answer to an offer: the acceptor's endpoint, or a refusal (``endpoint`` None) with the reason."""

    accepted: bool
    endpoint: RdmaOffer | None = None
    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON)] = ""

    def __post_init__(self) -> None:
        if self.accepted and self.endpoint is None:
            raise ValueError("an accepted handshake must carry the acceptor's endpoint")
        if not self.accepted and self.endpoint is not None:
            raise ValueError("a refused handshake must not carry an endpoint")

    @classmethod
    def refuse(cls, reason: str) -> RdmaAccept:
        return cls(False, None, reason[:MAX_REASON])


#: The RPC that carries the handshake. Not idempotent: each call creates a queue pair on the server.
RDMA_CONNECT = Method(7001, "transport.rdma_connect", RdmaOffer, RdmaAccept)


def encode(message: RdmaOffer | RdmaAccept) -> bytes:
    return wire.encode_body(message)


def decode_offer(raw: bytes | memoryview) -> RdmaOffer:
    return _decode(RdmaOffer, raw)


def decode_accept(raw: bytes | memoryview) -> RdmaAccept:
    return _decode(RdmaAccept, raw)


def _decode(kind: type, raw: bytes | memoryview):  # type: ignore[no-untyped-def]
    message = wire.decode_body(kind, raw)  # malformed/out-of-bounds -> ProtocolError
    offer = message if isinstance(message, RdmaOffer) else message.endpoint
    if offer is not None and offer.version != HANDSHAKE_VERSION:
        raise ProtocolError(
            f"RDMA handshake version {offer.version} is not supported (this side speaks {HANDSHAKE_VERSION})"
        )
    return message


def negotiated_mtu(a: RdmaOffer, b: RdmaOffer) -> int:
    """Both ends must use the same path MTU: the smaller of the two active MTUs."""
    return min(a.mtu, b.mtu)
