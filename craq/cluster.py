"""The cluster manager's logic (mgmtd), sans-I/O: nodes, heartbeats, chain tables, target states.

Rules
-----
- Time is injected (``now`` arguments); nothing here reads a clock or does I/O.
- A node is dead when no heartbeat arrived for ``heartbeat_timeout``. A node that comes back with a new
  incarnation (it restarted) is treated as having died in between: its in-memory replication state is gone.
- A dead target moves to the end of its chain as offline (lastsrv when it was the last serving one) and the
  chain version is bumped; writes go on with the remaining replicas.
- A target whose node is alive again becomes waiting (a lastsrv target serving again, if nothing else serves);
  one waiting target per chain at a time becomes syncing, placed right after the serving ones; after its
  predecessor reports :class:`ResyncDone` for the current chain version it becomes serving.
- Recovery: a lastsrv target whose heartbeat says it may have lost unflushed writes (``unclean_targets``: its
  engine opened after an unclean stop in write-back mode) must not serve its rolled-back versions while another
  target of the chain may return with newer ones it acknowledged. It becomes serving in a *recovering* chain
  (:attr:`ChainConfig.recovering`: it serves nothing), every other target of the chain is awaited, and each
  returning one syncs in turn only so that the recovering target pulls the chunks it holds newer; its
  :class:`ResyncDone` puts it back to waiting. Once none is awaited the chain serves and resyncs the others as usual;
  after ``recovery_wait`` the awaited targets that are down are given up on (lost for good, say; logged loudly,
  since what only they held is lost).
- Chain order is always serving, syncing, waiting, lastsrv, offline (stable within a state, newly down last).
- Heartbeat replies grant a read lease of ``lease`` (< ``heartbeat_timeout``) from the heartbeat's send time,
  so a node mgmtd declares dead has stopped serving reads by then.

Every piece of state is a msgspec Struct (:class:`ClusterState`) so the service can persist it as is.
"""

from __future__ import annotations

import logging

import msgspec

from kvfs.errors import KvfsError

from kvfs.craq.messages import ChainConfig, ChainTarget, ResyncDone, TargetState

log = logging.getLogger("kvfs.mgmtd")


class NodeInfo(msgspec.Struct):
    node_id: int
    address: str
    incarnation: int
    last_heartbeat: float
    alive: bool = True


class Recovery(msgspec.Struct):
    """A chain whose only serving target may have lost unflushed writes: the targets it waits for."""

    target_id: int
    since: float
    awaiting: list[int]


class ClusterState(msgspec.Struct):
    nodes: dict[int, NodeInfo] = {}
    target_nodes: dict[int, int] = {}  # target id -> node id
    chains: dict[int, ChainConfig] = {}
    recoveries: dict[int, Recovery] = {}  # chain id -> its recovery, while the chain is recovering


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    node_id: int
    incarnation: int
    address: str
    sent_at: float  # the node's clock; the lease counts from here
    #: resyncs this node drives: syncing target id -> (chunks still to copy, chunks to copy in all; -1 unknown)
    resync: dict[int, tuple[int, int]] = {}
    #: targets whose engine opened after an unclean stop in write-back mode: they may have lost acknowledged
    #: writes no flush covered, so they must not serve alone while another replica may hold them (Recovery)
    unclean_targets: tuple[int, ...] = ()


class RoutingSnapshot(msgspec.Struct, frozen=True, tag=True):
    """What clients and chunk servers route by: every chain in order, and where each node listens."""

    chains: tuple[ChainConfig, ...]
    addresses: dict[int, str]

    def chain(self, chain_id: int) -> ChainConfig:
        return next(c for c in self.chains if c.chain_id == chain_id)


class HeartbeatReply(msgspec.Struct, frozen=True, tag=True):
    routing: RoutingSnapshot
    lease_until: float


_ORDER = {TargetState.SERVING: 0, TargetState.SYNCING: 1, TargetState.WAITING: 2, TargetState.LASTSRV: 3,
          TargetState.OFFLINE: 4}


class ClusterManager:
    """mgmtd's decisions. The service persists :attr:`state` after every call that returns changed chains."""

    def __init__(self, heartbeat_timeout: float, lease: float, state: ClusterState | None = None, *,
                 recovery_wait: float = 600.0) -> None:
        """``recovery_wait``: how long a recovering chain waits for its other targets before it serves without
        them (they may be lost for good); what only they held is lost then."""
        if not 0 < lease < heartbeat_timeout:
            raise ValueError("the read lease must be shorter than the failure timeout")
        self.heartbeat_timeout = heartbeat_timeout
        self.lease = lease
        self.recovery_wait = recovery_wait
        self.state = state or ClusterState()

    # ------------------------------------------------------------------------------------ chain tables

    def create_chains(self, targets: list[tuple[int, int]], replicas: int, first_chain_id: int = 1) -> list[int]:
        """Group ``(target_id, node_id)`` pairs into chains of ``replicas`` targets on distinct nodes.

        Greedy: each chain takes one target from each of the ``replicas`` nodes with most targets left,
        which succeeds whenever any grouping does for equal-sized nodes. Successive chains rotate the order of
        their nodes, so that with several targets per node each node heads some chains and ends others: a head
        does more work per write than the rest, and chains that all start at one node would queue every write
        there.
        """
        left: dict[int, list[int]] = {}
        for target_id, node_id in targets:
            left.setdefault(node_id, []).append(target_id)
            self.state.target_nodes[target_id] = node_id
        created = []
        for chain_id in range(first_chain_id, first_chain_id + len(targets) // replicas):
            nodes = sorted((n for n in left if left[n]), key=lambda n: (-len(left[n]), n))[:replicas]
            if len(nodes) < replicas:
                raise KvfsError(f"cannot place chain {chain_id}: fewer than {replicas} nodes with free targets")
            turn = len(created) % replicas
            members = tuple(ChainTarget(left[n].pop(0), n, TargetState.SERVING) for n in nodes[turn:] + nodes[:turn])
            self.state.chains[chain_id] = ChainConfig(chain_id, 1, members)
            created.append(chain_id)
        return created

    def routing(self) -> RoutingSnapshot:
        return RoutingSnapshot(
            tuple(self.state.chains[c] for c in sorted(self.state.chains)),
            {n.node_id: n.address for n in self.state.nodes.values()},
        )

    # ----------------------------------------------------------------------------------- node liveness

    def heartbeat(self, hb: Heartbeat, now: float) -> tuple[HeartbeatReply, list[int]]:
        """Record a heartbeat; returns the reply and the ids of chains that changed."""
        node = self.state.nodes.get(hb.node_id)
        changed: list[int] = []
        # an incarnation's unclean stop counts once, when it first shows up: cut off later, it lost nothing more
        unclean = set(hb.unclean_targets) if node is None or node.incarnation != hb.incarnation else set()
        if node is not None and node.alive and node.incarnation != hb.incarnation:
            changed += self._node_down(hb.node_id)  # restarted between two heartbeats
        if node is None:
            node = self.state.nodes[hb.node_id] = NodeInfo(hb.node_id, hb.address, hb.incarnation, now)
        node.address, node.incarnation, node.last_heartbeat = hb.address, hb.incarnation, now
        if not node.alive:
            node.alive = True
        changed += self._node_up(hb.node_id, unclean, now)
        changed += self._start_resyncs()
        reply = HeartbeatReply(self.routing(), hb.sent_at + self.lease)
        return reply, sorted(set(changed))

    def tick(self, now: float) -> list[int]:
        """Declare nodes dead whose heartbeats stopped; returns the ids of chains that changed."""
        changed: list[int] = []
        for node in self.state.nodes.values():
            if node.alive and now - node.last_heartbeat > self.heartbeat_timeout:
                node.alive = False
                changed += self._node_down(node.node_id)
        for chain_id, recovery in list(self.state.recoveries.items()):
            if now - recovery.since < self.recovery_wait:
                continue
            # give up only on targets that are down: one that is back may be syncing, and its newer chunks still
            # have to be pulled before normal resync would overwrite them
            back = [t for t in recovery.awaiting if self.state.nodes[self.state.target_nodes[t]].alive]
            if back != recovery.awaiting:
                log.error("chain %d: targets %s did not return within %.0f s; target %d serves without them, and"
                          " acknowledged writes only they held are lost", chain_id,
                          sorted(set(recovery.awaiting) - set(back)), self.recovery_wait, recovery.target_id)
                recovery.awaiting = back
            if not back:
                del self.state.recoveries[chain_id]
                self._set(self.state.chains[chain_id], {})
                changed.append(chain_id)
        changed += self._start_resyncs()
        return sorted(set(changed))

    def resync_done(self, msg: ResyncDone) -> list[int]:
        """The syncing target's predecessor copied everything: make it serving (if nothing changed since). In a
        recovering chain the predecessor pulled what the target held newer: it waits again for the chain to serve."""
        chain = self.state.chains.get(msg.chain_id)
        if chain is None or chain.chain_version != msg.chain_version or chain.state_of(msg.target_id) is not TargetState.SYNCING:
            return []
        recovery = self.state.recoveries.get(msg.chain_id)
        if recovery is None:
            self._set(chain, {msg.target_id: TargetState.SERVING})
        else:
            recovery.awaiting = [t for t in recovery.awaiting if t != msg.target_id]
            if not recovery.awaiting:
                log.warning("chain %d: target %d recovered every newer chunk; serving again", msg.chain_id,
                            recovery.target_id)
                del self.state.recoveries[msg.chain_id]
            self._set(chain, {msg.target_id: TargetState.WAITING})
        return sorted({msg.chain_id, *self._start_resyncs()})

    # ------------------------------------------------------------------------------------- transitions

    def _targets_of(self, node_id: int) -> set[int]:
        return {t for t, n in self.state.target_nodes.items() if n == node_id}

    def _node_down(self, node_id: int) -> list[int]:
        mine = self._targets_of(node_id)
        changed = []
        for chain in list(self.state.chains.values()):
            serving = [t.target_id for t in chain.targets if t.state is TargetState.SERVING]
            new = {}
            for t in chain.targets:
                if t.target_id not in mine or t.state in (TargetState.OFFLINE, TargetState.LASTSRV):
                    continue
                last = t.state is TargetState.SERVING and set(serving) <= mine
                new[t.target_id] = TargetState.LASTSRV if last and t.target_id == serving[-1] else TargetState.OFFLINE
            if new:
                self._set(chain, new, to_end=True)
                changed.append(chain.chain_id)
        return changed

    def _node_up(self, node_id: int, unclean: set[int], now: float) -> list[int]:
        mine = self._targets_of(node_id)
        changed = []
        for chain in list(self.state.chains.values()):
            serving = any(t.state is TargetState.SERVING for t in chain.targets)
            new = {}
            for t in chain.targets:
                if t.target_id in mine and t.state is TargetState.OFFLINE:
                    new[t.target_id] = TargetState.WAITING
                elif t.target_id in mine and t.state is TargetState.LASTSRV and not serving:
                    new[t.target_id] = TargetState.SERVING
                    others = [o.target_id for o in chain.targets if o.target_id != t.target_id]
                    if t.target_id in unclean and others:
                        log.warning("chain %d: last serving target %d may have lost unflushed writes; it pulls newer"
                                    " chunks from targets %s before it serves", chain.chain_id, t.target_id, others)
                        self.state.recoveries[chain.chain_id] = Recovery(t.target_id, now, others)
            if new:
                self._set(chain, new)
                changed.append(chain.chain_id)
        return changed

    def _start_resyncs(self) -> list[int]:
        changed = []
        for chain in list(self.state.chains.values()):
            states = [t.state for t in chain.targets]
            if TargetState.SYNCING in states or TargetState.SERVING not in states:
                continue
            recovery = self.state.recoveries.get(chain.chain_id)
            waiting = next((t for t in chain.targets if t.state is TargetState.WAITING
                            and self.state.nodes[t.node_id].alive
                            and (recovery is None or t.target_id in recovery.awaiting)), None)
            if waiting is not None:
                self._set(chain, {waiting.target_id: TargetState.SYNCING})
                changed.append(chain.chain_id)
        return changed

    def _set(self, chain: ChainConfig, new: dict[int, TargetState], to_end: bool = False) -> None:
        """Apply state changes, reorder (changed targets last within their state if ``to_end``), bump version; the
        chain is recovering while it has a :class:`Recovery`."""
        targets = [msgspec.structs.replace(t, state=new.get(t.target_id, t.state)) for t in chain.targets]
        if to_end:
            targets.sort(key=lambda t: t.target_id in new)
        targets.sort(key=lambda t: _ORDER[t.state])
        self.state.chains[chain.chain_id] = ChainConfig(chain.chain_id, chain.chain_version + 1, tuple(targets),
                                                        chain.chain_id in self.state.recoveries)
