"""Deterministic whole-cluster simulation: mgmtd logic, chain members, chunk engines and clients in one process.

One seeded :class:`random.Random` drives everything: message delays (so reordering), drops, connection resets
(everything in flight to or from a node is lost: an update arrives after a gap), node crashes and restarts
(a restarted node keeps what its engine persisted; a power loss or a kill -9 of a server holding writes in
memory rolls it back to its last flush, so it returns behind), persists slower than a round trip and stalled
disks, nodes cut off from mgmtd (their read lease must fence them), and nodes lost for good (chains must go
on without them, within a bound). Clients time out, refresh routing and retry with the same request id.

Each chunk holds ``SLOTS`` registers of ``SLOT`` bytes; a write is a partial chunk write of a unique value to
one slot (so successors must apply it on the right base version), a read reads the whole chunk. Histories are
kept per (chunk, slot). :func:`run` returns them; :func:`check` verifies them.

Simplifications: mgmtd fails over instantly (a standby loads the persisted state) and clients read its routing
directly (heartbeats and ResyncDone do go through the lossy network); one target per chain per node.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable

import msgspec
from crc32c import crc32c

from kvfs.crc import block_runs, changed_blocks, pack_crcs, unpack_crcs
from kvfs.errors import NotCommitted

from kvfs.craq.cluster import ClusterManager, ClusterState, Heartbeat
from kvfs.craq.linearizable import Op, check_register
from kvfs.craq.member import (
    AskTail, ChainMember, ChunkState, Commit, Configure, DropChunks, Effect, PersistFailed, PersistPending, Persisted,
    ReplyClient, ReportToMgmtd, Retry, Send, SendChunk, ServeVersion, Tick,
)
from kvfs.craq.messages import (
    AckStatus, BlockDelta, ChecksumReport, ChunkId, ChunkSummary, ReadReq, ReadResp, ResyncDone, ResyncPull,
    ResyncState, TargetState, UpdateAck, UpdateReq, VersionQuery, VersionReply, WriteReq, WriteResp,
)


SLOTS, SLOT = 2, 8


@dataclass
class _Version:
    version: int
    data: bytes
    requests: dict[int, int]


@dataclass
class MemEngine:
    """Model of the chunk engine: per chunk a committed and a pending version, copy-on-write.

    ``durable`` is what the last :meth:`flush` made safe from a power loss (the real engine holds writes in
    memory or the page cache until a flush); :meth:`lose_unflushed` goes back to it."""

    committed: dict[ChunkId, _Version] = field(default_factory=dict)
    pending: dict[ChunkId, _Version] = field(default_factory=dict)
    durable: tuple[dict[ChunkId, _Version], dict[ChunkId, _Version]] = field(default_factory=lambda: ({}, {}))

    def flush(self) -> None:
        self.durable = (dict(self.committed), dict(self.pending))

    def lose_unflushed(self) -> None:
        self.committed, self.pending = dict(self.durable[0]), dict(self.durable[1])

    def remove(self, chunk_ids: Iterable[ChunkId]) -> None:
        """Removal is one durable transaction in the real engine: gone from what a power loss goes back to too."""
        for cid in chunk_ids:
            for versions in (self.committed, self.pending, *self.durable):
                versions.pop(cid, None)

    def unflushed(self) -> list[tuple[ChunkId, _Version]]:
        """Versions a power loss now would lose."""
        kept = {(cid, v.version, v.data) for d in self.durable for cid, v in d.items()}
        return [(cid, v) for d in (self.committed, self.pending) for cid, v in d.items()
                if (cid, v.version, v.data) not in kept]

    def holds(self, chunk_id: ChunkId, lost: _Version) -> bool:
        """Whether this engine has committed ``lost`` or something newer (a newer version includes it)."""
        c = self.committed.get(chunk_id)
        return c is not None and (c.version > lost.version or (c.version, c.data) == (lost.version, lost.data))

    def write_pending(self, p: PersistPending) -> tuple[int, int] | None:
        """(CRC, length) of the staged version; None where a delta does not fit the committed version (the real
        engine's StaleVersion or ChecksumMismatch), which stages nothing."""
        committed = self.committed.get(p.chunk_id, _Version(0, b"", {}))
        assert p.force or p.version > committed.version, f"{p} is not newer than committed {committed.version}"
        if p.delta is not None and committed.version != p.delta.base_version:
            return None
        base = committed.data[:p.delta.length] if p.delta else b"" if p.full_replace else committed.data
        data, at = bytearray(base), 0
        for offset, length in p.extents or [(p.offset, len(p.data))]:
            data += bytes(max(0, offset - len(data)))  # a run past the end: zeros up to it
            data[offset:offset + length] = p.data[at:at + length]
            at += length
        if p.delta is not None:
            data += bytes(max(0, p.delta.length - len(data)))
            if crc32c(data) != p.delta.chunk_crc:
                return None
        data = bytes(data)
        self.pending[p.chunk_id] = _Version(p.version, data, p.requests)
        return crc32c(data), len(data)

    def listed(self, state: ResyncState) -> ResyncState:
        """The driver's part of a resync list: each listed version's length and the CRCs of its ``SLOT``-byte
        pieces (the real driver's 64 KiB blocks, scaled to the model's chunks)."""
        chunks = []
        for x in state.chunks:
            v = self.committed.get(x.chunk_id)
            listed = v is not None and v.version == x.version and x.version > 0
            chunks.append(ChunkSummary(x.chunk_id, x.version, x.crc, len(v.data), pack_crcs(_slot_crcs(v.data)))
                          if listed else x)
        return msgspec.structs.replace(state, chunks=tuple(chunks))

    def copy(self, e: SendChunk) -> UpdateReq:
        """A :class:`SendChunk` with its bytes: the pieces that differ from the receiver's listed copy (a delta,
        always, so that the model's 16-byte chunks exercise it), else the whole chunk."""
        data = self.read(e.msg.chunk_id, e.msg.version)
        theirs = e.theirs
        if data is None or theirs is None or not theirs.blocks:
            return msgspec.structs.replace(e.msg, data=data)
        changed = changed_blocks(_slot_crcs(data), len(data), unpack_crcs(theirs.blocks), theirs.length, SLOT)
        runs = block_runs(changed, len(data), SLOT)
        pieces = b"".join(data[start:start + n] for start, n in runs)
        return msgspec.structs.replace(e.msg, data=pieces, crc=crc32c(pieces), extents=runs,
                                       delta=BlockDelta(theirs.version, theirs.crc, len(data), crc32c(data)))

    def commit(self, chunk_id: ChunkId, version: int) -> None:
        if self.pending.get(chunk_id, _Version(-1, b"", {})).version == version:
            self.committed[chunk_id] = self.pending.pop(chunk_id)

    def read(self, chunk_id: ChunkId, version: int) -> bytes | None:
        for v in (self.committed.get(chunk_id), self.pending.get(chunk_id)):
            if v is not None and v.version == version:
                return v.data
        return b"" if version == 0 else None

    def meta(self) -> dict[ChunkId, ChunkState]:
        metas = {}
        for cid in self.committed.keys() | self.pending.keys():
            c, p = self.committed.get(cid, _Version(0, b"", {})), self.pending.get(cid)
            metas[cid] = ChunkState(c.version, crc32c(c.data), len(c.data), c.requests, *(
                (p.version, crc32c(p.data), len(p.data), p.requests) if p else ()))
        return metas


def _bad_kept_block(target: int, p: PersistPending) -> bool:
    """A delta that finds a block it would keep corrupt on the disk (the real engine refuses it): one in five,
    chosen by a hash rather than the run's random stream, so runs without deltas replay as they did."""
    return p.delta is not None and crc32c(repr((target, p.chunk_id, p.version)).encode()) % 5 == 0


def _slot_crcs(data: bytes) -> list[int]:
    return [crc32c(data[i:i + SLOT]) for i in range(0, len(data), SLOT)]


@dataclass
class SimConfig:
    nodes: int = 5
    replicas: int = 3
    chains: int = 2
    clients: int = 3
    chunks: int = 3
    duration: float = 1.5  # faults happen during this time
    settle: float = 2.5  # then the network heals and clients finish
    drop: float = 0.03
    slow: float = 0.05  # fraction of messages delayed 20-80 ms (reordering)
    crash_every: float = 0.25  # mean time between faults
    max_down: int = 1  # nodes crashed at the same time
    failover_share: float = 0.1  # of faults that fail mgmtd over to a standby (state reloaded from storage)
    cut_off_share: float = 0.4  # of the other faults: cut a node off from mgmtd rather than crash it
    heartbeat_every: float = 0.05
    heartbeat_timeout: float = 0.3
    lease: float = 0.2
    tick_every: float = 0.01
    client_timeout: float = 0.15
    give_up_after: float = 1.2
    retransmit_scan_every: float = 0.0  # members look for unacknowledged updates this often (0: every tick)
    # Faults the real system has (each 0 turns it off and leaves the seeds' other draws as they were):
    rollback_share: float = 0.0  # of crashes: power loss / kill -9 with held writes, back to the last flush
    flush_every: float = 0.2  # mean time between a node's flushes
    reset_share: float = 0.0  # of faults: a node's connections reset, losing every message in flight
    stall_share: float = 0.0  # of faults: a node's disk stalls for 50-300 ms (persists finish after it)
    slow_persist: float = 0.0  # fraction of persists taking 5-40 ms, longer than a round trip
    lose_share: float = 0.0  # chance that a run loses one node for good during the faults
    #: how long mgmtd waits for the other targets of a chain whose rolled-back lastsrv came back; longer than
    #: any absence during the faults, so only a node lost for good makes it expire
    recovery_wait: float = 1.5
    liveness_bound: float = 1.0  # every write issued once the cluster is calm completes within this


#: Named fault mixes. "classic" is the simulator before it modelled rollbacks, resets, slow disks and lost
#: nodes (its seeds still replay old regressions); "harsh" lets every node be down at once (lastsrv); "liveness"
#: loses a node for good while only the network and the disks misbehave, so every write issued once mgmtd has
#: reconfigured the chain must complete within ``liveness_bound``.
_REAL_FAULTS = dict(rollback_share=0.5, reset_share=0.15, stall_share=0.1, slow_persist=0.1)
PROFILES = {
    "classic": SimConfig(),
    "default": SimConfig(**_REAL_FAULTS, lose_share=0.3),
    "harsh": SimConfig(**_REAL_FAULTS, max_down=5, drop=0.1, slow=0.1, crash_every=0.15),
    "liveness": SimConfig(max_down=0, cut_off_share=0.0, failover_share=0.0, reset_share=0.3, stall_share=0.2,
                          slow_persist=0.1, lose_share=1.0),
}


@dataclass
class SimResult:
    seed: int
    history: dict[tuple[ChunkId, int], list[Op]]  # per (chunk, slot)
    checksum_reports: list[ChecksumReport]
    final_replicas: dict[ChunkId, set[tuple[int, bytes]]]  # per chunk: (version, data) at each serving target
    final_states: list[str]  # per chain "chain c vN: target:state, ..."
    stuck: list[str]  # pending versions left at the end, when everything should have settled
    healed_at: float
    events: int
    lost_targets: set[int]  # targets of nodes lost for good: offline at the end, not serving
    #: per chunk: writes invoked from then on must complete within ``liveness_bound`` (the healing, or mgmtd's
    #: reconfiguration of the chain around a lost node, whichever is later)
    calm_since: dict[ChunkId, float]
    liveness_bound: float
    faults: collections.Counter[str]  # what happened: crashes, rollbacks, resets, stalls, resync copies...


class _Node:
    def __init__(self, node_id: int, targets: dict[int, int], scan_every: float = 0.0) -> None:
        self.node_id = node_id
        self.scan_every = scan_every
        self.targets = targets  # target id -> chain id
        self.engines = {t: MemEngine() for t in targets}
        self.incarnation = 1
        self.alive = True
        self.lost = False  # down for good: never restarts
        self.epoch = 0  # bumped by a connection reset: messages sent to or from an older epoch are lost
        self.disk_stalled_until = 0.0
        self.unclean = False  # this incarnation followed an unclean stop (its heartbeats say so)
        self.rolled_back = False  # ... that lost unflushed versions
        self.cut_off_until = 0.0  # heartbeats to mgmtd dropped until then
        self.members: dict[int, ChainMember] = {}
        self.reads: dict[tuple[int, int], tuple[int, int, ReadReq]] = {}  # (target, query) -> (client, tag, req)
        self.boot()

    def boot(self) -> None:
        self.members = {t: ChainMember(t, c, self.engines[t].meta(), retransmit_scan_every=self.scan_every)
                        for t, c in self.targets.items()}
        self.reads.clear()


class Sim:
    def __init__(self, seed: int, cfg: SimConfig | None = None) -> None:
        self.seed = seed
        self.cfg = cfg = cfg or SimConfig()
        self.rng = random.Random(seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0
        self.faults = True
        self.mgr = ClusterManager(cfg.heartbeat_timeout, cfg.lease, recovery_wait=cfg.recovery_wait)
        # replicas*chains targets spread round-robin over the nodes; target id = 10 * node + k
        chosen = [(10 * (i % cfg.nodes + 1) + i // cfg.nodes, i % cfg.nodes + 1) for i in range(cfg.replicas * cfg.chains)]
        self.mgr.create_chains(chosen, cfg.replicas)
        chain_of = {t.target_id: c.chain_id for c in self.mgr.routing().chains for t in c.targets}
        self.nodes = {
            n: _Node(n, {t: chain_of[t] for t, node in chosen if node == n}, cfg.retransmit_scan_every)
            for n in range(1, cfg.nodes + 1)
        }
        self.chunk_ids = [ChunkId(1, i) for i in range(cfg.chunks)]
        self.history: dict[tuple[ChunkId, int], list[Op]] = {(c, s): [] for c in self.chunk_ids for s in range(SLOTS)}
        self.checksum_reports: list[ChecksumReport] = []
        self.clients = [_Client(self, i + 1) for i in range(cfg.clients)]
        self.counts: collections.Counter[str] = collections.Counter()
        self.lost_targets: set[int] = set()
        self.reconfigured_at: dict[int, float] = {}  # chain -> when mgmtd first took a lost target out of it
        self.committed_max: dict[ChunkId, int] = {}  # the newest version any replica committed (maybe seen)
        self.recovering_until: dict[int, float] = {}  # chain -> when mgmtd last saw it recovering (rule 9)

    # ------------------------------------------------------------------------------------- scheduler

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (self.now + delay, next(self._seq), fn))

    def run(self) -> SimResult:
        for node in self.nodes.values():
            self._start_node_timers(node)
        self.at(self.cfg.tick_every, self._mgmtd_tick)
        self.at(self.rng.expovariate(1 / self.cfg.crash_every), self._fault)
        if self.cfg.lose_share and self.rng.random() < self.cfg.lose_share:
            # with node faults going on, at the healing: a crash or cut-off soon after a loss can leave the lost
            # target as its chain's last serving one (lastsrv), which only its return could bring back
            self.at(self.cfg.duration if self._node_faults() else self.rng.uniform(0.1, 0.7 * self.cfg.duration),
                    self._lose_node)
        self.at(self.cfg.duration, self._heal)
        for client in self.clients:
            self.at(self.rng.uniform(0, 0.02), client.next_op)
        end = self.cfg.duration + self.cfg.settle
        while self._heap and self._heap[0][0] <= end:
            self.now, _, fn = heapq.heappop(self._heap)
            self.events += 1
            fn()
        return self._result()

    def _result(self) -> SimResult:
        finals: dict[ChunkId, set[tuple[int, bytes]]] = {c: set() for c in self.chunk_ids}
        for chain in self.mgr.routing().chains:
            for t in chain.targets:
                if t.state is TargetState.SERVING:
                    engine = self.nodes[t.node_id].engines[t.target_id]
                    for cid in self.chunk_ids:
                        if self.chain_of(cid) == chain.chain_id:
                            v = engine.committed.get(cid, _Version(0, b"", {}))
                            finals[cid].add((v.version, v.data))
        states = [f"chain {c.chain_id} v{c.chain_version}: " + ", ".join(f"{t.target_id}:{t.state.value}" for t in c.targets)
                  for c in self.mgr.routing().chains]
        stuck = [f"target {m.target_id} chunk {cid}: {m.chunk_versions(cid)}"
                 for n in self.nodes.values() if not n.lost for m in n.members.values() for cid in self.chunk_ids
                 if m.chunk_versions(cid)[1] is not None]
        calm = {cid: max(self.cfg.duration if self._node_faults() else 0.0,
                         self.reconfigured_at.get(self.chain_of(cid), 0.0),
                         self.recovering_until.get(self.chain_of(cid), 0.0)) for cid in self.chunk_ids}
        return SimResult(self.seed, self.history, self.checksum_reports, finals, states, stuck, self.cfg.duration,
                         self.events, self.lost_targets, calm, self.cfg.liveness_bound, self.counts)

    def _node_faults(self) -> bool:
        """Whether nodes crash, get cut off or see mgmtd fail over (else only the network and disks misbehave)."""
        return bool(self.cfg.max_down or self.cfg.cut_off_share or self.cfg.failover_share)

    def chain_of(self, cid: ChunkId) -> int:
        return 1 + cid.index % self.cfg.chains

    # --------------------------------------------------------------------------------------- network

    def send(self, deliver: Callable[[], None], src: _Node | None = None, dst: _Node | None = None) -> None:
        """Deliver later, unless dropped; a connection reset at either end (``src``/``dst``) loses it too."""
        if self.faults and self.rng.random() < self.cfg.drop:
            return
        slow = self.faults and self.rng.random() < self.cfg.slow
        epochs = (src and src.epoch, dst and dst.epoch)

        def arrive() -> None:
            if (src and src.epoch, dst and dst.epoch) == epochs:
                deliver()

        self.at(self.rng.uniform(0.02, 0.08) if slow else self.rng.uniform(0.0005, 0.004), arrive)

    def to_target(self, target: int, fn: Callable[[_Node, ChainMember], None], src: _Node | None = None) -> None:
        node = self.nodes[self.mgr.state.target_nodes[target]]

        def deliver() -> None:
            if node.alive:
                fn(node, node.members[target])

        self.send(deliver, src, node)

    # ------------------------------------------------------------------------------------------ nodes

    def _start_node_timers(self, node: _Node) -> None:
        inc = node.incarnation

        def heartbeat() -> None:
            if not node.alive or node.incarnation != inc:
                return
            hb = Heartbeat(node.node_id, inc, f"sim://{node.node_id}", self.now,
                           unclean_targets=tuple(node.targets) if node.unclean else ())
            if self.now >= node.cut_off_until:
                self.send(lambda: self._mgmtd_heartbeat(node, hb), src=node)
            self.at(self.cfg.heartbeat_every, heartbeat)

        def tick() -> None:
            if not node.alive or node.incarnation != inc:
                return
            for target, member in node.members.items():
                self.execute(node, target, member.handle(Tick(self.now)))
            self.at(self.cfg.tick_every, tick)

        def flush() -> None:
            if node.alive and node.incarnation == inc:
                for engine in node.engines.values():
                    engine.flush()
                self.at(self.rng.uniform(0.5, 1.5) * self.cfg.flush_every, flush)

        self.at(self.rng.uniform(0, self.cfg.heartbeat_every), heartbeat)
        self.at(self.rng.uniform(0, self.cfg.tick_every), tick)
        if self.cfg.rollback_share:
            self.at(self.rng.uniform(0, self.cfg.flush_every), flush)

    def _mgmtd_heartbeat(self, node: _Node, hb: Heartbeat) -> None:
        before = set(self.mgr.state.recoveries)
        reply, _ = self.mgr.heartbeat(hb, self.now)
        for chain_id in set(self.mgr.state.recoveries) - before:
            self.counts["lastsrv recoveries"] += 1
            if node.rolled_back:
                self.counts["rolled-back lastsrv recoveries"] += 1

        def deliver() -> None:
            if node.alive and node.incarnation == hb.incarnation:
                for target, member in node.members.items():
                    cfg = reply.routing.chain(node.targets[target])
                    self.execute(node, target, member.handle(Configure(cfg, reply.lease_until)))

        self.send(deliver, dst=node)

    def _mgmtd_tick(self) -> None:
        before = set(self.mgr.state.recoveries)
        self.mgr.tick(self.now)
        self.counts["recovery waits expired"] += len(before - set(self.mgr.state.recoveries))
        for chain in self.mgr.routing().chains:
            if chain.recovering:
                self.recovering_until[chain.chain_id] = self.now
            if chain.chain_id not in self.reconfigured_at and any(
                    chain.state_of(t) not in (TargetState.SERVING, TargetState.SYNCING) for t in self.lost_targets
                    if t in {x.target_id for x in chain.targets}):
                self.reconfigured_at[chain.chain_id] = self.now
        self.at(self.cfg.tick_every, self._mgmtd_tick)

    def execute(self, node: _Node, target: int, effects: list[Effect]) -> None:
        """The driver: run a member's effects against the engine model and the network, in order."""
        engine = node.engines[target]
        inc = node.incarnation
        for e in effects:
            if isinstance(e, Send):
                msg = e.msg
                if isinstance(msg, ResyncState):
                    self._count_resync_differences(msg, e.target)
                    msg = engine.listed(msg)
                elif isinstance(msg, ResyncPull):
                    self.counts["chunks pulled by a recovering target"] += len(msg.chunks)
                elif isinstance(msg, UpdateAck) and msg.resync and msg.status is AckStatus.VERSION_GAP:
                    self.counts["resync copies refused (sent whole next)"] += 1
                self.to_target(e.target, lambda n, m, msg=msg: self.execute(n, m.target_id, m.handle(msg)), node)
            elif isinstance(e, SendChunk):
                msg = engine.copy(e)
                self.counts["resync copies" if msg.resync else "full-chunk updates"] += 1
                if msg.delta is not None:
                    self.counts["resync copies as changed slots"] += 1
                self.to_target(e.target, lambda n, m, msg=msg: self.execute(n, m.target_id, m.handle(msg)), node)
            elif isinstance(e, PersistPending):
                self.at(self._persist_time(node), lambda e=e: self._persisted(node, inc, target, e))
            elif isinstance(e, Commit):
                engine.commit(e.chunk_id, e.version)
                self.committed_max[e.chunk_id] = max(self.committed_max.get(e.chunk_id, 0), e.version)
            elif isinstance(e, DropChunks):
                engine.remove(e.chunk_ids)
                self.to_target(e.target, lambda n, m, msg=e.ack: self.execute(n, m.target_id, m.handle(msg)), node)
            elif isinstance(e, ReplyClient):
                client = self.clients[e.msg.client_id - 1]
                self.send(lambda msg=e.msg, client=client: client.on_write_resp(msg), src=node)
            elif isinstance(e, ReportToMgmtd):
                self.send(lambda msg=e.msg: self._mgmtd_report(msg), src=node)

    def _count_resync_differences(self, state: ResyncState, pred: int) -> None:
        """How a returning replica differs from its predecessor: what resync's "version or CRC differs" sees."""
        theirs = self.nodes[self.mgr.state.target_nodes[pred]].engines[pred].committed
        for chunk in state.chunks:
            v = theirs.get(chunk.chunk_id)
            if v is not None and chunk.version < v.version:
                self.counts["resync: replica behind"] += 1
            elif v is not None and chunk.version > v.version:
                self.counts["resync: replica ahead"] += 1
            elif v is not None and chunk.crc != crc32c(v.data):
                self.counts["resync: same version, other data"] += 1

    def _persist_time(self, node: _Node) -> float:
        """Usually faster than a round trip; sometimes slower; never before a stalled disk recovers."""
        if self.cfg.slow_persist and self.rng.random() < self.cfg.slow_persist:
            self.counts["slow persists"] += 1
            delay = self.rng.uniform(0.005, 0.04)
        else:
            delay = self.rng.uniform(0.0002, 0.003)
        return max(delay, node.disk_stalled_until - self.now + delay)

    def _persisted(self, node: _Node, inc: int, target: int, p: PersistPending) -> None:
        if node.alive and node.incarnation == inc:  # a crash before completion loses the write
            stored = None if _bad_kept_block(target, p) else node.engines[target].write_pending(p)
            done = PersistFailed(p.chunk_id, p.version, errno.EIO, "delta does not fit") if stored is None else \
                Persisted(p.chunk_id, p.version, *stored)
            self.execute(node, target, node.members[target].handle(done))

    def _mgmtd_report(self, msg: ResyncDone | ChecksumReport) -> None:
        if isinstance(msg, ResyncDone):
            self.mgr.resync_done(msg)
        else:
            self.checksum_reports.append(msg)

    # ------------------------------------------------------------------------------------------ reads

    def read_at(self, target: int, client: _Client, tag: int, req: ReadReq) -> None:
        def arrive(node: _Node, member: ChainMember) -> None:
            decision = member.read_decision(req.chunk_id, req.chain_version)
            if isinstance(decision, AskTail):
                node.reads[(target, decision.query.query_id)] = (client.client_id, tag, req)
                q = decision.query
                self.to_target(decision.target, lambda n, m: self._answer_query(n, m, target, q), node)
            else:
                self._serve(node, target, client, tag, req, decision)

        self.to_target(target, arrive)

    def _answer_query(self, node: _Node, tail: ChainMember, asker: int, q: VersionQuery) -> None:
        reply = tail.answer_version_query(q)
        self.to_target(asker, lambda n, m: self._tail_answered(n, m, reply), node)

    def _tail_answered(self, node: _Node, member: ChainMember, reply: VersionReply) -> None:
        waiting = node.reads.pop((member.target_id, reply.query_id), None)
        if waiting is not None:
            client_id, tag, req = waiting
            decision = member.decide_with_tail(req.chunk_id, reply)
            self._serve(node, member.target_id, self.clients[client_id - 1], tag, req, decision)

    def _serve(self, node: _Node, target: int, client: _Client, tag: int, req: ReadReq,
               decision: ServeVersion | Retry) -> None:
        if isinstance(decision, ServeVersion):
            data = node.engines[target].read(req.chunk_id, decision.version)
            if data is None:
                decision = Retry(NotCommitted("version gone"))
            else:
                resp = ReadResp(req.chain_id, req.chain_version, req.chunk_id, version=decision.version,
                                data=data[req.offset: req.offset + req.length])
        if isinstance(decision, Retry):
            resp = ReadResp(req.chain_id, req.chain_version, req.chunk_id, decision.error.errno, decision.error.message)
        self.send(lambda: client.on_read_resp(tag, resp), src=node)

    # ----------------------------------------------------------------------------------------- faults

    def _fault(self) -> None:
        if not self.faults:
            return
        cfg = self.cfg
        down = [n for n in self.nodes.values() if not n.alive and not n.lost]
        node = self.rng.choice(list(self.nodes.values()))
        if self.rng.random() < cfg.failover_share:
            self._mgmtd_failover()
        elif self.rng.random() < cfg.cut_off_share:
            # cut off from mgmtd: it keeps serving peers and clients with old routing until its lease runs out
            node.cut_off_until = self.now + self.rng.uniform(0.1, 0.8)
        elif cfg.reset_share and self.rng.random() < cfg.reset_share:
            node.epoch += 1
            self.counts["connection resets"] += 1
        elif cfg.stall_share and self.rng.random() < cfg.stall_share:
            node.disk_stalled_until = max(node.disk_stalled_until, self.now + self.rng.uniform(0.05, 0.3))
            self.counts["disk stalls"] += 1
        elif len(down) < cfg.max_down and node.alive:
            self._crash(node, rollback=bool(cfg.rollback_share) and self.rng.random() < cfg.rollback_share)
            self.at(self.rng.uniform(0.05, 0.6), lambda: self._restart(node))
        self.at(self.rng.expovariate(1 / cfg.crash_every), self._fault)

    def _crash(self, node: _Node, rollback: bool) -> None:
        """Stop ``node``; with ``rollback``, its engines also lose what no flush covered, unless that would lose
        every copy of a write the chain may have acknowledged or served (then it is a plain crash)."""
        node.alive = False
        node.unclean = bool(self.cfg.rollback_share)  # any stop of a write-back server is unclean
        node.rolled_back = rollback and self._others_cover(node, lambda e: e.unflushed())
        self.counts["crashes"] += 1
        if node.rolled_back:
            self.counts["rollbacks"] += 1
            self.counts["versions rolled back"] += sum(len(e.unflushed()) for e in node.engines.values())
            for engine in node.engines.values():
                engine.lose_unflushed()

    def _others_cover(self, node: _Node, losing: Callable[[MemEngine], list[tuple[ChunkId, _Version]]]) -> bool:
        """Whether each version ``node`` would lose (``losing`` of each engine) that some replica committed (so a
        client may have seen it) is committed, or something newer is, at another replica not lost for good,
        whatever its state. Losing every copy of an acknowledged write is physics, not a protocol bug."""
        routing = self.mgr.routing()
        for target, engine in node.engines.items():
            chain = routing.chain(node.targets[target])
            others = [self.nodes[t.node_id].engines[t.target_id] for t in chain.targets
                      if t.target_id != target and not self.nodes[t.node_id].lost]
            for cid, lost in losing(engine):
                seen = lost.version <= self.committed_max.get(cid, 0)
                if seen and not any(e.holds(cid, lost) for e in others):
                    return False
        return True

    def _up(self, node_id: int) -> bool:
        """Alive, in touch with mgmtd (not cut off, a recent heartbeat) and known to it as this incarnation: mgmtd
        will not take it out of its chains unless a new fault hits it."""
        node, info = self.nodes[node_id], self.mgr.state.nodes.get(node_id)
        return (node.alive and node.cut_off_until <= self.now and info is not None and info.alive
                and info.incarnation == node.incarnation and self.now - info.last_heartbeat < self.cfg.heartbeat_timeout / 2)

    def _lose_node(self) -> None:
        """A node dies for good (disk gone, host retired): its chains must go on with the other replicas. Only a
        node none of whose chains depends on it alone (another serving replica is up): losing a chain's last
        up-to-date copy loses data, which no protocol recovers from."""
        routing = self.mgr.routing()
        candidates = [n for n in self.nodes.values() if n.alive and all(
            any(t.target_id != target and t.state is TargetState.SERVING and self._up(t.node_id)
                for t in routing.chain(chain_id).targets) for target, chain_id in n.targets.items())
            and self._others_cover(n, lambda e: [*e.committed.items(), *e.pending.items()])]
        if not candidates:
            if self.now < self.cfg.duration + self.cfg.settle / 2:
                self.at(0.05, self._lose_node)
            return
        node = self.rng.choice(candidates)
        node.lost = True
        self.lost_targets |= set(node.targets)
        self.counts["nodes lost"] += 1
        self._crash(node, rollback=False)

    def _mgmtd_failover(self) -> None:
        """A standby takes over: it loads the persisted state and gives every node a fresh grace period."""
        state = msgspec.msgpack.decode(msgspec.msgpack.encode(self.mgr.state), type=ClusterState)
        for info in state.nodes.values():
            info.last_heartbeat = self.now
        self.mgr = ClusterManager(self.cfg.heartbeat_timeout, self.cfg.lease, state, recovery_wait=self.cfg.recovery_wait)

    def _restart(self, node: _Node) -> None:
        if not node.alive and not node.lost:
            node.alive = True
            node.incarnation += 1
            node.boot()
            self._start_node_timers(node)

    def _heal(self) -> None:
        self.faults = False
        for node in self.nodes.values():
            node.cut_off_until = 0.0
            self._restart(node)
        for client in self.clients:
            client.stop_at = self.now + self.cfg.settle / 2


@dataclass(eq=False)
class _ClientOp:
    kind: str
    chunk: ChunkId
    value: bytes
    invoke: float
    request_id: int
    slot: int = 0
    tag: int = -1  # the attempt in flight; -1 while waiting to retry


class _Client:
    """Issues one operation at a time on a random chunk; retries with the same request id until it gives up."""

    def __init__(self, sim: Sim, client_id: int) -> None:
        self.sim = sim
        self.client_id = client_id
        self.routing = sim.mgr.routing()
        self.request_id = 0
        self.stop_at = math.inf
        self.tags = itertools.count(1)
        self.op: _ClientOp | None = None

    def next_op(self) -> None:
        if self.sim.now >= self.stop_at:
            return
        self.request_id += 1
        cid = self.sim.rng.choice(self.sim.chunk_ids)
        if self.sim.rng.random() < (0.7, 0.5, 0.1)[self.client_id % 3]:  # writers, mixed, mostly readers
            value = f"c{self.client_id}r{self.request_id}".encode().ljust(SLOT, b".")
            slot = self.sim.rng.randrange(SLOTS)
            self.op = _ClientOp("write", cid, value, self.sim.now, self.request_id, slot)
        else:
            self.op = _ClientOp("read", cid, b"", self.sim.now, self.request_id)
        self.attempt(self.op)

    def attempt(self, op: _ClientOp) -> None:
        if self.op is not op:
            return
        if self.sim.now - op.invoke > self.sim.cfg.give_up_after:
            if op.kind == "write":  # unknown outcome: may or may not have happened
                self.sim.history[op.chunk, op.slot].append(Op("write", op.value, op.invoke, None, self.label()))
            return self.finish()
        op.tag = tag = next(self.tags)
        self.sim.at(self.sim.cfg.client_timeout, lambda: self.failed(op, tag))
        chain = self.routing.chain(self.sim.chain_of(op.chunk))
        serving = [t.target_id for t in chain.targets if t.state is TargetState.SERVING]
        if not serving:
            return
        if op.kind == "write":
            w = WriteReq(chain.chain_id, chain.chain_version, op.chunk, self.client_id, op.request_id,
                         op.slot * SLOT, crc32c(op.value), op.value)
            self.sim.to_target(serving[0], lambda n, m: self.sim.execute(n, m.target_id, m.handle(w)))
        else:
            r = ReadReq(chain.chain_id, chain.chain_version, op.chunk, 0, SLOTS * SLOT)
            # mostly a preferred replica (as a client near one would), so stale routing is not refreshed by luck
            sticky = self.sim.rng.random() < 0.8
            target = serving[self.client_id % len(serving)] if sticky else self.sim.rng.choice(serving)
            self.sim.read_at(target, self, tag, r)

    def failed(self, op: _ClientOp, tag: int, backoff: float = 0.0) -> None:
        """Timeout or error of attempt ``tag``: refresh routing and try again (same request id)."""
        if self.op is op and op.tag == tag:
            op.tag = -1
            self.routing = self.sim.mgr.routing()
            self.sim.at(backoff, lambda: self.attempt(op))

    def on_write_resp(self, msg: WriteResp) -> None:
        assert msg.client_id == self.client_id, f"reply for client {msg.client_id} delivered to {self.client_id}"
        op = self.op
        if op is None or op.kind != "write" or msg.request_id != op.request_id:
            return
        if msg.errno:
            return self.failed(op, op.tag, backoff=0.005)
        self.sim.history[op.chunk, op.slot].append(Op("write", op.value, op.invoke, self.sim.now, self.label()))
        self.finish()

    def on_read_resp(self, tag: int, msg: ReadResp) -> None:
        op = self.op
        if op is None or op.kind != "read" or op.tag != tag:
            return
        if msg.errno:
            return self.failed(op, tag, backoff=0.005)
        for slot in range(SLOTS):
            value = msg.data[slot * SLOT: (slot + 1) * SLOT].strip(b"\0")  # never written: zeros or nothing
            self.sim.history[op.chunk, slot].append(Op("read", value, op.invoke, self.sim.now, self.label()))
        self.finish()

    def label(self) -> str:
        return f"client {self.client_id} req {self.op.request_id}"

    def finish(self) -> None:
        self.op = None
        self.sim.at(self.sim.rng.uniform(0.002, 0.03), self.next_op)


def run(seed: int, cfg: SimConfig | None = None) -> SimResult:
    return Sim(seed, cfg).run()


def check(result: SimResult) -> list[str]:
    """Everything wrong with a run, as readable lines; empty when the run is correct."""
    problems = []
    for (cid, slot), ops in result.history.items():
        if not check_register(ops):
            lines = "\n".join(f"  {o.kind} {o.value!r} [{o.invoke:.4f}, {o.response}] {o.label}" for o in ops)
            problems.append(f"chunk {cid} slot {slot} history is not linearizable:\n{lines}")
    for cid, replicas in result.final_replicas.items():
        if len(replicas) != 1:
            problems.append(f"chunk {cid} replicas diverge after healing: {replicas}")
    unhealthy = [s for line in result.final_states for s in line.split(": ", 1)[1].split(", ")
                 if s.endswith(":serving") == (int(s.split(":")[0]) in result.lost_targets)]
    if unhealthy:
        problems.append(f"chains did not recover (lost targets {sorted(result.lost_targets)}): {result.final_states}")
    if result.stuck:
        problems.append(f"writes stuck after healing: {result.stuck}")
    late = [o for (cid, _), ops in result.history.items() for o in ops if o.kind == "write"
            and o.invoke >= result.calm_since[cid] and (o.response or math.inf) - o.invoke > result.liveness_bound]
    if late:
        problems.append(f"writes issued once the cluster was calm took over {result.liveness_bound} s: {late}")
    if result.checksum_reports:
        problems.append(f"checksum reports: {result.checksum_reports}")
    return problems
