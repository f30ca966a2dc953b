"""Process entry point of ``kvfs meta``."""

from __future__ import annotations

from kvfs.config import ClusterConfig
from kvfs.rpc import RpcServer
from kvfs.service import run_service, serve_rpc, setup_logging
from meta.kv import open_database
from meta.service import MetaService
from meta.store import MetaStore


def serve_meta(
    config: ClusterConfig, *, listen: str, http: str | None = None, kv_url: str | None = None, log_level: str = "INFO"
) -> None:
    setup_logging(log_level)
    db = open_database(kv_url or config.kv_url)
    store = MetaStore(db)
    store.format()
    server = RpcServer(config.resolved_token(), name="meta")
    service = MetaService(store, server, gc_interval=config.meta_service.gc_interval)

    async def main() -> None:
        await serve_rpc(server, listen, http=http, background=(service.run_gc,))

    try:
        run_service(main)
    finally:
        db.close()
