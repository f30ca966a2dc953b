"""The vLLM KV connector against vLLM's real connector factory, configs, requests, block lists and CPU paged KV
cache, and end to end: vLLM engines on CPU serving a tiny model made on the spot, over a real ``kvfs up``
cluster. Runs in ``make test-engines ENGINES=vllm`` (vLLM's own venv); elsewhere it skips."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (make test-engines ENGINES=vllm)")
torch = pytest.importorskip("torch", reason="needs torch (vLLM's dependency)")

from cluster_fixtures import NEEDS_FUSE  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_kv_cache_configs  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvfs.kvclient import KVClient  # noqa: E402

pytest_plugins = ["cluster_fixtures"]
pytestmark = [NEEDS_FUSE, pytest.mark.timeout(600)]

ENGINE = Path(__file__).with_name("vllm_engine.py")
WORDS = ("the quick brown fox jumps over a lazy dog while seven small cats sleep under warm red blankets and one "
         "old owl counts bright stars above quiet green hills near the cold blue river").split()
BLOCK = 32  # the engine's block size (vLLM's CPU attention takes multiples of 32)
_ns = itertools.count()


@pytest.fixture
def ns() -> str:
    return f"vllm{next(_ns)}-{os.getpid()}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A Llama of two layers with random weights and a word-level tokenizer trained here on WORDS: nothing is
    downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=fast.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def words(start: int, n: int) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def engine(model: Path, prompts: list[str], cluster=None, namespace: str | None = None) -> list[dict]:
    """Runs one engine process to its end; its results per prompt."""
    cmd = [sys.executable, str(ENGINE), "--model", str(model)] + [a for p in prompts for a in ("--prompt", p)]
    if cluster is not None:
        cmd += ["--kvfs-config", str(cluster.data / "client.toml"), "--namespace", namespace]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    results = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(prompts), done.stderr[-3000:]
    return results


def test_a_second_engine_loads_the_shared_prefix_from_kvfs(tiny_model, kvfs_cluster, ns) -> None:
    """The issue's end-to-end run: engine one serves prompt A and saves its blocks; engine two, a new process,
    serves prompt B (A's first 80 words, then others): the connector reports A's whole blocks in B's prefix as
    external hits, and B's greedy output equals that of an engine with no cache at all."""
    prompt_a, prompt_b = words(0, 100), words(0, 80) + " " + words(7, 30)
    (first,) = engine(tiny_model, [prompt_a], kvfs_cluster, ns)
    assert first["cached_tokens"] == 0
    stored = sorted(p.name for p in (kvfs_cluster.mount / "kvcache" / ns).iterdir())
    assert len(stored) == (first["prompt_tokens"] - 1) // BLOCK, stored
    (second,) = engine(tiny_model, [prompt_b], kvfs_cluster, ns)
    (plain,) = engine(tiny_model, [prompt_b])
    assert second["cached_tokens"] == 80 // BLOCK * BLOCK
    assert second["output"] == plain["output"]


# ------------------------------------------------------------------ the connector's two sides, in this process
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
ENTRY = len(LAYERS) * SPEC.page_size_bytes  # one block of every layer


def vllm_config(model: Path, cluster, namespace: str, role: str = "kv_both") -> VllmConfig:
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvfsKVConnector", kv_connector_module_path="kvfs.kvclient.adapters.vllm", kv_role=role,
            kv_connector_extra_config={"config": str(cluster.data / "client.toml"), "namespace": namespace}))
    config.cache_config.kv_cache_layout = KVCacheLayout.LBHNC.name  # as the engine core resolves it on CPU
    return config


@pytest.fixture(scope="module")
def model_parallel(tiny_model):
    """vLLM's process groups for one rank (gloo on loopback), which the worker side asks its ranks of."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=str(tiny_model), dtype="float32"))):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
        parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


class Engine:
    """A scheduler-side and a worker-side connector made by vLLM's factory from one config, as an engine core
    and its worker make them, and the worker's paged KV cache in the CPU attention backend's layout."""

    def __init__(self, config: VllmConfig) -> None:
        (self.kv_cache_config,) = get_kv_cache_configs(config, [dict.fromkeys(LAYERS, SPEC)], [32 * ENTRY])
        self.scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC, [BLOCK])
        self.worker.register_kv_caches(self.caches)

    def schedule(self, request: Request, block_ids: list[int], local_tokens: int = 0) -> tuple[int, object]:
        """One scheduling step of a new request, its whole prompt at once, then the worker's step: the external
        tokens the scheduler side found and the metadata the worker ran."""
        external, is_async = self.scheduler.get_num_new_matched_tokens(request, local_tokens)
        assert not is_async
        blocks = KVCacheBlocks(([KVCacheBlock(b) for b in block_ids],))
        self.scheduler.update_state_after_alloc(request, blocks, external)
        computed = local_tokens + external
        new = NewRequestData.from_request(request, (block_ids,))
        new.num_computed_tokens = computed
        meta = self.step(request.request_id, request.num_prompt_tokens - computed, new=new)
        return external, meta

    def step(self, req_id: str, tokens: int, *, new: NewRequestData | None = None,
             cached: CachedRequestData | None = None) -> object:
        """One step's metadata from the scheduler side, run by the worker side."""
        output = SchedulerOutput(
            scheduled_new_reqs=[new] if new is not None else [],
            scheduled_cached_reqs=cached or CachedRequestData.make_empty(), num_scheduled_tokens={req_id: tokens},
            total_num_scheduled_tokens=tokens, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[])
        meta = self.scheduler.build_connector_meta(output)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        return meta

    def block(self, block_id: int) -> list[torch.Tensor]:
        return [self.caches[name][block_id].clone() for name in LAYERS]

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


@pytest.fixture
def engines(tiny_model, kvfs_cluster, ns, model_parallel):
    made: list[Engine] = []

    def make(namespace: str = ns, role: str = "kv_both") -> Engine:
        made.append(Engine(vllm_config(tiny_model, kvfs_cluster, namespace, role)))
        return made[-1]
    yield make
    for engine_ in made:
        engine_.close()


def request(req_id: str, tokens: list[int], **kw) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, **kw)


PROMPT = [3 + i % 30 for i in range(100)]


def test_blocks_saved_by_one_engine_load_into_another(engines, kvfs_cluster, ns) -> None:
    """Engine one saves the three full blocks of a 100-token prompt (not the last token's block); engine two,
    for a prompt sharing 80 tokens, is told of two blocks (64 tokens), loads them into the blocks vLLM gave it,
    byte for byte, and saves only the blocks kvfs lacks."""
    one, two = engines(), engines()
    for view in one.caches.values():
        view.copy_(torch.randn(view.shape))
    external, meta = one.schedule(request("a", PROMPT), [4, 9, 2, 7])
    assert external == 0 and not meta.loads and [len(s.block_ids) for s in meta.saves] == [3]
    entries = sorted((kvfs_cluster.mount / "kvcache" / ns).iterdir())
    assert len(entries) == 3 and all(e.stat().st_size == ENTRY for e in entries)

    other = PROMPT[:80] + [33] * 20
    external, meta = two.schedule(request("b", other), [11, 12, 13, 14])
    assert external == 64
    assert [t.block_ids for t in meta.loads] == [[11, 12]] and [t.block_ids for t in meta.saves] == [[13]]
    for mine, theirs in [(11, 4), (12, 9)]:
        assert all(torch.equal(a, b) for a, b in zip(two.block(mine), one.block(theirs)))
    assert not two.worker.get_block_ids_with_load_errors()
    assert len(list((kvfs_cluster.mount / "kvcache" / ns).iterdir())) == 4


def test_a_chunked_prefill_saves_each_block_once_it_is_complete(engines) -> None:
    """A prompt computed over two steps, its second step's blocks appended as vLLM's cached-request data gives
    them: each block is saved in the step that completes it."""
    one = engines()
    prompt = request("a", PROMPT)
    assert one.scheduler.get_num_new_matched_tokens(prompt, 0) == (0, False)
    one.scheduler.update_state_after_alloc(prompt, KVCacheBlocks(([KVCacheBlock(5), KVCacheBlock(6)],)), 0)
    meta = one.step("a", 40, new=NewRequestData.from_request(prompt, ([5, 6],)))
    assert [t.block_ids for t in meta.saves] == [[5]]
    cached = CachedRequestData(req_ids=["a"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                               new_block_ids=[([7, 8],)], num_computed_tokens=[40], num_output_tokens=[0])
    meta = one.step("a", 60, cached=cached)
    assert [t.block_ids for t in meta.saves] == [[6, 7]]  # the block of the last prompt token is not saved


def test_local_hits_are_not_loaded_again(engines) -> None:
    one, two = engines(), engines()
    one.schedule(request("a", PROMPT), [0, 1, 2, 3])
    external, meta = two.schedule(request("b", PROMPT), [5, 6, 7, 8], local_tokens=BLOCK)
    assert external == 2 * BLOCK and [t.block_ids for t in meta.loads] == [[6, 7]] and not meta.saves


def test_salt_lora_and_geometry_keep_entries_apart(engines, tiny_model, kvfs_cluster, ns) -> None:
    """Another cache salt, or an engine of another KV geometry, misses rather than reads another's blocks."""
    one = engines()
    one.schedule(request("a", PROMPT), [0, 1, 2, 3])
    assert one.scheduler.get_num_new_matched_tokens(request("b", PROMPT, cache_salt="tenant-2"), 0) == (0, False)
    assert one.scheduler.get_num_new_matched_tokens(request("c", PROMPT), 0) == (3 * BLOCK, False)
    config = vllm_config(tiny_model, kvfs_cluster, ns)
    config.model_config.model = "another/model"
    (kv_cache_config,) = get_kv_cache_configs(config, [dict.fromkeys(LAYERS, SPEC)], [32 * ENTRY])
    stranger = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        assert stranger.get_num_new_matched_tokens(request("d", PROMPT), 0) == (0, False)
    finally:
        stranger.shutdown()


def test_a_missing_or_wrong_sized_entry_is_a_load_error_and_stays_intact(engines, kvfs_cluster, ns) -> None:
    """An entry found at lookup but gone at load, or of another size, is reported to vLLM as a load error for
    its block (vLLM then recomputes or fails it); the block is left as it was and the stored bytes untouched."""
    one, two = engines(), engines()
    _, meta = one.schedule(request("a", PROMPT), [0, 1, 2, 3])
    names = one.worker.entry_names(meta.saves[0])
    with KVClient.from_config(kvfs_cluster.data / "client.toml", ns) as kv:
        first = kv.get(names[0])
        kv.remove(names[0])
        kv.put(names[0], b"x" * 10)
        before = two.block(20)
        external, meta = two.schedule(request("b", PROMPT), [20, 21, 22, 23])
        assert external == 3 * BLOCK
        assert two.worker.get_block_ids_with_load_errors() == {20}
        assert all(torch.equal(a, b) for a, b in zip(two.block(20), before))
        assert kv.get(names[0]) == b"x" * 10 and first is not None and len(first) == ENTRY


def test_roles_decide_who_saves_and_who_loads(engines, ns) -> None:
    producer = engines(role="kv_producer")
    _, meta = producer.schedule(request("a", PROMPT), [0, 1, 2, 3])
    assert meta.saves and not meta.loads
    consumer = engines(role="kv_consumer")
    external, meta = consumer.schedule(request("b", PROMPT), [4, 5, 6, 7])
    assert external == 3 * BLOCK and meta.loads and not meta.saves
    external, meta = producer.schedule(request("c", PROMPT), [8, 9, 10, 11])
    assert external == 0 and not meta.loads  # a producer never loads, so it must not claim the tokens


@pytest.mark.parametrize("extra", [{"namespace": "x"}, {"config": "/nonexistent.toml"}])
def test_bad_config_is_a_clear_error(tiny_model, kvfs_cluster, extra) -> None:
    config = vllm_config(tiny_model, kvfs_cluster, "x")
    config.kv_transfer_config.kv_connector_extra_config = extra
    (kv_cache_config,) = get_kv_cache_configs(config, [dict.fromkeys(LAYERS, SPEC)], [32 * ENTRY])
    with pytest.raises(ValueError, match="'config'.*'namespace'"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
