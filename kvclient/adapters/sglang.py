"""SGLang HiCache storage backend: HiCache's L3 tier kept in kvfs (see kvclient/README.md, "Engine adapters").

Loaded by ``--hicache-storage-backend dynamic`` with ``--hicache-storage-backend-extra-config`` holding
``{"backend_name": "kvfs", "module_path": "kvfs.kvclient.adapters.sglang", "class_name": "KvfsHiCacheStorage",
"interface_v1": 1, "config": "<kvfs client config>", "namespace": "<namespace>"}``.

Pages move zero-copy: the host pool's buffers are registered with the client once, and each page's buffers (the
pointers ``get_page_buffer_meta`` gives: K and V for MHA, one row block for MLA in the page-first layouts) are
read into and written from slices of them. Each such buffer is one kvfs entry,
``<page hash>-<geometry tag>[-tp<rank>of<size>][-pp<rank>of<size>][-cp<rank>of<size>]-<part>``: the tag digests
the model, pool class, layout, dtype and page geometry, so pages of another layout or dtype are misses rather than
garbage; MHA keys carry the TP rank (each rank holds its heads); MLA keys do not (every rank holds the same rows)
and only the storage writer (TP rank 0) writes them.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvfs.kvclient.client import KVClient

logger = logging.getLogger(__name__)


class KvfsHiCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` for ``interface_v1``. Failures are ``False`` per page (HiCache's signal: it stops at
    the first failed page), logged, never exceptions in the I/O threads; bad configuration raises at start."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = storage_config.extra_config or {}
        path, namespace = extra.get("config"), extra.get("namespace")
        if not path or not namespace:
            raise ValueError("the kvfs HiCache backend needs 'config' (a kvfs client config) and 'namespace' in "
                             "--hicache-storage-backend-extra-config")
        if not extra.get("interface_v1"):
            raise ValueError("the kvfs HiCache backend moves pages zero-copy: set \"interface_v1\": 1 in "
                             "--hicache-storage-backend-extra-config")
        if storage_config.should_split_heads:
            raise ValueError("the kvfs HiCache backend does not split heads across TP sizes (tp_lcm_size)")
        self.config = storage_config
        suffix = "" if storage_config.is_mla_model else f"-tp{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            suffix += f"-pp{storage_config.pp_rank}of{storage_config.pp_size}"
        if storage_config.attn_cp_size > 1:
            suffix += f"-cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}"
        self.rank_suffix = suffix
        self.kv = KVClient.from_config(path, namespace)
        self.tag = ""
        self.parts = 0
        self._starts: list[int] = []
        self._regions: list[Any] = []
        logger.info("kvfs HiCache backend: namespace %s from %s", namespace, path)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the pool's buffers with the client and learns a page's buffers (their count and sizes) from
        the pool itself; a layout whose page buffers lie outside those buffers is refused here."""
        super().register_mem_pool_host(mem_pool_host)
        tensors = [t for t in (getattr(mem_pool_host, n, None) for n in ("kv_buffer", "k_buffer", "v_buffer"))
                   if isinstance(t, torch.Tensor) and t.numel()]
        regions = {t.data_ptr(): self.kv.register_buffer(t.data_ptr(), t.numel() * t.element_size(), "cpu")
                   for t in tensors}
        self._starts = sorted(regions)
        self._regions = [regions[s] for s in self._starts]
        page = getattr(mem_pool_host, "logical_page_size", mem_pool_host.page_size)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        self.parts = len(ptrs)
        for p, s in zip(ptrs, sizes):
            self._slice(p, s)
        geometry = (self.config.model_name, type(mem_pool_host).__name__, mem_pool_host.layout,
                    str(mem_pool_host.dtype), page, tuple(sizes))
        self.tag = hashlib.sha256(repr(geometry).encode()).hexdigest()[:12]

    def _slice(self, ptr: int, size: int) -> memoryview:
        """The registered host memory at [ptr, ptr+size): a view, no copy; ValueError outside the pool."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0 or ptr + size > self._starts[i] + self._regions[i].size:
            raise ValueError(f"page buffer {ptr:#x}+{size} lies outside the registered host pool")
        off = ptr - self._starts[i]
        return self._regions[i].view[off:off + size]

    def _entries(self, keys: list[str]) -> list[str]:
        return [f"{k}-{self.tag}{self.rank_suffix}-{j}" for k in keys for j in range(self.parts)]

    def _pages(self, keys: list[str], host_indices: torch.Tensor) -> tuple[list[str], list[memoryview]]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * self.parts:
            raise ValueError(f"{len(keys)} keys but {len(ptrs)} page buffers for {self.parts} per page")
        return self._entries(keys), [self._slice(p, s) for p, s in zip(ptrs, sizes)]

    def _batch(self, what: str, keys: list[str], host_indices: torch.Tensor,
               call: Callable[[list[str], list[memoryview]], list[int]]) -> tuple[list[str], list[memoryview],
                                                                                  list[int]] | None:
        """``call`` on every page buffer's entry and view, or None (logged) where the batch failed as a whole."""
        try:
            names, views = self._pages(keys, host_indices)
            return names, views, call(names, views)
        except (OSError, ValueError, TypeError) as e:
            logger.error("kvfs HiCache %s of %d pages failed: %s", what, len(keys), e)
            return None

    def _per_page(self, ok: list[bool]) -> list[bool]:
        return [all(ok[i:i + self.parts]) for i in range(0, len(ok), self.parts)]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Every buffer of every page read straight into the host pool, in one batch; a page is loaded only if
        each of its entries had exactly its buffer's size."""
        done = self._batch("get", keys, host_indices, self.kv.batch_get_into)
        if done is None:
            return [False] * len(keys)
        names, views, results = done
        for name, r in zip(names, results):
            if r < 0 and r != -errno.ENOENT:
                logger.error("kvfs HiCache get of %s failed: %s", name, errno.errorcode.get(-r, r))
        return self._per_page([r == len(v) for r, v in zip(results, views)])

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Every page's buffers put from the host pool in one batch (existing entries are kept as they are).
        MLA rows are the same on every rank: only the storage writer puts them, the others report success."""
        if not self.config.is_storage_writer:
            return [True] * len(keys)
        done = self._batch("put", keys, host_indices, self.kv.batch_put)
        return [False] * len(keys) if done is None else self._per_page([r == 0 for r in done[2]])

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The leading pages with all their entries present, in one metadata round trip."""
        try:
            return self.kv.prefix_hits(self._entries(keys)) // max(self.parts, 1)
        except (OSError, ValueError, TypeError) as e:
            logger.error("kvfs HiCache lookup of %d pages failed: %s", len(keys), e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # HiCache's older per-tensor interface, used only without interface_v1 (which __init__ requires).
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        raise NotImplementedError("the kvfs HiCache backend serves interface_v1 (batch_get_v1) only")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("the kvfs HiCache backend serves interface_v1 (batch_get_v1) only")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("the kvfs HiCache backend serves interface_v1 (batch_set_v1) only")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError("the kvfs HiCache backend serves interface_v1 (batch_set_v1) only")

    def close(self) -> None:
        self.kv.close()
