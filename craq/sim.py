"""Deterministic whole-cluster simulation: mgmtd logic, chain members, chunk engines and clients in one process.

One seeded :class:`random.Random` drives everything: message delays (so reordering), drops, node crashes
and restarts (a restarted node keeps only what its engine persisted), and nodes cut off from mgmtd (their
read lease must fence them). Clients time out, refresh routing and retry with the same request id.

Each chunk holds ``SLOTS`` registers of ``SLOT`` bytes; a write is a partial chunk write of a unique value to
one slot (so successors must apply it on the right base version), a read reads the whole chunk. Histories are
kept per (chunk, slot). :func:`run` returns them; :func:`check` verifies them.

Simplifications: mgmtd fails over instantly (a standby loads the persisted state) and clients read its routing
directly (heartbeats and ResyncDone do go through the lossy network); one target per chain per node.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Callable

import msgspec
from crc32c import crc32c

from kvfs.errors import NotCommitted

from kvfs.craq.cluster import ClusterManager, ClusterState, Heartbeat
from kvfs.craq.linearizable import Op, check_register
from kvfs.craq.member import (
    AskTail, ChainMember, ChunkState, Commit, Configure, Effect, PersistPending, Persisted, ReplyClient,
    ReportToMgmtd, Retry, Send, SendChunk, ServeVersion, Tick,
)
from kvfs.craq.messages import (
    ChecksumReport, ChunkId, ReadReq, ReadResp, ResyncDone, TargetState, VersionQuery, VersionReply, WriteReq, WriteResp,
)


SLOTS, SLOT = 2, 8


@dataclass
class _Version:
    version: int
    data: bytes
    requests: dict[int, int]


@dataclass
class MemEngine:
    """Model of the chunk engine: per chunk a committed and a pending version, copy-on-write."""

    committed: dict[ChunkId, _Version] = field(default_factory=dict)
    pending: dict[ChunkId, _Version] = field(default_factory=dict)

    def write_pending(self, p: PersistPending) -> tuple[int, int]:
        committed = self.committed.get(p.chunk_id, _Version(0, b"", {})).version
        assert p.force or p.version > committed, f"{p} is not newer than committed {committed}"
        base = b"" if p.full_replace else self.committed.get(p.chunk_id, _Version(0, b"", {})).data
        data, at = bytearray(base), 0
        for offset, length in p.extents or [(p.offset, len(p.data))]:
            data += bytes(max(0, offset - len(data)))  # a run past the end: zeros up to it
            data[offset:offset + length] = p.data[at:at + length]
            at += length
        data = bytes(data)
        self.pending[p.chunk_id] = _Version(p.version, data, p.requests)
        return crc32c(data), len(data)

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


@dataclass
class SimResult:
    seed: int
    history: dict[tuple[ChunkId, int], list[Op]]  # per (chunk, slot)
    checksum_reports: list[ChecksumReport]
    final_replicas: dict[ChunkId, set[tuple[int, bytes]]]  # per chunk: (version, data) at each serving target
    final_states: list[str]
    stuck: list[str]  # pending versions left at the end, when everything should have settled
    healed_at: float
    events: int


class _Node:
    def __init__(self, node_id: int, targets: dict[int, int], scan_every: float = 0.0) -> None:
        self.node_id = node_id
        self.scan_every = scan_every
        self.targets = targets  # target id -> chain id
        self.engines = {t: MemEngine() for t in targets}
        self.incarnation = 1
        self.alive = True
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
        self.mgr = ClusterManager(cfg.heartbeat_timeout, cfg.lease)
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

    # ------------------------------------------------------------------------------------- scheduler

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (self.now + delay, next(self._seq), fn))

    def run(self) -> SimResult:
        for node in self.nodes.values():
            self._start_node_timers(node)
        self.at(self.cfg.tick_every, self._mgmtd_tick)
        self.at(self.rng.expovariate(1 / self.cfg.crash_every), self._fault)
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
                 for n in self.nodes.values() for m in n.members.values() for cid in self.chunk_ids
                 if m.chunk_versions(cid)[1] is not None]
        return SimResult(self.seed, self.history, self.checksum_reports, finals, states, stuck, self.cfg.duration,
                         self.events)

    def chain_of(self, cid: ChunkId) -> int:
        return 1 + cid.index % self.cfg.chains

    # --------------------------------------------------------------------------------------- network

    def send(self, deliver: Callable[[], None], lossless: bool = False) -> None:
        if self.faults and not lossless and self.rng.random() < self.cfg.drop:
            return
        slow = self.faults and self.rng.random() < self.cfg.slow
        self.at(self.rng.uniform(0.02, 0.08) if slow else self.rng.uniform(0.0005, 0.004), deliver)

    def to_target(self, target: int, fn: Callable[[_Node, ChainMember], None]) -> None:
        node = self.nodes[self.mgr.state.target_nodes[target]]

        def deliver() -> None:
            if node.alive:
                fn(node, node.members[target])

        self.send(deliver)

    # ------------------------------------------------------------------------------------------ nodes

    def _start_node_timers(self, node: _Node) -> None:
        inc = node.incarnation

        def heartbeat() -> None:
            if not node.alive or node.incarnation != inc:
                return
            hb = Heartbeat(node.node_id, inc, f"sim://{node.node_id}", self.now)
            if self.now >= node.cut_off_until:
                self.send(lambda: self._mgmtd_heartbeat(node, hb))
            self.at(self.cfg.heartbeat_every, heartbeat)

        def tick() -> None:
            if not node.alive or node.incarnation != inc:
                return
            for target, member in node.members.items():
                self.execute(node, target, member.handle(Tick(self.now)))
            self.at(self.cfg.tick_every, tick)

        self.at(self.rng.uniform(0, self.cfg.heartbeat_every), heartbeat)
        self.at(self.rng.uniform(0, self.cfg.tick_every), tick)

    def _mgmtd_heartbeat(self, node: _Node, hb: Heartbeat) -> None:
        reply, _ = self.mgr.heartbeat(hb, self.now)

        def deliver() -> None:
            if node.alive and node.incarnation == hb.incarnation:
                for target, member in node.members.items():
                    cfg = reply.routing.chain(node.targets[target])
                    self.execute(node, target, member.handle(Configure(cfg, reply.lease_until)))

        self.send(deliver)

    def _mgmtd_tick(self) -> None:
        self.mgr.tick(self.now)
        self.at(self.cfg.tick_every, self._mgmtd_tick)

    def execute(self, node: _Node, target: int, effects: list[Effect]) -> None:
        """The driver: run a member's effects against the engine model and the network, in order."""
        engine = node.engines[target]
        inc = node.incarnation
        for e in effects:
            if isinstance(e, Send):
                msg = e.msg
                self.to_target(e.target, lambda n, m, msg=msg: self.execute(n, m.target_id, m.handle(msg)))
            elif isinstance(e, SendChunk):
                msg = msgspec.structs.replace(e.msg, data=engine.read(e.msg.chunk_id, e.msg.version))
                self.to_target(e.target, lambda n, m, msg=msg: self.execute(n, m.target_id, m.handle(msg)))
            elif isinstance(e, PersistPending):
                self.at(self.rng.uniform(0.0002, 0.003), lambda e=e: self._persisted(node, inc, target, e))
            elif isinstance(e, Commit):
                engine.commit(e.chunk_id, e.version)
            elif isinstance(e, ReplyClient):
                client = self.clients[e.msg.client_id - 1]
                self.send(lambda msg=e.msg, client=client: client.on_write_resp(msg))
            elif isinstance(e, ReportToMgmtd):
                self.send(lambda msg=e.msg: self._mgmtd_report(msg))

    def _persisted(self, node: _Node, inc: int, target: int, p: PersistPending) -> None:
        if node.alive and node.incarnation == inc:  # a crash before completion loses the write
            crc, length = node.engines[target].write_pending(p)
            self.execute(node, target, node.members[target].handle(Persisted(p.chunk_id, p.version, crc, length)))

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
                self.to_target(decision.target, lambda n, m: self._answer_query(m, target, q))
            else:
                self._serve(node, target, client, tag, req, decision)

        self.to_target(target, arrive)

    def _answer_query(self, tail: ChainMember, asker: int, q: VersionQuery) -> None:
        reply = tail.answer_version_query(q)
        self.to_target(asker, lambda n, m: self._tail_answered(n, m, reply))

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
        self.send(lambda: client.on_read_resp(tag, resp))

    # ----------------------------------------------------------------------------------------- faults

    def _fault(self) -> None:
        if not self.faults:
            return
        down = [n for n in self.nodes.values() if not n.alive]
        node = self.rng.choice(list(self.nodes.values()))
        if self.rng.random() < self.cfg.failover_share:
            self._mgmtd_failover()
        elif self.rng.random() < self.cfg.cut_off_share:
            # cut off from mgmtd: it keeps serving peers and clients with old routing until its lease runs out
            node.cut_off_until = self.now + self.rng.uniform(0.1, 0.8)
        elif len(down) < self.cfg.max_down and node.alive:
            node.alive = False
            self.at(self.rng.uniform(0.05, 0.6), lambda: self._restart(node))
        self.at(self.rng.expovariate(1 / self.cfg.crash_every), self._fault)

    def _mgmtd_failover(self) -> None:
        """A standby takes over: it loads the persisted state and gives every node a fresh grace period."""
        state = msgspec.msgpack.decode(msgspec.msgpack.encode(self.mgr.state), type=ClusterState)
        for info in state.nodes.values():
            info.last_heartbeat = self.now
        self.mgr = ClusterManager(self.cfg.heartbeat_timeout, self.cfg.lease, state)

    def _restart(self, node: _Node) -> None:
        if not node.alive:
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
    if any(not s.endswith(":serving") for line in result.final_states for s in line.split(": ", 1)[1].split(", ")):
        problems.append(f"chains did not recover: {result.final_states}")
    if result.stuck:
        problems.append(f"writes stuck after healing: {result.stuck}")
    late = [o for ops in result.history.values() for o in ops if o.response is None and o.invoke > result.healed_at]
    if late:
        problems.append(f"writes issued after healing never completed: {late}")
    if result.checksum_reports:
        problems.append(f"checksum reports: {result.checksum_reports}")
    return problems
