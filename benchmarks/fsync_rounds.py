"""What an fsync of scattered small writes costs the chunk servers, by how many chunks it touches.

    .venv/bin/python benchmarks/fsync_rounds.py [--chunks 1 4 14] [--seconds 5]

Brings up mgmtd, meta and 3 chunk servers with ``kvfs up`` (no mount; replication 3, write-back, fsync on) in a
temporary directory, writes a 16-chunk file (4 MiB chunks), then repeats what the mount does at an fsync of a file
with gathered 4 KiB writes: two 4 KiB runs in each of ``--chunks`` distinct chunks, in one
``StorageClient.write_many`` (one ``chunk.write_batch`` per chain; before issue 25's batches, one chain round per
chunk), then ``StorageClient.flush`` (every chunk server flushes). Prints
the median milliseconds of the writes and of the flush per round, the writes' time per chunk, and the chunk
servers' CPU (user and system, from /proc) per chunk written. ``fio --rw=randwrite --bs=4k --fsync=32`` on a
64 MiB file touches about 14 chunks per fsync.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import trio
from rpc_bench import process_cpu_split

from kvfs.chunkserver.client import StorageClient
from kvfs.chunkserver.protocol import CHUNK_LIMITS
from kvfs.config import load_config
from kvfs.craq.client import MgmtdClient
from kvfs.localcluster import LocalCluster
from kvfs.meta.types import Layout
from kvfs.rpc import RpcClient

CHUNK = 4 << 20
FILE_CHUNKS = 16


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """User and system CPU seconds of ``pids`` so far, summed."""
    user, system = zip(*map(process_cpu_split, pids))
    return sum(user), sum(system)


async def measure(config, pids: list[int], counts: list[int], seconds: float) -> list[tuple]:
    async with RpcClient(config.resolved_token(), limits=CHUNK_LIMITS) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, config.mgmtd))
        layout = Layout(chunk_size=CHUNK, stripe=16, seed=7)
        ino = 1 << 40
        blob = memoryview(os.urandom(CHUNK))
        for index in range(FILE_CHUNKS):
            await storage.write(ino, layout, index * CHUNK, blob)
        await storage.flush(ino)
        rng = random.Random(1)
        rows = []
        for n in counts:
            writes, flushes = [], []
            user0, system0 = cpu_seconds(pids)
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                started = time.perf_counter()
                runs = []
                for index in rng.sample(range(FILE_CHUNKS), n):
                    off = index * CHUNK + rng.randrange(CHUNK // 4096 - 4) * 4096
                    runs += [(off, rng.randbytes(4096)), (off + 8192, rng.randbytes(4096))]
                assert await storage.write_many([(ino, layout, runs)]) == [None]
                written = time.perf_counter()
                await storage.flush(ino)
                writes.append(written - started)
                flushes.append(time.perf_counter() - written)
            user1, system1 = cpu_seconds(pids)
            chunks = n * len(writes)
            rows.append((n, len(writes), statistics.median(writes) * 1e3, statistics.median(flushes) * 1e3,
                         statistics.median(writes) * 1e3 / n, (user1 - user0) / chunks * 1e3,
                         (system1 - system0) / chunks * 1e3))
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 14])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if max(args.chunks) > FILE_CHUNKS:
        parser.error(f"at most {FILE_CHUNKS} chunks")
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVFS_BENCH_DIR")) as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster")
        cluster._init(Path(tmp) / "mnt", 3, 3, 1, True, False)
        try:
            cluster.up(Path(tmp) / "mnt", mounted=False, echo=lambda *a: None)
            pids = [int(p.read_text()) for p in sorted((Path(tmp) / "cluster" / "run").glob("cs*.pid"))]
            rows = trio.run(measure, load_config(cluster.config_path), pids, args.chunks, args.seconds)
        finally:
            cluster.down(echo=lambda *a: None)
    print(f"{'chunks':>6} {'rounds':>6} {'writes ms':>9} {'flush ms':>8} {'ms/chunk':>8}"
          f" {'CS user ms/chunk':>16} {'CS sys ms/chunk':>15}")
    for n, rounds, write, flush, per_chunk, user, system in rows:
        print(f"{n:>6} {rounds:>6} {write:>9.2f} {flush:>8.2f} {per_chunk:>8.2f} {user:>16.2f} {system:>15.2f}")


if __name__ == "__main__":
    main()
