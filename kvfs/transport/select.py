"""Which transport carries bulk data: TCP always works, RDMA when both ends have a usable device.

Control messages always travel over the TCP RPC; this module only decides whether data sections move by
RDMA READ/WRITE instead. Detection never raises: a missing ``pyverbs``, a host without an RDMA stack (where
``get_device_list`` raises rather than returning ``[]``), no devices and no active port all become a
``reason`` that is logged when ``auto`` falls back to TCP and that ``rdma`` (forced) puts in its error.
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


def detect_rdma() -> RdmaAvailability:
    """Probe the local RDMA devices; never raises (any failure is the ``reason`` it is unavailable)."""
    from kvfs.transport import verbs  # verbs imports pyverbs itself, lazily

    try:
        pv = verbs.load_pyverbs()
    except Exception as exc:  # ImportError, or a broken install that fails while loading its extension
        return RdmaAvailability(False, f"pyverbs is not importable ({type(exc).__name__}: {exc})")
    try:
        devices, ports, notes = verbs.probe_ports(pv)
    except Exception as exc:
        # no RDMA kernel stack: get_device_list raises PyverbsRDMAError("Failed to get devices list")
        return RdmaAvailability(False, f"cannot list RDMA devices ({type(exc).__name__}: {exc})")
    if not devices:
        return RdmaAvailability(False, "no RDMA devices found")
    if not ports:
        detail = "; ".join(notes) if notes else "no port reports ACTIVE"
        return RdmaAvailability(False, f"no active RDMA port on {', '.join(devices)} ({detail})", devices)
    where = ", ".join(f"{p.device}:{p.port}" for p in ports)
    return RdmaAvailability(True, f"active RDMA port(s): {where}", devices, ports)


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
