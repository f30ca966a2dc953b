"""The vLLM KV connector against vLLM's real connector factory, configs, requests, block lists and CPU paged KV
cache, and end to end: vLLM engines on CPU serving a tiny model made on the spot, over a real ``kvfs up``
cluster. Runs in ``make test-engines ENGINES=vllm`` (vLLM's own venv); elsewhere it skips."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (make test-engines ENGINES=vllm)")
torch = pytest.importorskip("torch", reason="needs torch (vLLM's dependency)")

from cluster_fixtures import NEEDS_FUSE  # noqa: E402

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
