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


def beat(mgr: ClusterManager, node: int, now: float, incarnation: int = 1, unclean: tuple[int, ...] = ()) -> list[int]:
    reply, changed = mgr.heartbeat(Heartbeat(node, incarnation, f"tcp://h{node}", now, unclean_targets=unclean), now)
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


def test_chains_rotate_their_nodes_so_every_node_heads_some():
    """Three nodes of three targets: each node heads one chain, is the middle of one and ends one."""
    chains = cluster(nodes=3, per_node=3).state.chains.values()
    for position in range(3):
        assert sorted(chain.targets[position].node_id for chain in chains) == [1, 2, 3]


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


def lastsrv_back(unclean: bool, recovery_wait: float = 600.0, replicas: int = 3) -> ClusterManager:
    """The seed-68 partition: nodes 2 and 3 are cut off and declared dead first, so 10 is the chain's last serving
    target when its own node dies; it comes back restarted, after an unclean stop or not."""
    mgr = ClusterManager(heartbeat_timeout=1.0, lease=0.5, recovery_wait=recovery_wait)
    mgr.create_chains([(10 * n, n) for n in range(1, replicas + 1)], replicas)
    for n in range(1, replicas + 1):
        beat(mgr, n, 0.0)
    beat(mgr, 1, 0.9)
    mgr.tick(1.5)
    mgr.tick(3.0)
    assert layout(mgr, 1) == [(10, L)] + [(10 * n, O) for n in range(2, replicas + 1)]
    beat(mgr, 1, 3.1, incarnation=2, unclean=(10,) if unclean else ())
    return mgr


def test_a_clean_last_serving_target_serves_again_at_once():
    mgr = lastsrv_back(unclean=False)
    assert layout(mgr, 1) == [(10, S), (20, O), (30, O)] and not mgr.state.chains[1].recovering


def test_a_rolled_back_last_serving_target_pulls_from_every_other_target_before_the_chain_serves():
    mgr = lastsrv_back(unclean=True)
    assert layout(mgr, 1) == [(10, S), (20, O), (30, O)] and mgr.state.chains[1].recovering
    beat(mgr, 2, 3.2)
    assert layout(mgr, 1) == [(10, S), (20, Y), (30, O)]
    mgr = ClusterManager(1.0, 0.5, msgspec.msgpack.decode(msgspec.msgpack.encode(mgr.state), type=ClusterState))
    assert mgr.resync_done(ResyncDone(1, mgr.state.chains[1].chain_version, 20)) == [1]  # 10 pulled what 20 had
    assert layout(mgr, 1) == [(10, S), (20, W), (30, O)] and mgr.state.chains[1].recovering  # 30 may hold more
    beat(mgr, 1, 3.3, incarnation=2)
    beat(mgr, 2, 3.3)  # already pulled from: it does not sync again while the chain recovers
    assert layout(mgr, 1) == [(10, S), (20, W), (30, O)]
    beat(mgr, 3, 3.4)
    assert layout(mgr, 1) == [(10, S), (30, Y), (20, W)]
    mgr.resync_done(ResyncDone(1, mgr.state.chains[1].chain_version, 30))
    assert not mgr.state.chains[1].recovering and not mgr.state.recoveries
    assert layout(mgr, 1) == [(10, S), (30, Y), (20, W)]  # the chain serves; both sync from 10 as usual
    mgr.resync_done(ResyncDone(1, mgr.state.chains[1].chain_version, 30))
    assert layout(mgr, 1) == [(10, S), (30, S), (20, Y)]


def test_a_recovering_chain_serves_without_targets_that_do_not_return_within_the_wait(caplog):
    mgr = lastsrv_back(unclean=True, recovery_wait=2.0)
    beat(mgr, 1, 4.0, incarnation=2)
    assert mgr.tick(5.0) == [] and mgr.state.chains[1].recovering
    beat(mgr, 1, 5.0, incarnation=2)
    version = mgr.state.chains[1].chain_version
    assert mgr.tick(5.2) == [1]
    assert not mgr.state.chains[1].recovering and mgr.state.chains[1].chain_version == version + 1
    assert "did not return within 2 s" in caplog.text
    beat(mgr, 1, 5.3, incarnation=2)
    beat(mgr, 3, 5.3)  # back after all: it syncs from 10 like any returning target
    assert layout(mgr, 1) == [(10, S), (30, Y), (20, O)]


def test_at_the_end_of_the_wait_a_target_that_is_back_is_still_pulled_from():
    """Only the targets that are down are given up on: one syncing at the deadline may hold newer chunks, which
    normal resync would overwrite if the chain served at once."""
    mgr = lastsrv_back(unclean=True, recovery_wait=2.0)
    beat(mgr, 2, 4.5)
    beat(mgr, 1, 4.5, incarnation=2)
    assert layout(mgr, 1) == [(10, S), (20, Y), (30, O)]
    assert mgr.tick(5.2) == [] and mgr.state.chains[1].recovering  # the wait is over, but 20 is being pulled from
    assert mgr.state.recoveries[1].awaiting == [20]  # 30 is given up on
    mgr.resync_done(ResyncDone(1, mgr.state.chains[1].chain_version, 20))
    assert not mgr.state.chains[1].recovering and not mgr.state.recoveries


def test_a_rolled_back_target_that_restarts_again_waits_for_every_other_target_again():
    mgr = lastsrv_back(unclean=True)
    beat(mgr, 2, 3.2)
    mgr.resync_done(ResyncDone(1, mgr.state.chains[1].chain_version, 20))
    assert mgr.state.recoveries[1].awaiting == [30]
    beat(mgr, 1, 3.3, incarnation=3, unclean=(10,))  # lost what it pulled from 20
    assert mgr.state.recoveries[1].awaiting == [20, 30]


def test_an_unclean_stop_counts_once_per_incarnation():
    """Cut off again later, the same incarnation lost nothing more: as last serving target it serves at once."""
    mgr = lastsrv_back(unclean=True, replicas=2)
    beat(mgr, 2, 3.2)
    mgr.resync_done(ResyncDone(1, mgr.state.chains[1].chain_version, 20))
    assert not mgr.state.chains[1].recovering
    mgr.resync_done(ResyncDone(1, mgr.state.chains[1].chain_version, 20))
    assert layout(mgr, 1) == [(10, S), (20, S)]
    beat(mgr, 1, 4.0, incarnation=2, unclean=(10,))
    mgr.tick(4.5)  # 20 is gone: 10 serves alone
    mgr.tick(5.5)  # and is cut off
    assert layout(mgr, 1) == [(10, L), (20, O)]
    beat(mgr, 1, 5.6, incarnation=2, unclean=(10,))
    assert layout(mgr, 1) == [(10, S), (20, O)] and not mgr.state.chains[1].recovering

def test_a_single_replica_chain_has_nobody_to_wait_for():
    mgr = ClusterManager(heartbeat_timeout=1.0, lease=0.5)
    mgr.create_chains([(10, 1)], 1)
    beat(mgr, 1, 0.0)
    beat(mgr, 1, 0.1, incarnation=2, unclean=(10,))
    assert layout(mgr, 1) == [(10, S)] and not mgr.state.chains[1].recovering
