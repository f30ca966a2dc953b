"""LMCache remote-storage plugin: LMCache's remote tier kept in kvfs (see kvclient/README.md, "Engine adapters").

Enabled in LMCache's config with ``remote_storage_plugins: [kvfs]`` and, under ``extra_config``,
``remote_storage_plugin.kvfs.module_path: kvfs.kvclient.adapters.lmcache``,
``remote_storage_plugin.kvfs.class_name: KvfsConnector``, ``remote_storage_plugin.kvfs.config`` (a kvfs client
config, e.g. DATA/client.toml) and ``remote_storage_plugin.kvfs.namespace``.

An entry holds the chunk's KV bytes only, no LMCache header: a get reads the object straight into the memory
object LMCache allocates (one copy, from the wire or the replica file into LMCache's buffer) and learns a partial
chunk's token count from the object's length. Shapes and dtypes therefore come from the engine's metadata: give
each model and KV layout its own namespace.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
from typing import Any

from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from kvfs.kvclient.client import AsyncKVClient
from kvfs.meta.posix import NAME_MAX

PLUGIN = "kvfs"
logger = init_logger(__name__)


def entry_name(key: CacheEngineKey) -> str:
    """A kvfs key for an LMCache key: its string form with '%' and '/' escaped (model names hold '/'), or a
    digest of it where that is longer than a file name may be."""
    name = key.to_string().replace("%", "%25").replace("/", "%2F")
    if len(name.encode()) > NAME_MAX:
        name = "sha256-" + hashlib.sha256(name.encode()).hexdigest()
    return name


class KvfsConnector(RemoteConnector):
    """A ``RemoteConnector`` whose gets fill LMCache's own memory objects. Misses, and objects that cannot be a
    chunk of this model (too large for the buffer, a size that is no whole number of tokens), are ``None`` as
    LMCache expects, logged; puts raise on failure, as LMCache's RemoteBackend counts failed puts."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: LocalCPUBackend,
                 config: LMCacheEngineConfig | None) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra: dict[str, Any] = (config.extra_config if config is not None else None) or {}
        path = extra.get(f"remote_storage_plugin.{PLUGIN}.config")
        namespace = extra.get(f"remote_storage_plugin.{PLUGIN}.namespace")
        if not path or not namespace:
            raise ValueError(f"the kvfs connector needs remote_storage_plugin.{PLUGIN}.config (a kvfs client "
                             f"config) and remote_storage_plugin.{PLUGIN}.namespace in extra_config")
        if config is not None and config.use_layerwise:
            raise ValueError("the kvfs connector stores whole chunks; LMCache's use_layerwise is not supported")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.kv = AsyncKVClient.from_config(path, namespace)
        logger.info("kvfs connector: namespace %s from %s", namespace, path)

    async def exists(self, key: CacheEngineKey) -> bool:
        return (await self.kv.batch_exists([entry_name(key)]))[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.kv.client.batch_exists([entry_name(key)])[0]

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """The leading hits, in one metadata round trip."""
        return await self.kv.prefix_hits([entry_name(k) for k in keys])

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self.kv.client.prefix_hits([entry_name(k) for k in keys])

    def _allocate(self) -> MemoryObj | None:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)

    def _filled(self, key: CacheEngineKey, memory_obj: MemoryObj, result: int) -> MemoryObj | None:
        """The memory object shaped to what was read, or None (and released) for a miss or a bad object."""
        if result < 0:
            if result != -errno.ENOENT:
                logger.error("kvfs get of %s failed: %s", key, errno.errorcode.get(-result, result))
            memory_obj.ref_count_down()
            return None
        try:
            return self.reshape_partial_chunk(memory_obj, result)
        except ValueError as e:
            logger.error("kvfs object %s is no chunk of this model: %s", key, e)
            memory_obj.ref_count_down()
            return None

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One metadata round trip, then every chunk read in parallel straight into LMCache's buffers."""
        objs = [self._allocate() for _ in keys]
        wanted = [i for i, o in enumerate(objs) if o is not None]
        if len(wanted) < len(keys):
            logger.debug("LMCache could not allocate %d of %d buffers", len(keys) - len(wanted), len(keys))
        results: list[int] = []
        try:
            results = await self.kv.batch_get_into([entry_name(keys[i]) for i in wanted],
                                                   [objs[i].byte_array for i in wanted])  # type: ignore[union-attr]
        except OSError as e:
            logger.error("kvfs batch get failed: %s", e)
            results = [-(e.errno or errno.EIO)] * len(wanted)
        out: list[MemoryObj | None] = [None] * len(keys)
        for i, r in zip(wanted, results):
            out[i] = self._filled(keys[i], objs[i], r)  # type: ignore[arg-type]
        return out

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.kv.put(entry_name(key), memory_obj.byte_array)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        results = await self.kv.batch_put([entry_name(k) for k in keys], [m.byte_array for m in memory_objs])
        failed = [(k, r) for k, r in zip(keys, results) if r < 0]
        if failed:
            raise OSError(-failed[0][1], f"kvfs put failed for {len(failed)} of {len(keys)} chunks, first {failed[0][0]}")

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self.kv.client.remove(entry_name(key)) == 0

    async def list(self) -> list[str]:
        """Not offered: listing a namespace is the mount's ``ls``; LMCache calls this only for tooling."""
        raise NotImplementedError("the kvfs connector does not list keys; use ls on /kvcache/<namespace>")

    async def close(self) -> None:
        await self.kv.close()
