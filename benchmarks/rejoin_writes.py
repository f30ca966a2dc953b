"""What a writer meets while a killed chunk server rejoins its chain: small-write latency across the restart.

    .venv/bin/python benchmarks/rejoin_writes.py [--rounds 3] [--file-mib 64]

Brings up mgmtd, meta and 3 chunk servers with ``kvfs up`` (no mount, replication 3), writes one file (4 MiB
chunks). Each round: kill -9 chunk server 2, wait until mgmtd takes its target out of the chain, then start it
again while one writer makes a 4 KiB write at a random offset every 20 ms, from half a second before the restart
until the target has served for a few seconds. Prints, per round, the writes made, their p50, p99 and slowest
latency, and the seconds from the restart until every target serves. A write issued as the target rejoins meets
chain changes (offline -> syncing -> serving, each reaching every server with its own heartbeat) and a resync in
progress; what it should not meet is a wait for a heartbeat or a retransmit timer.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import trio
from resync_bench import INODE, LAYOUT, RETURNING, _all_serving, _returning_out, _storage_call, _wait_for

from kvfs.config import load_config
from kvfs.localcluster import LocalCluster

WRITE_EVERY = 0.02
AFTER_SERVING = 3.0  # seconds of writes after every target serves again


def _restart(cluster: LocalCluster, mnt: Path, marks: dict[str, float]) -> None:
    marks["restart"] = time.monotonic()
    cluster.up(mnt, mounted=False, echo=lambda *a: None)


async def _round(storage, mgmtd, cluster: LocalCluster, mnt: Path, size: int, rng: random.Random) -> tuple:
    latencies: list[float] = []
    marks: dict[str, float] = {}
    restarter = threading.Thread(target=_restart, args=(cluster, mnt, marks))

    async def restart_then_watch() -> None:
        await trio.sleep(0.5)  # writes before the restart too
        restarter.start()
        while "restart" not in marks:
            await trio.sleep(0.01)
        await _wait_for(mgmtd, _all_serving)
        marks["serving"] = time.monotonic()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(restart_then_watch)
        while "serving" not in marks or time.monotonic() < marks["serving"] + AFTER_SERVING:
            began = time.monotonic()
            await storage.write(INODE, LAYOUT, rng.randrange(0, size - 4096), memoryview(rng.randbytes(4096)))
            latencies.append(time.monotonic() - began)
            await trio.sleep(WRITE_EVERY)
    restarter.join()
    latencies.sort()
    return (len(latencies), statistics.median(latencies) * 1e3, latencies[int(len(latencies) * 0.99)] * 1e3,
            latencies[-1] * 1e3, marks["serving"] - marks["restart"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--file-mib", type=int, default=64)
    args = parser.parse_args()
    size = args.file_mib << 20
    rng = random.Random(7)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVFS_BENCH_DIR")) as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster")
        mnt = Path(tmp) / "mnt"
        cluster._init(mnt, 3, 3)
        config = load_config(cluster.config_path)
        try:
            cluster.up(mnt, mounted=False, echo=lambda *a: None)
            trio.run(_storage_call, config, lambda s, m: s.write(INODE, LAYOUT, 0, memoryview(os.urandom(size))))
            for _ in range(args.rounds):
                os.kill(cluster.pid_of(f"cs{RETURNING}"), signal.SIGKILL)
                trio.run(_storage_call, config, lambda s, m: _wait_for(m, _returning_out))
                rows.append(trio.run(_storage_call, config,
                                     lambda s, m: _round(s, m, cluster, mnt, size, rng)))
        finally:
            cluster.down(echo=lambda *a: None)
    print(f"file {args.file_mib} MiB in 4 MiB chunks, replication 3; chunk server {RETURNING} killed and restarted"
          f" while one writer makes a 4 KiB write every {WRITE_EVERY * 1e3:g} ms")
    print(f"{'round':>5} {'writes':>6} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>8} {'restart->serving s':>18}")
    for i, (n, p50, p99, worst, serving) in enumerate(rows, 1):
        print(f"{i:>5} {n:>6} {p50:>7.2f} {p99:>7.1f} {worst:>8.1f} {serving:>18.2f}")


if __name__ == "__main__":
    main()
