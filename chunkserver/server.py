"""Process entry point of ``kvfs chunkserver``."""

from __future__ import annotations

import contextlib
from pathlib import Path


from kvfs.chunkserver.engine import ChunkEngine
from kvfs.chunkserver.protocol import CHUNK_LIMITS
from kvfs.chunkserver.service import ChunkServer, target_id_for
from kvfs.craq.client import MgmtdClient
from kvfs.config import ClusterConfig
from kvfs.errors import KvfsError
from kvfs.pool import RECEIVED
from kvfs.rpc import RpcClient, RpcServer
from kvfs.service import run_service, serve_rpc, setup_logging
from kvfs.transport import shm

async def _give_back_idle_buffers() -> None:
    """A chunk server's buffers are idle once writes and reads stop and a flush has written out what it held: give
    their pages back within seconds, not the mount's half minute (a chunk server's pools are the host's largest)."""
    await shm.give_back_idle(every=1.0, idle=2.0)


def serve_chunkserver(
    config: ClusterConfig,
    *,
    node_id: int,
    listen: str,
    targets: list[str],
    http: str | None = None,
    log_level: str = "INFO",
) -> None:
    setup_logging(log_level)
    targets = targets or config.chunkserver.targets
    if not targets:
        raise KvfsError("no storage targets: pass --target DIR (repeatable) or set [chunkserver] targets")
    if not config.mgmtd:
        raise KvfsError("no mgmtd address: set mgmtd = [...] in the config or pass --mgmtd")
    token = config.resolved_token()
    transport = config.resolved_transport()  # forced rdma without a device fails here, before anything starts
    shared_memory = config.resolved_shared_memory()
    hold = config.chunkserver.resolved_hold_bytes()
    shm.SHARED.capacity, RECEIVED.capacity = config.chunkserver.pool_capacities(
        hold, shm.SHARED.capacity, RECEIVED.capacity)

    async def main() -> None:
        with contextlib.ExitStack() as stack:
            engines = {
                target_id_for(node_id, i): stack.enter_context(
                    ChunkEngine(Path(path), fsync=config.chunkserver.fsync,
                                write_through=config.chunkserver.write_through,
                                capacity_bytes=config.chunkserver.capacity_bytes,
                                direct_io=config.chunkserver.direct_io, hold_bytes=hold // len(targets),
                                reserve_bytes=config.chunkserver.reserve_bytes)
                )
                for i, path in enumerate(targets)
            }
            server = RpcServer(token, limits=CHUNK_LIMITS, name="chunkserver", transport=transport,
                               shared_memory=shared_memory)
            timeouts = config.timeouts
            async with RpcClient(token, limits=CHUNK_LIMITS, connect_timeout=timeouts.connect,
                                 call_timeout=timeouts.call, transport=transport, shared_memory=shared_memory) as rpc:
                chunkserver = ChunkServer(
                    node_id, listen, engines, rpc, MgmtdClient(rpc, config.mgmtd),
                    heartbeat_interval=timeouts.heartbeat_interval, flush_interval=config.chunkserver.sync_interval,
                )
                chunkserver.register_handlers(server)
                await serve_rpc(
                    server, listen, http=http, background=(chunkserver.run, _give_back_idle_buffers),
                    health=lambda: {"ok": chunkserver.registered.is_set(), "targets": sorted(engines)},
                )

    run_service(main)
