"""mgmtd's decisions: chain placement, failure detection by ticks, sync turns, routing, persistence."""

from __future__ import annotations

import msgspec
import pytest

from kvfs.errors import KvfsError

from kvfs.craq.cluster import ClusterManager, ClusterState, Heartbeat
from kvfs.craq.messages import ResyncDone, TargetState

S, Y, W, L, O = (TargetState.SERVING, TargetState.SYNCING, TargetState.WAITING, TargetState.LASTSRV,
                 TargetState.OFFLINE)


def cluster(nodes: int = 4, replicas: int = 3, per_node: int = 3) -> ClusterManager:
    mgr = ClusterManager(heartbeat_timeout=1.0, lease=0.5)
    mgr.create_chains([(10 * n + k, n) for n in range(1, nodes + 1) for k in range(per_node)], replicas)
    for n in range(1, nodes + 1):
        beat(mgr, n, 0.0)
    return mgr


def beat(mgr: ClusterManager, node: int, now: float, incarnation: int = 1) -> list[int]:
    reply, changed = mgr.heartbeat(Heartbeat(node, incarnation, f"tcp://h{node}", now), now)
    assert reply.lease_until == now + 0.5
    return changed


def layout(mgr: ClusterManager, chain_id: int) -> list[tuple[int, TargetState]]:
    return [(t.target_id, t.state) for t in mgr.state.chains[chain_id].targets]


def test_chains_are_placed_on_distinct_nodes():
    mgr = cluster(nodes=4, per_node=3)
    assert len(mgr.state.chains) == 4
    for chain in mgr.state.chains.values():
        assert len({t.node_id for t in chain.targets}) == 3 and chain.chain_version == 1
    with pytest.raises(KvfsError):
        ClusterManager(1.0, 0.5).create_chains([(1, 1), (2, 1), (3, 1), (4, 2)], 2)


def test_lease_must_be_shorter_than_failure_timeout():
    with pytest.raises(ValueError):
        ClusterManager(heartbeat_timeout=1.0, lease=1.0)


def test_dead_target_goes_to_the_end_offline_with_a_version_bump():
    mgr = cluster(nodes=3, per_node=1)
    assert layout(mgr, 1) == [(10, S), (20, S), (30, S)]
    for n in (2, 3):
        beat(mgr, n, 0.9)
    assert mgr.tick(1.5) == [1]
    assert layout(mgr, 1) == [(20, S), (30, S), (10, O)] and mgr.state.chains[1].chain_version == 2
    assert mgr.tick(1.6) == []


def test_returning_target_waits_syncs_one_at_a_time_then_serves():
    mgr = cluster(nodes=3, per_node=1)
    beat(mgr, 3, 0.9)
    mgr.tick(1.5)  # nodes 1 and 2 dead; 30 serves alone
    assert layout(mgr, 1) == [(30, S), (10, O), (20, O)]
    beat(mgr, 1, 1.6)
    beat(mgr, 2, 1.6)
    assert layout(mgr, 1) == [(30, S), (10, Y), (20, W)]
    version = mgr.state.chains[1].chain_version
    assert mgr.resync_done(ResyncDone(1, version - 1, 10)) == []  # stale report: ignored
    assert mgr.resync_done(ResyncDone(1, version, 10)) == [1]
    assert layout(mgr, 1) == [(30, S), (10, S), (20, Y)]


def test_restart_with_new_incarnation_is_a_failure_even_without_missed_heartbeats():
    mgr = cluster(nodes=3, per_node=1)
    assert beat(mgr, 1, 0.1, incarnation=2) == [1]
    assert layout(mgr, 1) == [(20, S), (30, S), (10, Y)]


def test_last_serving_target_becomes_lastsrv_and_serves_again_when_back():
    mgr = cluster(nodes=3, per_node=1)
    beat(mgr, 3, 0.9)
    mgr.tick(1.5)
    mgr.tick(3.0)
    assert layout(mgr, 1) == [(30, L), (10, O), (20, O)]
    beat(mgr, 1, 3.1)  # not the newest data: must wait for 30
    assert layout(mgr, 1) == [(10, W), (30, L), (20, O)]
    beat(mgr, 3, 3.2)
    assert layout(mgr, 1) == [(30, S), (10, Y), (20, O)]


def test_routing_and_state_are_serialisable():
    mgr = cluster()
    routing = mgr.routing()
    assert routing.addresses[1] == "tcp://h1" and [c.chain_id for c in routing.chains] == [1, 2, 3, 4]
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(mgr.state), type=ClusterState)
    assert state == mgr.state
    assert ClusterManager(1.0, 0.5, state).routing() == routing
