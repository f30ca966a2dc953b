"""vLLM KV connector: prompt KV blocks kept in kvfs and shared between engines (see kvclient/README.md, "Engine
adapters").

Loaded by ``--kv-transfer-config '{"kv_connector": "KvfsKVConnector", "kv_connector_module_path":
"kvfs.kvclient.adapters.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {"config": "<kvfs client
config>", "namespace": "<namespace>"}}'``.

An entry is one full block of prompt tokens, every layer of this rank's KV in one object:
``<chain hash>-<geometry tag>[-tp<rank>of<size>]-pp<rank>of<size>``. The chain hash digests the block's token ids
after the previous block's hash (seeded with the request's LoRA, cache salt and multimodal inputs), so requests
sharing a prefix share its entries and a block is only ever read after the blocks before it; the tag digests the
model, KV layout and cache spec, so engines of another geometry miss instead of reading garbage. The scheduler
side counts the leading blocks present on every rank (``prefix_hits``, one metadata round trip); the worker side
loads them before the forward that needs them and saves newly computed prompt blocks after it, each as one batch.
"""

from __future__ import annotations

import errno
import hashlib
import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvfs.kvclient.client import KVClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def chain_hashes(token_ids: Sequence[int], block_size: int, seed: bytes = b"") -> list[str]:
    """One hash per full block: each digests its tokens after the previous block's hash, so equal hashes mean
    equal prefixes."""
    out: list[str] = []
    h = hashlib.sha256(seed).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256(h + array("q", token_ids[start:start + block_size]).tobytes()).digest()
        out.append(h.hex()[:32])
    return out


@dataclass
class BlockTransfer:
    """Blocks of one request to load or save: their chain hashes and, in the same order, the local block ids."""
    req_id: str
    hashes: list[str]
    block_ids: list[int]


@dataclass
class KvfsConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers to do this step."""
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of a running request: its prompt's block hashes, the leading blocks computed
    locally when it was scheduled, its block ids, how many leading blocks kvfs holds (found there or saved), and a
    load waiting to be sent."""
    hashes: list[str]
    prompt_len: int
    local: int
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0
    load: BlockTransfer | None = None


class KvfsKVConnector(KVConnectorBase_V1):
    """A ``KVConnectorBase_V1`` over kvclient. Loads are synchronous (done before the forward that reads them);
    saves are synchronous after the step's forward (``wait_for_save``), so blocks are never held past a request's
    end. A best-effort cache: a failed lookup is a miss, a failed save is logged, a failed load reports its
    blocks to vLLM (``get_block_ids_with_load_errors``), which recomputes or fails them by its
    ``kv_load_failure_policy``. Bad configuration raises at start."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        path, namespace = extra.get("config"), extra.get("namespace")
        if not path or not namespace:
            raise ValueError("the kvfs KV connector needs 'config' (a kvfs client config) and 'namespace' in "
                             "kv_connector_extra_config")
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
            raise ValueError("the kvfs KV connector serves models with one attention KV cache group; this model "
                             f"has {[type(g.kv_cache_spec).__name__ for g in groups]}")
        spec = groups[0].kv_cache_spec
        parallel = vllm_config.parallel_config
        self.block_size = spec.block_size
        self.mla = vllm_config.model_config.use_mla
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        geometry = (vllm_config.model_config.model, kv_cache_config.kv_cache_layout, repr(spec), self.tp_size,
                    self.pp_size)
        self.tag = hashlib.sha256(repr(geometry).encode()).hexdigest()[:12]
        self.kv = KVClient.from_config(path, namespace)
        # Scheduler side.
        self._requests: dict[str, _Tracked] = {}
        # Worker side.
        self._layers: list[torch.Tensor] = []
        self._entry_size = 0
        self._rank_suffix = ""
        self._load_errors: set[int] = set()
        logger.info("kvfs KV connector (%s): namespace %s from %s", role.name.lower(), namespace, path)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, not a lost hand-off

    def _suffix(self, tp_rank: int, pp_rank: int) -> str:
        """MLA rows are the same on every TP rank, so their entries carry no TP rank."""
        tp = "" if self.mla else f"-tp{tp_rank}of{self.tp_size}"
        return f"-{self.tag}{tp}-pp{pp_rank}of{self.pp_size}"

    # ------------------------------------------------------------------ scheduler side
    def _hashes(self, request: Request) -> list[str]:
        """The chain hashes of the prompt's full blocks that may be loaded: never the block holding the last
        prompt token, which the engine must compute to sample from."""
        tokens = request.prompt_token_ids
        if tokens is None:  # prompt embeddings: no token ids to key them by
            return []
        lora = request.lora_request.lora_name if request.lora_request is not None else ""
        features = [f.identifier for f in request.mm_features or ()]
        seed = repr((lora, request.cache_salt, features)).encode()
        return chain_hashes(tokens[:len(tokens) - 1], self.block_size, seed)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The tokens past ``num_computed_tokens`` whose blocks kvfs holds for every rank, counted in one
        metadata round trip; a failed lookup is a miss. A ``kv_producer`` loads nothing, so it finds nothing."""
        hashes = self._hashes(request)
        suffixes = [self._suffix(tp, pp) for tp in range(1 if self.mla else self.tp_size)
                    for pp in range(self.pp_size)]
        hits = 0
        try:
            if self._kv_transfer_config.is_kv_consumer:
                hits = self.kv.prefix_hits([h + s for h in hashes for s in suffixes]) // len(suffixes)
        except (OSError, ValueError) as e:
            logger.error("kvfs lookup for request %s failed: %s", request.request_id, e)
        self._requests[request.request_id] = _Tracked(hashes, len(request.prompt_token_ids or ()),
                                                      num_computed_tokens // self.block_size, stored=hits)
        new = max(0, hits * self.block_size - num_computed_tokens)
        if new:
            logger.info("kvfs holds %d of %d prompt tokens of request %s (%d new)", hits * self.block_size,
                        len(request.prompt_token_ids or ()), request.request_id, new)
        return new, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Notes the blocks to load into: after the local prefix-cache hits, those of the external tokens."""
        tracked = self._requests.get(request.request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        start = tracked.local
        end = start + num_external_tokens // self.block_size
        tracked.load = BlockTransfer(request.request_id, tracked.hashes[start:end], list(block_ids[start:end]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, and saves of the prompt blocks this step completes that kvfs does not hold."""
        meta = KvfsConnectorMetadata()
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        steps: list[tuple[str, list[int] | None, bool, int]] = [
            (r.req_id, r.block_ids[0], True, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            steps.append((req_id, new[0] if new is not None else None, req_id in cached.resumed_req_ids,
                          cached.num_computed_tokens[i]))
        for req_id, block_ids, replace, computed in steps:
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            if replace:
                tracked.block_ids = list(block_ids or ())
            elif block_ids:
                tracked.block_ids.extend(block_ids)
            if tracked.load is not None:
                meta.loads.append(tracked.load)
                tracked.load = None
            done = min(computed + scheduler_output.num_scheduled_tokens.get(req_id, 0), tracked.prompt_len)
            full = min(done // self.block_size, len(tracked.hashes), len(tracked.block_ids))
            if full > tracked.stored and self._kv_transfer_config.is_kv_producer:
                meta.saves.append(BlockTransfer(req_id, tracked.hashes[tracked.stored:full],
                                                tracked.block_ids[tracked.stored:full]))
                tracked.stored = full
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are done by the time a request finishes: its blocks may be freed at once."""
        self._requests.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learns the layers (in the cache group's order, each physical cache once) and an entry's size: a block
        of every layer. A per-layer view is ``[kernel blocks, heads, tokens, content]``; a manager block spans
        ``ratio`` kernel blocks."""
        seen: set[int] = set()
        self._layers = []
        for name in self._kv_cache_config.kv_cache_groups[0].layer_names:
            view = kv_caches.get(name)
            if view is None or view.data_ptr() in seen:
                continue
            seen.add(view.data_ptr())
            ratio = view.shape[0] // self._kv_cache_config.num_blocks
            self._layers.append(view.unflatten(0, (-1, ratio)))
        self._entry_size = sum(t[0].numel() * t.element_size() for t in self._layers)
        self._rank_suffix = self._suffix(get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)

    def entry_names(self, transfer: BlockTransfer) -> list[str]:
        """This rank's kvfs keys for the blocks of ``transfer``."""
        return [h + self._rank_suffix for h in transfer.hashes]

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """One host row per block, holding the block of every layer in turn."""
        rows = torch.empty((len(block_ids), self._entry_size), dtype=torch.uint8)
        offset = 0
        for layer in self._layers:
            blocks = layer[torch.tensor(block_ids, device=layer.device)].contiguous()
            size = blocks[0].numel() * blocks.element_size()
            rows[:, offset:offset + size].copy_(blocks.view(len(block_ids), -1).view(torch.uint8).cpu())
            offset += size
        return rows

    def _scatter(self, rows: torch.Tensor, block_ids: list[int]) -> None:
        offset = 0
        for layer in self._layers:
            shape = (len(block_ids), *layer.shape[1:])
            size = layer[0].numel() * layer.element_size()
            part = rows[:, offset:offset + size].contiguous().view(layer.dtype).view(shape)
            layer[torch.tensor(block_ids, device=layer.device)] = part.to(layer.device)
            offset += size

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Every block this step loads, read in one batch into host rows and copied into the paged cache; blocks
        whose entry is missing or of another size are reported as load errors and left untouched."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfsConnectorMetadata)
        if not meta.loads:
            return
        names = [n for t in meta.loads for n in self.entry_names(t)]
        block_ids = [b for t in meta.loads for b in t.block_ids]
        rows = torch.empty((len(names), self._entry_size), dtype=torch.uint8)
        try:
            results = self.kv.batch_get_into(names, list(rows))
        except (OSError, ValueError) as e:
            logger.error("kvfs load of %d blocks failed: %s", len(names), e)
            self._load_errors.update(block_ids)
            return
        good = [i for i, r in enumerate(results) if r == self._entry_size]
        for i, r in enumerate(results):
            if r != self._entry_size:
                logger.error("kvfs load of %s failed: %s", names[i],
                             errno.errorcode.get(-r, r) if r < 0 else f"{r} bytes, a block holds {self._entry_size}")
                self._load_errors.add(block_ids[i])
        if good:
            self._scatter(rows[good], [block_ids[i] for i in good])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv``, before the forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Blocks are saved whole, every layer at once, in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """The prompt blocks this step completed, gathered and put in one batch (existing entries are kept);
        MLA entries only by TP rank 0, as every rank holds the same rows. Failures are logged: a future miss."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfsConnectorMetadata)
        if not meta.saves or (self.mla and get_tensor_model_parallel_rank() != 0):
            return
        names = [n for t in meta.saves for n in self.entry_names(t)]
        rows = self._gather([b for t in meta.saves for b in t.block_ids])
        try:
            results = self.kv.batch_put(names, list(rows))
        except (OSError, ValueError) as e:
            logger.error("kvfs save of %d blocks failed: %s", len(names), e)
            return
        failed = [(n, r) for n, r in zip(names, results) if r < 0]
        if failed:
            logger.error("kvfs save failed for %d of %d blocks, first %s: %s", len(failed), len(names),
                         failed[0][0], errno.errorcode.get(-failed[0][1], failed[0][1]))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.kv.close()
