"""The storage client against real chunk servers and mgmtd on loopback, replication 3."""

from __future__ import annotations

import os

import pytest
import trio
from harness import TOKEN, Cluster, write_config

from chunkserver.client import StorageClient
from craq.messages import TargetState
from craq.mgmtd import CREATE_CHAINS, STATUS, CreateChains, MgmtdClient
from kvfs.rpc import RpcClient
from kvfs.wire import Empty
from meta.types import Layout

LAYOUT = Layout(chunk_size=1 << 20, stripe=4, seed=7)


async def wait_all_serving(mgmtd: MgmtdClient, chains: int, timeout: float = 20.0):
    with trio.fail_after(timeout):
        while True:
            status = await mgmtd.call(STATUS, Empty())
            states = [t.state for c in status.routing.chains for t in c.targets]
            if len(status.routing.chains) == chains and all(s is TargetState.SERVING for s in states):
                return status
            await trio.sleep(0.1)


@pytest.fixture
async def cluster(processes, tmp_path):
    c = Cluster(processes, tmp_path, write_config(tmp_path / "kvfs.toml"))
    c.start_mgmtd()
    for node in (1, 2, 3):
        c.start_chunkserver(node)
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        mgmtd = MgmtdClient(rpc, c.mgmtd)
        with trio.fail_after(20):
            while True:  # chunk servers register asynchronously
                status = await mgmtd.call(STATUS, Empty())
                if len(status.nodes) == 3:
                    break
                await trio.sleep(0.1)
        await mgmtd.call(CREATE_CHAINS, CreateChains(replicas=3))
        await wait_all_serving(mgmtd, 1)
    return c


async def test_write_read_round_trip(cluster):
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        data = os.urandom(5 * (1 << 20) + 12345)
        await storage.write(42, LAYOUT, 1000, data)
        out = bytearray(len(data) + 2000)
        await storage.read(42, LAYOUT, 0, memoryview(out))
        assert out[:1000] == bytes(1000)  # a hole before the write
        assert out[1000 : 1000 + len(data)] == data
        assert out[1000 + len(data) :] == bytes(1000)
        # overwrite in the middle, across a chunk boundary
        patch = os.urandom(300_000)
        await storage.write(42, LAYOUT, (1 << 20) - 100_000, patch)
        expected = bytearray(out)
        expected[(1 << 20) - 100_000 : (1 << 20) + 200_000] = patch
        await storage.read(42, LAYOUT, 0, memoryview(out))
        assert out == expected
        await storage.truncate(42, LAYOUT, 1000 + len(data), 1_500_000)
        back = bytearray(3 << 20)
        await storage.read(42, LAYOUT, 0, memoryview(back))
        assert back[:1_500_000] == expected[:1_500_000] and back[1_500_000:] == bytes(len(back) - 1_500_000)
        total, free = await storage.capacity()
        assert total > 0 and free > 0
