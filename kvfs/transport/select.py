"""Which transport carries bulk data: TCP always works, RDMA when both ends have a usable device.

Control messages always travel over the TCP RPC; this module only decides whether data sections move by
RDMA READ/WRITE instead. It holds the mode, what a device probe found (:class:`RdmaAvailability`) and the
choice made from it; the probe itself, :func:`kvfs.transport.verbs.detect_rdma`, lives beside the pyverbs code
it runs, so this module imports nothing that touches a device. An unavailable host carries a ``reason`` that
is logged when ``auto`` falls back to TCP and that ``rdma`` (forced) puts in its error.
"""

from __future__ import annotations

import enum
import errno
import logging
from dataclasses import dataclass, field
from typing import Literal

from kvfs.transport.errors import RdmaUnavailable

log = logging.getLogger(__name__)

TransportName = Literal["tcp", "rdma"]


class TransportMode(str, enum.Enum):
    AUTO = "auto"
    TCP = "tcp"
    RDMA = "rdma"

    @classmethod
    def parse(cls, value: TransportMode | str) -> TransportMode:
        """Accept the enum or its configuration spelling (case-insensitive); anything else is a ValueError."""
        if isinstance(value, TransportMode):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"transport mode {value!r} is not one of {choices}") from None


@dataclass(frozen=True, slots=True)
class ActivePort:
    device: str
    port: int
    lid: int
    link_layer: str  # "infiniband" | "ethernet" (RoCE) | "unknown"
    mtu: int  # active MTU in bytes


@dataclass(frozen=True, slots=True)
class RdmaAvailability:
    available: bool
    reason: str
    devices: list[str] = field(default_factory=list)
    ports: list[ActivePort] = field(default_factory=list)


def choose_transport(
    mode: TransportMode | str, local: RdmaAvailability, peer_offer: object | None
) -> TransportName:
    """Pick the bulk-data transport for one connection.

    ``peer_offer`` is the peer's :class:`~kvfs.transport.handshake.RdmaOffer` (or any truthy value meaning
    "the peer can do RDMA"); ``None``/falsy means it offered none. ``tcp`` always gives TCP. ``rdma`` gives
    RDMA or raises :class:`RdmaUnavailable` (ENODEV when this host has no usable device, EOPNOTSUPP when
    the peer offers none) with the reason. ``auto`` gives RDMA when both ends can, else TCP, logging why.
    """
    mode = TransportMode.parse(mode)
    if mode is TransportMode.TCP:
        return "tcp"
    if mode is TransportMode.RDMA:
        if not local.available:
            raise RdmaUnavailable(f"transport 'rdma' is forced but this host cannot use RDMA: {local.reason}")
        if not peer_offer:
            raise RdmaUnavailable(
                "transport 'rdma' is forced but the peer offers no RDMA endpoint", errno.EOPNOTSUPP
            )
        return "rdma"
    if not local.available:
        log.info("bulk data over TCP: this host cannot use RDMA: %s", local.reason)
        return "tcp"
    if not peer_offer:
        log.info("bulk data over TCP: the peer offers no RDMA endpoint")
        return "tcp"
    return "rdma"
