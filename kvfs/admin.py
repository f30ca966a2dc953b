"""``kvfs admin``: operator views and actions on a running cluster (any cluster, not only ``kvfs up``'s)."""

from __future__ import annotations

import errno
from typing import Any

import msgspec
import trio

from kvfs.config import ClusterConfig
from kvfs.errors import KvfsError
from kvfs.rpc import RpcClient


async def cluster_status(config: ClusterConfig) -> Any:
    from kvfs.craq.client import STATUS, MgmtdClient
    from kvfs.wire import Empty

    async with RpcClient(config.resolved_token(), connect_timeout=2, call_timeout=5) as rpc:
        return await MgmtdClient(rpc, config.mgmtd, rounds=2).call(STATUS, Empty())


async def create_chains(config: ClusterConfig, replicas: int) -> list[int]:
    from kvfs.craq.client import CREATE_CHAINS, CreateChains, MgmtdClient

    async with RpcClient(config.resolved_token(), connect_timeout=2, call_timeout=10) as rpc:
        created = await MgmtdClient(rpc, config.mgmtd, rounds=2).call(CREATE_CHAINS, CreateChains(replicas=replicas))
        return created.chain_ids


class ReplicaState(msgspec.Struct):
    target_id: int
    state: str
    version: int
    length: int
    crc: int
    error: str = ""


class ChunkCheck(msgspec.Struct):
    index: int
    chain_id: int
    replicas: list[ReplicaState]

    @property
    def consistent(self) -> bool:
        serving = [(r.version, r.length, r.crc) for r in self.replicas if r.state == "serving" and not r.error]
        return len(set(serving)) <= 1 and all(not r.error for r in self.replicas if r.state == "serving")


async def check_file(config: ClusterConfig, path: str, progress: Any = None) -> tuple[Any, list[ChunkCheck]]:
    """Every chunk of the file at ``path`` (relative to the filesystem root) as each replica holds it."""
    from kvfs.chunkserver import protocol as p
    from kvfs.craq.messages import ChunkId
    from kvfs.craq.client import ROUTING, MgmtdClient
    from kvfs.wire import Empty
    from kvfs.meta.client import RemoteMeta
    from kvfs.chunkserver.placement import chunk_chain
    from kvfs.meta.types import ROOT

    if not config.meta:
        raise KvfsError("the config lists no meta addresses", errno.EINVAL)
    async with RpcClient(config.resolved_token(), connect_timeout=2, call_timeout=10) as rpc:
        meta = RemoteMeta(rpc, config.meta)
        attr = await meta.resolve(ROOT, path)
        layout = await meta.get_layout(ROOT, attr.ino)
        routing = await MgmtdClient(rpc, config.mgmtd).call(ROUTING, Empty())
        chunks = -(-attr.size // layout.chunk_size)
        results: list[ChunkCheck] = []
        for index in range(chunks):
            chain = routing.chains[chunk_chain(layout, attr.ino, index, len(routing.chains))]
            replicas = []
            for t in chain.targets:
                try:
                    stat = await rpc.call(routing.addresses[t.node_id], p.CHUNK_STAT,
                                          p.ChunkStatQuery(t.target_id, ChunkId(attr.ino, index)), timeout=5)
                    replicas.append(ReplicaState(t.target_id, t.state.value, stat.version, stat.length, stat.crc))
                except KvfsError as exc:
                    replicas.append(ReplicaState(t.target_id, t.state.value, 0, 0, 0, exc.message))
            results.append(ChunkCheck(index, chain.chain_id, replicas))
            if progress is not None:
                progress(index + 1, chunks)
        return attr, results


def run(fn: Any, *args: Any) -> Any:
    return trio.run(fn, *args)
