"""Whole-cluster deterministic simulation: every seed's history must be linearizable per chunk.

Reproduce a failing seed:  KVFS_SIM_SEED=123 .venv/bin/python -m pytest tests/test_craq_sim.py -k "default-seed"
Run more seeds:            KVFS_SIM_SEEDS=5000 (seeds 0..4999) or KVFS_SIM_SEEDS=5000:6000 (or tests/sim_nightly.py)
Other timing:              KVFS_SIM_SCAN_EVERY=0.025 (members look for unacknowledged updates that often, not
                           every tick: delayed retransmissions, which must never cost safety)
"""

from __future__ import annotations

import collections
import dataclasses
import os

import pytest

from kvfs.craq import sim
from kvfs.craq.cluster import ClusterManager
from kvfs.craq.member import AskTail, ChainMember, ServeVersion


def _seeds() -> list[int]:
    if "KVFS_SIM_SEED" in os.environ:
        return [int(os.environ["KVFS_SIM_SEED"])]
    spec = os.environ.get("KVFS_SIM_SEEDS", "300")
    start, _, stop = spec.rpartition(":")
    return list(range(int(start or 0), int(stop)))


_SCAN = float(os.environ.get("KVFS_SIM_SCAN_EVERY", "0"))
PROFILES = {name: dataclasses.replace(cfg, retransmit_scan_every=_SCAN) for name, cfg in sim.PROFILES.items()}


def _cases() -> list:
    """Every seed in the default profile; every third (or the one asked for) in the harsh and liveness ones."""
    seeds = _seeds()
    some = seeds if len(seeds) == 1 else seeds[::3]
    return [pytest.param(p, s, id=f"{p}-seed={s}")
            for p, ss in (("default", seeds), ("harsh", some), ("liveness", some)) for s in ss]


@pytest.mark.parametrize(("profile", "seed"), _cases())
def test_seed(profile: str, seed: int):
    problems = sim.check(sim.run(seed, PROFILES[profile]))
    assert not problems, f"KVFS_SIM_SEED={seed} ({profile}) fails:\n" + "\n".join(problems)


# Seeds that once failed under a timing other than the default, kept in CI: (scan interval, seed).
REGRESSIONS = [
    # a read tail reported ResyncDone, mgmtd made its syncing successor the new read tail (which had committed a
    # write the old tail still held pending); the old tail, cut off from mgmtd with a valid lease, kept serving
    # the previous version under the old chain version (member rule 7a)
    (0.025, 1318),
]


@pytest.mark.parametrize(("scan_every", "seed"), REGRESSIONS)
def test_regression_seed(scan_every: float, seed: int):
    """In the "classic" fault mix these seeds were found with."""
    problems = sim.check(sim.run(seed, sim.SimConfig(retransmit_scan_every=scan_every)))
    assert not problems, f"KVFS_SIM_SCAN_EVERY={scan_every} KVFS_SIM_SEED={seed} fails:\n" + "\n".join(problems)


def test_runs_are_deterministic_and_exercise_faults():
    a, b = sim.run(11), sim.run(11)
    assert a.history == b.history and a.events == b.events
    assert sum(len(ops) for ops in a.history.values()) > 50
    assert any(not line.startswith("chain 1 v1:") for line in a.final_states)  # reconfigurations happened


def test_simulation_catches_a_dirty_read_bug(monkeypatch):
    """Serve the committed version at a dirty replica instead of asking the tail: CRAQ's classic mistake."""
    correct = ChainMember.read_decision

    def no_ask_tail(self, chunk_id, chain_version):
        decision = correct(self, chunk_id, chain_version)
        return ServeVersion(self.chunk_versions(chunk_id)[0]) if isinstance(decision, AskTail) else decision

    monkeypatch.setattr(ChainMember, "read_decision", no_ask_tail)
    assert any(sim.check(sim.run(seed)) for seed in range(60))


def test_the_new_faults_happen_and_returning_replicas_are_behind():
    """Rollbacks, resets, slow and stalled disks and lost nodes do happen, and resync finds replicas behind."""
    seen = sum((sim.run(seed, sim.PROFILES["default"]).faults for seed in range(30)), collections.Counter())
    for what in ("rollbacks", "versions rolled back", "connection resets", "disk stalls", "slow persists",
                 "nodes lost", "resync: replica behind", "resync copies", "resync copies as changed slots",
                 "resync copies refused (sent whole next)"):
        assert seen[what] > 0, f"no {what} in 30 seeds: {seen}"


def test_a_lost_node_leaves_its_chains_serving_without_it():
    result = sim.run(0, sim.PROFILES["liveness"])
    assert len(result.lost_targets) >= 1 and not sim.check(result)
    for line in result.final_states:
        for entry in line.split(": ", 1)[1].split(", "):
            target, state = entry.split(":")
            assert (state == "offline") == (int(target) in result.lost_targets), result.final_states
    assert any(t > 0 for t in result.calm_since.values())  # the liveness window starts at the reconfiguration


def test_liveness_check_catches_a_write_stuck_until_the_lost_node_returns(monkeypatch):
    """A member that no longer re-drives its pending writes when the chain is reconfigured leaves a write that
    had reached the lost node waiting for it forever: safety holds, liveness does not."""
    correct = ChainMember._configure

    def forget_pending(self, event):
        pending = {cid: c.pending for cid, c in self._chunks.items()}
        for c in self._chunks.values():
            c._pending = None
        effects = correct(self, event)
        for cid, p in pending.items():
            self._chunks[cid]._pending = p
        return effects

    monkeypatch.setattr(ChainMember, "_configure", forget_pending)
    problems = [p for seed in range(10) for p in sim.check(sim.run(seed, sim.PROFILES["liveness"]))]
    assert any("took over" in p for p in problems)
    assert not any("not linearizable" in p for p in problems)


ROLLED_BACK_SEED = 236


def test_a_rolled_back_last_serving_target_pulls_what_only_the_others_held():
    """Seed 236 (68 before chains rotated their nodes, which moved every seed's schedule): a node loses its
    unflushed writes while the other two are cut off from mgmtd, which takes them out first; its target comes back
    as the chain's last serving one and must pull their newer chunks (issue #26). With mgmtd deaf to unclean stops
    it serves at once, the others resync from it, and acknowledged writes vanish."""
    result = sim.run(ROLLED_BACK_SEED, PROFILES["default"])
    assert not sim.check(result)
    assert result.faults["rolled-back lastsrv recoveries"] and result.faults["chunks pulled by a recovering target"]


def test_simulation_catches_a_rolled_back_lastsrv_that_serves_at_once(monkeypatch):
    node_up = ClusterManager._node_up
    monkeypatch.setattr(ClusterManager, "_node_up", lambda self, node, unclean, now: node_up(self, node, set(), now))
    assert sim.check(sim.run(ROLLED_BACK_SEED, PROFILES["default"]))
