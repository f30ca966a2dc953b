"""Bulk-data transports: TCP always, RDMA (pyverbs, imported lazily) when both ends have a device.

``kvfs.rpc`` asks :mod:`kvfs.transport.negotiate` how each connection's data sections travel and moves them with
:mod:`kvfs.transport.link` and :mod:`kvfs.transport.shm`; README.md in this package says what is wired and what
never ran on hardware.
"""

from kvfs.transport.buffers import BufferPool, LocalSge, RemoteBuffer, Slab
from kvfs.transport.errors import BufferExhausted, RdmaError, RdmaUnavailable, UnregisteredMemory
from kvfs.transport.handshake import RDMA_CONNECT, RdmaAccept, RdmaOffer
from kvfs.transport.select import RdmaAvailability, TransportMode, choose_transport
from kvfs.transport.verbs import detect_rdma

__all__ = [
    "RDMA_CONNECT",
    "BufferExhausted",
    "BufferPool",
    "LocalSge",
    "RdmaAccept",
    "RdmaAvailability",
    "RdmaError",
    "RdmaOffer",
    "RdmaUnavailable",
    "RemoteBuffer",
    "Slab",
    "TransportMode",
    "UnregisteredMemory",
    "choose_transport",
    "detect_rdma",
]
