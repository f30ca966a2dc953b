"""The client side of mgmtd: its wire methods and records, and :class:`MgmtdClient`, which finds the primary.

Everything that talks to mgmtd (chunk servers, meta's garbage collector, the mount, kvclient, ``kvfs admin``) imports
this module, not the service, so a client never loads the KV engines mgmtd keeps its state in.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import msgspec
import trio

from kvfs.craq.cluster import Heartbeat, HeartbeatReply, RoutingSnapshot
from kvfs.craq.messages import ChecksumReport, ResyncDone
from kvfs.errors import ConnectionLost, KvfsError, RpcTimeout, ServiceUnavailable
from kvfs.rpc import RpcClient
from kvfs.wire import Empty, Method


class NotPrimary(KvfsError):
    """This mgmtd instance is a standby; ``message`` names the primary when known."""

    default_errno = errno.EAGAIN


class RegisterNode(msgspec.Struct, kw_only=True):
    node_id: int
    address: str
    targets: list[int]


class CreateChains(msgspec.Struct, kw_only=True):
    replicas: int


class ChainIds(msgspec.Struct):
    chain_ids: list[int]


class NodeStatus(msgspec.Struct):
    node_id: int
    address: str
    alive: bool
    seconds_since_heartbeat: float
    targets: list[int]
    #: the node's process start (``time_ns``), from its last heartbeat; 0 from an mgmtd before this field
    incarnation: int = 0


class ClusterStatus(msgspec.Struct):
    primary: str
    nodes: list[NodeStatus]
    routing: RoutingSnapshot
    #: syncing target id -> (chunks still to copy, chunks to copy in all; -1 before the count is known)
    resync: dict[int, tuple[int, int]] = {}


REGISTER = Method(200, "mgmtd.register", RegisterNode, Empty)
HEARTBEAT = Method(201, "mgmtd.heartbeat", Heartbeat, HeartbeatReply, idempotent=True)
ROUTING = Method(202, "mgmtd.routing", Empty, RoutingSnapshot, idempotent=True)
CREATE_CHAINS = Method(203, "mgmtd.create_chains", CreateChains, ChainIds)
RESYNC_DONE = Method(204, "mgmtd.resync_done", ResyncDone, Empty, idempotent=True)
CHECKSUM_REPORT = Method(205, "mgmtd.checksum_report", ChecksumReport, Empty, idempotent=True)
STATUS = Method(206, "mgmtd.status", Empty, ClusterStatus, idempotent=True)


class MgmtdClient:
    """Finds the primary among the configured mgmtd addresses and calls it."""

    def __init__(self, client: RpcClient, addresses: Sequence[str], *, rounds: int = 20) -> None:
        if not addresses:
            raise ValueError("no mgmtd address configured")
        self._client = client
        self._addresses = list(addresses)
        self._primary = 0
        self._rounds = rounds

    async def call(self, method: Method, request: msgspec.Struct, *, timeout: float | None = None) -> Any:
        error: Exception | None = None
        for attempt in range(self._rounds * len(self._addresses)):
            address = self._addresses[self._primary]
            try:
                return await self._client.call(address, method, request, timeout=timeout)
            except (NotPrimary, ServiceUnavailable, ConnectionLost, RpcTimeout) as exc:
                error = exc
            except KvfsError as exc:
                if exc.errno != errno.EAGAIN:
                    raise
                error = exc
            self._primary = (self._primary + 1) % len(self._addresses)
            if self._primary == 0:
                await trio.sleep(min(0.1 * (1 + attempt // len(self._addresses)), 1.0))
        assert error is not None
        raise ServiceUnavailable(f"no primary mgmtd among {self._addresses}: {error}")

    async def routing(self) -> RoutingSnapshot:
        return await self.call(ROUTING, Empty())
