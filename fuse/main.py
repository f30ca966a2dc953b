"""Process entry point of ``kvfs mount``: the mount wired to the real metadata service and chunk servers."""

from __future__ import annotations

import logging
import os

import trio

from kvfs.chunkserver.client import StorageClient
from kvfs.chunkserver.protocol import CHUNK_LIMITS
from kvfs.config import ClusterConfig
from kvfs.craq.client import MgmtdClient
from kvfs.errors import AuthError, KvfsError
from kvfs.meta.client import RemoteMeta
from kvfs.meta.types import Caller
from kvfs.rpc import RpcClient, parse_address
from kvfs.service import freeze_after_full_collections, serve_http, setup_logging
from kvfs.transport import shm

from .mount import run_mount

log = logging.getLogger(__name__)


def serve_mount(config: ClusterConfig, mountpoint: str, *, log_level: str = "INFO", http: str | None = None,
                **options: object) -> None:
    """Mount until SIGTERM/SIGINT or an external unmount; with ``http`` (host:port, port 0: any), serve
    ``/metrics`` there too (how many calls reach meta: ``kvfs_meta_client_calls_total``)."""
    setup_logging(log_level)
    freeze_after_full_collections()  # its caches of inodes and entries are long-lived state too
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
            await _check_token(meta)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(meta.keep_alive)
                nursery.start_soon(shm.give_back_idle, 2.0, 5.0)  # write buffers back 5 s after the last write
                if http:
                    host, port = parse_address(http)
                    port = await nursery.start(serve_http, host, port, lambda: {"ok": True})
                    log.info("metrics on http://%s:%d/metrics", host, port)
                await run_mount(meta, storage, mountpoint, **options)
                nursery.cancel_scope.cancel()
            rpc.close()

    trio.run(main)


async def _check_token(meta: RemoteMeta) -> None:
    """Refuse to mount with a token the cluster does not take: a mount that answered every call with EACCES
    would look healthy to whoever mounted it. Meta unreachable for now is not fatal: the mount retries later."""
    try:
        await meta.renew_client(Caller(os.getuid(), os.getgid(), client=meta.client_id))
    except AuthError as exc:
        raise KvfsError(f"the cluster refused this config's token ({exc.message}); check token/token_file"
                        " or KVFS_TOKEN") from None
    except OSError:
        pass
