"""Storage-client benchmark: chunk write and read throughput on a real local cluster, replication 3.

    .venv/bin/python benchmarks/storage_bench.py [--mib-per-stream 64] [--write-through | --no-fsync]

Brings up mgmtd, meta and 3 chunk servers with ``kvfs up`` (no mount) in a temporary directory, then for
chunk sizes of 1, 4 and 16 MiB and 1 and 8 concurrent streams (each stream its own file, whole-chunk
writes, each stream's file synced at its end as a file's fsync does) measures write and read GB/s through
:class:`kvfs.chunkserver.client.StorageClient`, beside a plain loopback socket pump measured in the same run, and
prints the ratios. Writes are measured twice, side by side: over loopback TCP (a client with shared memory
off, so its chain forwards over TCP too) and through shared memory (the client writes from a buffer in its
arena, as the mount does, and every hop copies out of its predecessor's; ``kvfs/transport/shm.py``). Every byte written is replicated three times, so the network carries 3x the write figure.
With ``--write-through`` chunk servers flush every write, and the three replicas share one disk, so the disk's
own fsync'ed write rate (``pwrite`` + ``fdatasync`` of the same chunk size, measured in the same run and
directory) divided by 3 is the ceiling for replicated writes; the last columns compare against it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import trio
from rpc_bench import plain_pump, plain_server

from kvfs.chunkserver.client import StorageClient
from kvfs.chunkserver.protocol import CHUNK_LIMITS
from kvfs.craq.client import MgmtdClient
from kvfs.config import load_config
from kvfs.localcluster import LocalCluster
from kvfs.rpc import RpcClient
from kvfs.transport import shm
from kvfs.meta.types import Layout

CHUNK_SIZES = [1 << 20, 4 << 20, 16 << 20]


async def measure(config, chunk_size: int, streams: int, per_stream: int, shared_memory: bool) -> tuple[float, float]:
    async with RpcClient(config.resolved_token(), limits=CHUNK_LIMITS, shared_memory=shared_memory) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, config.mgmtd), window=8)
        layout = Layout(chunk_size=chunk_size, stripe=16, seed=chunk_size)
        payload = memoryview(shm.SHARED.take(chunk_size) if shared_memory else bytearray(chunk_size))
        payload[:] = os.urandom(chunk_size)
        chunks = max(1, per_stream // chunk_size)
        base = time.monotonic_ns() % (1 << 40)

        async def writer(i: int) -> None:
            for c in range(chunks):
                await storage.write(base + i, layout, c * chunk_size, payload)
            await storage.flush(base + i)

        async def reader(i: int) -> None:
            buf = memoryview(bytearray(chunk_size))
            for c in range(chunks):
                await storage.read(base + i, layout, c * chunk_size, buf)

        figures = []
        for job in (writer, reader):
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(job, i)
            figures.append(streams * chunks * chunk_size / (time.perf_counter() - start) / 1e9)
        return figures[0], figures[1]


def disk_write_rate(directory: Path, chunk_size: int, total: int = 128 << 20) -> float:
    """Bytes/s of sequential pwrite + fdatasync in ``chunk_size`` pieces: what one disk can take durably."""
    payload = memoryview(os.urandom(chunk_size))
    path = directory / "disk-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        for offset in range(0, total, chunk_size):
            os.pwrite(fd, payload, offset)
            os.fdatasync(fd)
        return total / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib-per-stream", type=int, default=64)
    parser.add_argument("--targets-per-server", type=int, default=1, help="storage targets (chains) per server")
    parser.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True,
                        help="chunk servers flush to disk (the default: at each stream's sync); --no-fsync: never")
    parser.add_argument("--write-through", action="store_true", help="chunk servers flush every write")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    pump = ctx.Process(target=plain_server, args=(queue,), daemon=True)
    pump.start()
    pump_port = queue.get(timeout=30)
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVFS_BENCH_DIR")) as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster")
        cluster._init(Path(tmp) / "mnt", 3, 3, args.targets_per_server, args.fsync, args.write_through)
        config = load_config(cluster.config_path)
        try:
            cluster.up(Path(tmp) / "mnt", mounted=False, echo=lambda *a: None)
            rows = []
            for chunk_size in CHUNK_SIZES:
                ceiling = plain_pump(pump_port, chunk_size, 1.5) / 1e9
                disk = disk_write_rate(Path(tmp), chunk_size) / 1e9 if args.write_through else float("nan")
                for streams in (1, 8):
                    write, read = trio.run(measure, config, chunk_size, streams, args.mib_per_stream << 20, False)
                    shared, _ = trio.run(measure, config, chunk_size, streams, args.mib_per_stream << 20, True)
                    rows.append((chunk_size, streams, write, shared, read, ceiling, disk / 3))
        finally:
            cluster.down(echo=lambda *a: None)
            pump.terminate()
    flushes = "every write" if args.write_through else "at sync" if args.fsync else "never"
    print(f"replication 3, {args.targets_per_server} target(s) per server, chunk servers flush {flushes},"
          f" {args.mib_per_stream} MiB per stream")
    print(f"{'chunk':>6} {'streams':>7} {'write GB/s':>11} {'write shm':>10} {'shm/tcp':>8} {'read GB/s':>10}"
          f" {'socket pump GB/s':>17} {'write/pump':>11} {'read/pump':>10} {'disk fsync/3 GB/s':>18}"
          f" {'write/(disk/3)':>15}")
    for chunk_size, streams, write, shared, read, ceiling, disk3 in rows:
        print(f"{chunk_size >> 20:>4}Mi {streams:>7} {write:>11.3f} {shared:>10.3f} {shared / write:>8.2f}"
              f" {read:>10.3f} {ceiling:>17.2f} {write / ceiling:>11.2f} {read / ceiling:>10.2f} {disk3:>18.3f}"
              f" {write / disk3:>15.2f}")


if __name__ == "__main__":
    main()
