"""``kvfs up`` sizes and addresses: several targets per chunk server make several chains; no port twice."""

from __future__ import annotations

import errno
import socket
import time

import pytest

from kvfs.errors import KvfsError
from kvfs.localcluster import LocalCluster, _free_ports


def test_targets_per_server_make_more_chains(tmp_path):
    cluster = LocalCluster(tmp_path / "data")
    try:
        cluster.up(tmp_path / "mnt", chunkservers=3, replicas=3, targets_per_server=2, mounted=False,
                   echo=lambda *a: None)
        report = cluster.status()
        assert len(report["chains"]) == 2
        nodes_of = {c["chain_id"]: {t["node_id"] for t in report["targets"] if t["chain_id"] == c["chain_id"]}
                    for c in report["chains"]}
        assert all(nodes == {1, 2, 3} for nodes in nodes_of.values())  # replicas on distinct servers
        assert all(t["state"] == "serving" for t in report["targets"])
    finally:
        cluster.down(echo=lambda *a: None)


def test_ports_chosen_for_one_cluster_are_distinct():
    """They are chosen before any process binds one: a port given twice fails the second process to start."""
    for _ in range(20):
        ports = _free_ports(2 + 64)
        assert len(set(ports)) == len(ports)


def test_up_says_which_address_another_process_took_instead_of_waiting(tmp_path):
    """A restart reuses the cluster's recorded ports; one that another process listens on meanwhile is named at
    once (before, the stranger's listener passed for the service and up waited a minute for targets)."""
    cluster = LocalCluster(tmp_path / "data")
    quiet = {"mounted": False, "echo": lambda *a: None}
    try:
        layout = cluster.up(tmp_path / "mnt", **quiet)
        cluster.down(echo=quiet["echo"])
        host, port = layout.meta.rsplit(":", 1)
        with socket.create_server((host, int(port))):
            failed_at = time.time_ns()
            with pytest.raises(KvfsError) as info:
                cluster.up(tmp_path / "mnt", **quiet)
            assert info.value.errno == errno.EADDRINUSE and layout.meta in info.value.message
        # the chunk servers the failed up started count as new: the next up waits until mgmtd has heard from them
        # (it once returned while mgmtd still showed the targets it had persisted as serving)
        assert all(cluster._started_ns(f"cs{n}") > failed_at for n in range(1, len(layout.chunkservers) + 1))
        cluster.up(tmp_path / "mnt", **quiet)
        assert all(t["state"] == "serving" for t in cluster.status()["targets"])
    finally:
        cluster.down(echo=lambda *a: None)
