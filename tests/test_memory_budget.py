"""The memory budget of a ``kvfs up`` cluster (issue 28, item 5): ``--memory-mb`` is divided among the chunk
servers, and their buffers' pages go back to the system within seconds once the data has moved."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

from cluster_fixtures import KVFS, NEEDS_FUSE, REPO, started, wait_until
from kvfs.localcluster import DEFAULT_MEMORY, chunkserver_memory

MIB = 1 << 20
pytestmark = NEEDS_FUSE


def pss(pid: int) -> int:
    """Proportional set size of ``pid`` in bytes: shared pages split among the processes that map them."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no Pss line for pid {pid}")


def test_chunk_servers_take_their_share_and_give_memory_back_after_a_flush():
    with started("kvfs-memory-") as cluster:
        config = tomllib.loads(cluster.config.read_text())
        assert config["chunkserver"]["memory_bytes"] == chunkserver_memory(DEFAULT_MEMORY, 3)
        servers = [cluster.pid(f"cs{i}") for i in (1, 2, 3)]
        before = sum(pss(pid) for pid in servers)
        block = os.urandom(MIB)
        fd = os.open(cluster.mount / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for _ in range(128):
                os.write(fd, block)
            os.fsync(fd)  # the chunk servers flush: nothing is held any more
        finally:
            os.close(fd)
        grown = sum(pss(pid) for pid in servers) - before
        assert grown > 64 * MIB, "the write did not pass through the chunk servers' buffers"
        wait_until(lambda: sum(pss(pid) for pid in servers) - before < grown / 2 + 16 * MIB, 10,
                   "the chunk servers to give their idle buffers' pages back")


def test_a_budget_too_small_for_the_chunk_servers_is_refused(tmp_path):
    r = subprocess.run([*KVFS, "up", "--data", str(tmp_path / "d"), "--mount", str(tmp_path / "m"),
                        "--memory-mb", "300"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode != 0 and "--memory-mb 300 leaves" in r.stderr, r
    assert not (tmp_path / "d" / "local.json").exists()
