"""``kvfs up`` sizes and addresses: several targets per chunk server make several chains; no port twice."""

from __future__ import annotations

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
