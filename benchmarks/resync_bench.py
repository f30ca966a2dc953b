"""Resync after small writes: what a returning replica costs the chain, on a real local cluster, replication 3.

    .venv/bin/python benchmarks/resync_bench.py [--file-mib 64] [--writes 1,16,64]

Brings up mgmtd, meta and 3 chunk servers with ``kvfs up`` (no mount, shared memory off so every byte between
chunk servers crosses a socket), writes one file (4 MiB chunks) and syncs it. Then, for each count N of
``--writes``: kill -9 chunk server 2, wait until mgmtd takes its target out of the chain, write N random 4 KiB
pieces of the file (synced), start the server again and time until every target serves. Bytes: what the other
two chunk servers wrote to sockets and files meanwhile (``wchar`` of ``/proc/PID/io``: the resync copies plus
heartbeats and acks, the same measure on any branch), and the resync's own count where the server logs one
(``resync of target ... done: B bytes sent``). Afterwards the whole file is read back and compared.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import tempfile
import time
from pathlib import Path

import trio

from kvfs.chunkserver.client import StorageClient
from kvfs.chunkserver.protocol import CHUNK_LIMITS
from kvfs.config import load_config
from kvfs.craq.client import STATUS, MgmtdClient
from kvfs.craq.messages import TargetState
from kvfs.localcluster import LocalCluster
from kvfs.meta.types import Layout
from kvfs.rpc import RpcClient
from kvfs.wire import Empty

LAYOUT = Layout(chunk_size=4 << 20, stripe=1, seed=3)
INODE = 4242
RETURNING = 2  # node id of the chunk server killed and brought back; its target is 200


async def _storage_call(config, work) -> object:
    async with RpcClient(config.resolved_token(), limits=CHUNK_LIMITS) as rpc:
        mgmtd = MgmtdClient(rpc, config.mgmtd)
        return await work(StorageClient(rpc, mgmtd, retry_for=60), mgmtd)


async def _write(storage: StorageClient, pieces: list[tuple[int, bytes]]) -> None:
    for offset, data in pieces:
        await storage.write(INODE, LAYOUT, offset, data)
    await storage.flush(INODE)


async def _wait_for(mgmtd: MgmtdClient, done, timeout: float = 120.0) -> None:
    with trio.fail_after(timeout):
        while not done((await mgmtd.call(STATUS, Empty())).routing.chains):
            await trio.sleep(0.05)


def _returning_out(chains) -> bool:
    return all(c.state_of(RETURNING * 100) not in (TargetState.SERVING, TargetState.SYNCING) for c in chains)


def _all_serving(chains) -> bool:
    return all(t.state is TargetState.SERVING for c in chains for t in c.targets)


def _wchar(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        io = Path(f"/proc/{pid}/io").read_text()
        total += int(re.search(r"^wchar: (\d+)", io, re.M).group(1))
    return total


def _logged_resync_bytes(logs: Path, since: dict[str, int]) -> int | None:
    """Bytes the predecessors logged for the resync that followed ``since`` (each log's size then); None if none
    was logged (a server without that log line)."""
    total = None
    for name, start in since.items():
        with open(logs / f"{name}.log", "rb") as f:
            f.seek(start)
            for line in f.read().decode(errors="replace").splitlines():
                m = re.search(r"resync of target \d+ done: (\d+) bytes sent", line)
                if m:
                    total = (total or 0) + int(m.group(1))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file-mib", type=int, default=64)
    parser.add_argument("--writes", default="1,16,64", help="comma-separated counts of 4 KiB writes")
    args = parser.parse_args()
    os.environ["KVFS_SHM"] = "0"  # chunk servers inherit it: peer traffic over sockets, so wchar sees it
    rng = random.Random(7)
    model = bytearray(os.urandom(args.file_mib << 20))
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVFS_BENCH_DIR")) as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster")
        cluster._init(Path(tmp) / "mnt", 3, 3)
        config = load_config(cluster.config_path)
        quiet = lambda *a: None  # noqa: E731
        try:
            cluster.up(Path(tmp) / "mnt", mounted=False, echo=quiet)
            trio.run(_storage_call, config, lambda s, m: _write(s, [(0, bytes(model))]))
            for n in [int(x) for x in args.writes.split(",")]:
                os.kill(cluster.pid_of(f"cs{RETURNING}"), signal.SIGKILL)
                trio.run(_storage_call, config, lambda s, m: _wait_for(m, _returning_out))
                pieces = []
                for _ in range(n):
                    at = rng.randrange(0, len(model) - 4096)
                    model[at : at + 4096] = data = os.urandom(4096)
                    pieces.append((at, data))
                trio.run(_storage_call, config, lambda s, m: _write(s, pieces))
                others = [f"cs{node}" for node in (1, 2, 3) if node != RETURNING]
                pids = [cluster.pid_of(name) for name in others]
                logs = cluster.data / "logs"
                since = {name: (logs / f"{name}.log").stat().st_size for name in others}
                before, start = _wchar(pids), time.monotonic()
                cluster.up(Path(tmp) / "mnt", mounted=False, echo=quiet)
                trio.run(_storage_call, config, lambda s, m: _wait_for(m, _all_serving))
                seconds, written = time.monotonic() - start, _wchar(pids) - before
                chunks = len({at // LAYOUT.chunk_size for at, _ in pieces} | {(at + 4095) // LAYOUT.chunk_size
                                                                              for at, _ in pieces})
                rows.append((n, chunks, seconds, written, _logged_resync_bytes(logs, since)))

            async def check(storage: StorageClient, mgmtd: MgmtdClient) -> None:
                out = bytearray(len(model))
                await storage.read(INODE, LAYOUT, 0, memoryview(out))
                assert out == model, "the file read back differs from what was written"

            trio.run(_storage_call, config, check)
        finally:
            cluster.down(echo=quiet)
    print(f"file {args.file_mib} MiB in 4 MiB chunks, replication 3; chunk server {RETURNING} killed, N 4 KiB writes,"
          " restarted")
    print(f"{'N':>4} {'chunks':>7} {'resync s':>9} {'others wrote MiB':>17} {'resync logged KiB':>18}")
    for n, chunks, seconds, written, logged in rows:
        shown = "-" if logged is None else f"{logged / 1024:.0f}"
        print(f"{n:>4} {chunks:>7} {seconds:>9.2f} {written / 2**20:>17.2f} {shown:>18}")


if __name__ == "__main__":
    main()
