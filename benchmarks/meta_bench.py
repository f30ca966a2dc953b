"""Metadata benchmark: create / stat / unlink operations per second through a real ``kvfs meta`` process.

    .venv/bin/python benchmarks/meta_bench.py [--files 2000] [--clients 8]

Runs one client, then N concurrent clients (each its own connection and directory), against one
``kvfs meta`` on a fresh SQLite store, and prints ops/s per phase beside the same operations called on an
in-process MetaStore (no RPC) as the baseline.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from kvfs.rpc import RpcClient
from kvfs.meta.client import RemoteMeta
from kvfs.meta.local import LocalMeta
from kvfs.kv import open_database
from kvfs.meta.store import MetaStore
from kvfs.meta.types import ROOT

TOKEN = "bench"


async def phases(meta, directory: int, files: int) -> dict[str, float]:
    names = [f"f{i}".encode() for i in range(files)]
    out = {}
    for phase in ("create", "stat", "unlink"):
        start = time.perf_counter()
        for name in names:
            if phase == "create":
                opened = await meta.create(ROOT, directory, name, 0o644)
                await meta.close(ROOT, opened.attr.ino, opened.session)
            elif phase == "stat":
                await meta.lookup(ROOT, directory, name)
            else:
                await meta.unlink(ROOT, directory, name)
        out[phase] = files / (time.perf_counter() - start)
    return out


async def run_clients(make_meta, clients: int, files: int) -> dict[str, float]:
    results: list[dict[str, float]] = []

    async def one(i: int) -> None:
        async with make_meta() as meta:
            d = await meta.mkdir(ROOT, 1, f"bench-{clients}-{i}-{time.monotonic_ns()}".encode(), 0o755)
            results.append(await phases(meta, d.ino, files))

    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(one, i)
    # aggregate rate: all clients run each phase roughly together; sum of per-client rates
    return {phase: sum(r[phase] for r in results) for phase in results[0]}


class _Remote:
    def __init__(self, address: str) -> None:
        self.address = address

    async def __aenter__(self):
        self._client = RpcClient(TOKEN)
        await self._client.__aenter__()
        return RemoteMeta(self._client, [self.address])

    async def __aexit__(self, *exc):
        await self._client.__aexit__(*exc)


class _Local:
    def __init__(self, store: MetaStore) -> None:
        self.store = store

    async def __aenter__(self):
        return LocalMeta(self.store)

    async def __aexit__(self, *exc):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000, help="files per client")
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        address = f"127.0.0.1:{port}"
        server = subprocess.Popen(
            [sys.executable, "-m", "kvfs", "meta", "--listen", address, "--kv-url", f"sqlite:///{tmp}/rpc.db",
             "--log-level", "WARNING"],
            env={**os.environ, "KVFS_TOKEN": TOKEN},
        )
        try:
            for _ in range(200):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.05)
            store = MetaStore(open_database(f"sqlite:///{Path(tmp) / 'local.db'}"))
            store.format()
            rows = []
            for clients in (1, args.clients):
                remote = trio.run(run_clients, lambda: _Remote(address), clients, args.files // clients)
                local = trio.run(run_clients, lambda: _Local(store), clients, args.files // clients)
                rows.append((clients, remote, local))
        finally:
            server.terminate()
            server.wait()
    print(f"{'clients':>7} {'op':<8}{'kvfs meta (RPC) ops/s':>24}{'in-process store ops/s':>25}{'ratio':>8}")
    for clients, remote, local in rows:
        for phase in remote:
            print(f"{clients:>7} {phase:<8}{remote[phase]:>24,.0f}{local[phase]:>25,.0f}{remote[phase] / local[phase]:>8.2f}")


if __name__ == "__main__":
    main()
