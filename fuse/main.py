"""Process entry point of ``kvfs mount``: the mount wired to the real metadata service and chunk servers."""

from __future__ import annotations

import trio

from kvfs.chunkserver.client import StorageClient
from kvfs.chunkserver.protocol import CHUNK_LIMITS
from kvfs.craq.client import MgmtdClient
from kvfs.config import ClusterConfig
from kvfs.errors import KvfsError
from kvfs.rpc import RpcClient
from kvfs.service import setup_logging
from kvfs.transport import shm
from kvfs.meta.client import RemoteMeta

from .mount import run_mount


def serve_mount(config: ClusterConfig, mountpoint: str, *, log_level: str = "INFO", **options: object) -> None:
    """Mount until SIGTERM/SIGINT or an external unmount."""
    setup_logging(log_level)
    if not config.meta or not config.mgmtd:
        raise KvfsError("the config must list meta = [...] and mgmtd = [...] addresses to mount")
    token = config.resolved_token()
    transport = config.resolved_transport()

    async def main() -> None:
        timeouts = config.timeouts
        async with RpcClient(token, limits=CHUNK_LIMITS, connect_timeout=timeouts.connect,
                             call_timeout=timeouts.call, transport=transport,
                             shared_memory=config.resolved_shared_memory()) as rpc:
            meta = RemoteMeta(rpc, config.meta)
            storage = StorageClient(rpc, MgmtdClient(rpc, config.mgmtd), call_timeout=timeouts.call)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(meta.keep_alive)
                nursery.start_soon(shm.give_back_idle)
                await run_mount(meta, storage, mountpoint, **options)
                nursery.cancel_scope.cancel()
            rpc.close()

    trio.run(main)
