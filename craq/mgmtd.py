"""``kvfs mgmtd``: the cluster manager service around :class:`kvfs.craq.cluster.ClusterManager`.

Several instances run; the one holding the lease record in the KV store is primary and the others stand by,
renewing nothing until the lease lapses. The primary keeps heartbeats in memory and persists the cluster state
(chains, target placement, node addresses) in the KV store after every change, in a transaction that also checks
it still holds the lease, so a primary that lost its lease (paused, partitioned) cannot overwrite its successor's
decisions. A new primary loads the persisted state and gives every node a fresh heartbeat grace period.

Non-primary instances answer every call with :class:`NotPrimary` naming the primary, so clients just try the
configured addresses in turn (:class:`MgmtdClient`).
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from kvfs.craq.client import (
    CHECKSUM_REPORT, CREATE_CHAINS, HEARTBEAT, REGISTER, ROUTING, STATUS, RESYNC_DONE, ChainIds, ClusterStatus,
    CreateChains, NodeStatus, NotPrimary, RegisterNode,
)
from kvfs.craq.cluster import ClusterManager, ClusterState, Heartbeat, HeartbeatReply, RoutingSnapshot
from kvfs.craq.messages import ChecksumReport, ResyncDone
from kvfs.errors import KvfsError
from kvfs.kv import Database, Transaction
from kvfs.kv.keys import pack
from kvfs.rpc import CallContext, RpcServer
from kvfs.wire import Empty

log = logging.getLogger("kvfs.mgmtd")

LEASE_KEY = pack(("mgmtd", "lease"))
STATE_KEY = pack(("mgmtd", "state"))
NODE_TARGETS_KEY = pack(("mgmtd", "node_targets"))


class Lease(msgspec.Struct, array_like=True):
    holder: str  # instance id
    address: str
    expires: float  # wall clock, seconds


_state_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ClusterState))
_targets_decoder = msgspec.msgpack.Decoder(dict[int, list[int]])
_lease_decoder = msgspec.msgpack.Decoder(Lease)


class MgmtdService:
    """One mgmtd instance: lease election, the manager's decisions, and their persistence."""

    def __init__(
        self,
        db: Database,
        server: RpcServer,
        *,
        instance_id: str,
        address: str,
        heartbeat_timeout: float,
        lease: float,
        recovery_wait: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``recovery_wait``: see :class:`~kvfs.craq.cluster.ClusterManager`."""
        self.db = db
        self.instance_id = instance_id
        self.address = address
        self.heartbeat_timeout = heartbeat_timeout
        self.lease = lease
        self.recovery_wait = recovery_wait
        self.clock = clock
        self.manager: ClusterManager | None = None  # set while primary
        self.node_targets: dict[int, list[int]] = {}
        self.resync: dict[int, tuple[int, int]] = {}  # as last reported in heartbeats; in memory only
        self.primary_address = ""
        for method, handler in (
            (REGISTER, self._register),
            (HEARTBEAT, self._heartbeat),
            (ROUTING, self._routing),
            (CREATE_CHAINS, self._create_chains),
            (RESYNC_DONE, self._resync_done),
            (CHECKSUM_REPORT, self._checksum_report),
            (STATUS, self._status),
        ):
            server.register(method, functools.partial(self._primary_only, handler))

    @property
    def is_primary(self) -> bool:
        return self.manager is not None

    # ------------------------------------------------------------------------------------ election

    async def run(self) -> None:
        """Hold or wait for the lease, and expire dead nodes while primary, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._lease_loop)
            nursery.start_soon(self._tick_loop)

    async def _lease_loop(self) -> None:
        while True:
            try:
                held, loaded = await trio.to_thread.run_sync(self.db.run, self._try_lease)
            except KvfsError as exc:
                log.warning("lease renewal failed: %s", exc)
                held, loaded = False, None
            if held and self.manager is None:
                state, targets = loaded
                self.node_targets = targets
                self.manager = ClusterManager(self.heartbeat_timeout, self.lease_for_reads, state,
                                              recovery_wait=self.recovery_wait)
                now = self.clock()
                for node in self.manager.state.nodes.values():  # fresh grace period for everyone
                    node.last_heartbeat = now
                log.info("became primary (%d nodes, %d chains)", len(state.nodes), len(state.chains))
            elif not held and self.manager is not None:
                log.warning("lost the mgmtd lease to %s; standing by", self.primary_address)
                self.manager = None
            await trio.sleep(self.lease / 3)

    @property
    def lease_for_reads(self) -> float:
        """Read leases granted to chunk servers: shorter than the failure timeout (see craq.cluster)."""
        return self.heartbeat_timeout * 0.6

    def _try_lease(self, tr: Transaction) -> tuple[bool, tuple[ClusterState, dict[int, list[int]]] | None]:
        now = self.clock()
        raw = tr.get(LEASE_KEY)
        current = _lease_decoder.decode(raw) if raw else None
        if current is not None and current.holder != self.instance_id and current.expires > now:
            self.primary_address = current.address
            return False, None
        tr.set(LEASE_KEY, msgspec.msgpack.encode(Lease(self.instance_id, self.address, now + self.lease)))
        self.primary_address = self.address
        if self.manager is not None:
            return True, None
        state_raw = tr.get(STATE_KEY)
        targets_raw = tr.get(NODE_TARGETS_KEY)
        state = _state_codec[1].decode(state_raw) if state_raw else ClusterState()
        return True, (state, _targets_decoder.decode(targets_raw) if targets_raw else {})

    async def _tick_loop(self) -> None:
        while True:
            await trio.sleep(min(0.5, self.heartbeat_timeout / 4))
            if self.manager is not None and self.manager.tick(self.clock()):
                try:
                    await self._persist()
                except NotPrimary as exc:
                    log.warning("stepping down: %s", exc)

    async def _persist(self) -> None:
        """Save the manager's state, fenced by the lease: a deposed primary's write is refused."""
        assert self.manager is not None
        state = _state_codec[0].encode(self.manager.state)
        targets = msgspec.msgpack.encode(self.node_targets)

        def save(tr: Transaction) -> None:
            raw = tr.get(LEASE_KEY)
            lease = _lease_decoder.decode(raw) if raw else None
            if lease is None or lease.holder != self.instance_id:
                raise NotPrimary(f"lease moved to {lease.address if lease else 'nobody'}")
            tr.set(STATE_KEY, state)
            tr.set(NODE_TARGETS_KEY, targets)

        try:
            await trio.to_thread.run_sync(self.db.run, save)
        except NotPrimary:
            self.manager = None
            raise

    # ------------------------------------------------------------------------------------ handlers

    async def _primary_only(self, handler: Callable[..., Any], request: Any, data: Any, ctx: CallContext) -> Any:
        if self.manager is None:
            raise NotPrimary(f"standby; primary is {self.primary_address or 'unknown'}")
        return await handler(request)

    async def _register(self, req: RegisterNode) -> Empty:
        if self.node_targets.get(req.node_id) != req.targets:
            self.node_targets[req.node_id] = list(req.targets)
            await self._persist()
        return Empty()

    async def _heartbeat(self, hb: Heartbeat) -> HeartbeatReply:
        assert self.manager is not None
        known = self.manager.state.nodes.get(hb.node_id)
        self.resync.update(hb.resync)
        reply, changed = self.manager.heartbeat(hb, self.clock())
        if changed or known is None or known.address != hb.address:
            await self._persist()
            reply = msgspec.structs.replace(reply, routing=self.manager.routing())
        return reply

    async def _routing(self, _: Empty) -> RoutingSnapshot:
        assert self.manager is not None
        return self.manager.routing()

    async def _create_chains(self, req: CreateChains) -> ChainIds:
        assert self.manager is not None
        placed = {t.target_id for c in self.manager.state.chains.values() for t in c.targets}
        free = [(t, n) for n, ts in sorted(self.node_targets.items()) for t in ts if t not in placed]
        if not free:
            raise KvfsError("no registered target is free for new chains", errno.ENOSPC)
        first = max(self.manager.state.chains, default=0) + 1
        created = self.manager.create_chains(free, req.replicas, first)
        await self._persist()
        log.info("created chains %s with %d replicas", created, req.replicas)
        return ChainIds(created)

    async def _resync_done(self, msg: ResyncDone) -> Empty:
        assert self.manager is not None
        if self.manager.resync_done(msg):
            log.info("target %s of chain %s finished syncing", msg.target_id, msg.chain_id)
            await self._persist()
        return Empty()

    async def _checksum_report(self, msg: ChecksumReport) -> Empty:
        log.error(
            "chain %s: target %s disagrees with successor %s on chunk %s v%s; needs repair",
            msg.chain_id, msg.target_id, msg.successor, msg.chunk_id, msg.version,
        )
        return Empty()

    async def _status(self, _: Empty) -> ClusterStatus:
        assert self.manager is not None
        now = self.clock()
        nodes = [
            NodeStatus(n.node_id, n.address, n.alive, now - n.last_heartbeat, self.node_targets.get(n.node_id, []),
                       n.incarnation)
            for n in sorted(self.manager.state.nodes.values(), key=lambda n: n.node_id)
        ]
        routing = self.manager.routing()
        syncing = {t.target_id for c in routing.chains for t in c.targets if t.state.value == "syncing"}
        return ClusterStatus(self.address, nodes, routing, {t: p for t, p in self.resync.items() if t in syncing})
