"""Process entry point of ``kvfs mgmtd``."""

from __future__ import annotations

import uuid

from kvfs.craq.mgmtd import MgmtdService
from kvfs.config import ClusterConfig
from kvfs.rpc import RpcServer
from kvfs.service import run_service, serve_rpc, setup_logging
from kvfs.kv import open_database


def serve_mgmtd(
    config: ClusterConfig, *, listen: str, http: str | None = None, kv_url: str | None = None, log_level: str = "INFO"
) -> None:
    setup_logging(log_level)
    db = open_database(kv_url or config.kv_url)
    server = RpcServer(config.resolved_token(), name="mgmtd")
    service = MgmtdService(
        db,
        server,
        instance_id=f"{listen}/{uuid.uuid4().hex[:8]}",
        address=listen,
        heartbeat_timeout=config.timeouts.heartbeat_timeout,
        lease=config.timeouts.lease,
        recovery_wait=config.timeouts.recovery_wait,
    )

    async def main() -> None:
        await serve_rpc(
            server, listen, http=http, background=(service.run,),
            health=lambda: {"ok": True, "primary": service.is_primary, "primary_address": service.primary_address},
        )

    try:
        run_service(main)
    finally:
        db.close()
