"""``kvfs mgmtd`` as real processes: lease election, registration, chain creation and failover."""

from __future__ import annotations

import trio
from harness import TOKEN, free_port, wait_for_port, write_config

from kvfs.craq.cluster import Heartbeat
from kvfs.craq.messages import TargetState
from kvfs.craq.client import CREATE_CHAINS, HEARTBEAT, REGISTER, STATUS, CreateChains, MgmtdClient, RegisterNode
from kvfs.rpc import RpcClient
from kvfs.wire import Empty


def start_mgmtds(processes, tmp_path, n: int) -> list[str]:
    config = write_config(tmp_path / "kvfs.toml")
    addresses = []
    for i in range(n):
        address = f"127.0.0.1:{free_port()}"
        proc = processes.start("mgmtd", "--config", config, "--listen", address,
                               "--kv-url", f"sqlite:///{tmp_path}/kv.db", name=f"mgmtd{i}")
        wait_for_port(address, proc)
        addresses.append(address)
    return addresses


async def test_chains_and_failover_to_standby(processes, tmp_path):
    addresses = start_mgmtds(processes, tmp_path, 2)
    async with RpcClient(TOKEN, connect_timeout=1, call_timeout=5) as rpc:
        mgmtd = MgmtdClient(rpc, addresses)
        for node in (1, 2, 3):
            await mgmtd.call(REGISTER, RegisterNode(node_id=node, address=f"127.0.0.1:{9000 + node}",
                                                    targets=[node * 100, node * 100 + 1]))
            await mgmtd.call(HEARTBEAT, Heartbeat(node, 1, f"127.0.0.1:{9000 + node}", trio.current_time()))
        created = await mgmtd.call(CREATE_CHAINS, CreateChains(replicas=3))
        assert created.chain_ids == [1, 2]
        status = await mgmtd.call(STATUS, Empty())
        primary = status.primary
        assert [len(c.targets) for c in status.routing.chains] == [3, 3]

        victim = next(p for p, a in zip(processes.procs, addresses) if a == primary)
        processes.kill(victim)
        with trio.fail_after(15):
            while True:  # the standby takes the lease once it lapses, and serves the persisted chains
                for node in (1, 2):  # node 3 stays silent: it must be declared dead by the new primary
                    await mgmtd.call(HEARTBEAT, Heartbeat(node, 1, f"127.0.0.1:{9000 + node}", trio.current_time()))
                status = await mgmtd.call(STATUS, Empty())
                assert status.primary != primary
                states = {t.node_id: t.state for c in status.routing.chains for t in c.targets}
                if states[3] is TargetState.OFFLINE:
                    break
                await trio.sleep(0.2)
        chain = status.routing.chains[0]
        assert chain.chain_version > 1
        assert chain.targets[-1].node_id == 3  # the dead target moved to the end of its chain
