"""Process entry point of ``kvfs meta``."""

from __future__ import annotations

import contextlib

from kvfs.config import ClusterConfig
from kvfs.rpc import RpcClient, RpcServer
from kvfs.service import run_service, serve_rpc, setup_logging
from kvfs.kv import open_database
from kvfs.meta.service import MetaService
from kvfs.meta.store import MetaStore
from kvfs.meta.types import Layout

#: New files spread their chunks over up to this many chains, so one big file reads and writes in parallel.
DEFAULT_STRIPE = 16


def serve_meta(
    config: ClusterConfig, *, listen: str, http: str | None = None, kv_url: str | None = None, log_level: str = "INFO"
) -> None:
    setup_logging(log_level)
    token = config.resolved_token()
    transport = config.resolved_transport()
    db = open_database(kv_url or config.kv_url)
    server = RpcServer(token, name="meta", transport=transport)

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            remover = None
            if config.mgmtd:  # chunks of removed files can only be freed where the chunk servers are known
                from kvfs.chunkserver.client import StorageClient, SyncChunkRemover
                from kvfs.craq.client import MgmtdClient

                client = RpcClient(token, connect_timeout=config.timeouts.connect, transport=transport)
                rpc = await stack.enter_async_context(client)
                remover = SyncChunkRemover(StorageClient(rpc, MgmtdClient(rpc, config.mgmtd)))
            store = MetaStore(db, chunk_remover=remover, root_layout=Layout(stripe=DEFAULT_STRIPE),
                              client_lease=config.meta_service.client_lease)
            store.format()
            service = MetaService(store, server, gc_interval=config.meta_service.gc_interval)
            background = (service.run_gc,)
            await serve_rpc(server, listen, http=http, background=background)

    try:
        run_service(main)
    finally:
        db.close()
