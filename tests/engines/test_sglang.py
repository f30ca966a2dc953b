"""The SGLang HiCache storage backend against SGLang's real backend factory, storage config, page hashes and host KV
pools (MHA and MLA, built on CPU from real device pools), over a real ``kvfs up`` cluster. Runs in
``make test-engines ENGINES=sglang`` (SGLang's own venv); elsewhere it skips."""

from __future__ import annotations

import itertools
import os
import warnings

import pytest

pytest.importorskip("sglang", reason="needs SGLang (make test-engines ENGINES=sglang)")
torch = pytest.importorskip("torch", reason="needs torch (SGLang's dependency)")
warnings.filterwarnings("ignore", message="Only CUDA")

from cluster_fixtures import NEEDS_FUSE  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from kvfs.kvclient import KVClient  # noqa: E402

pytest_plugins = ["cluster_fixtures"]
pytestmark = [NEEDS_FUSE, pytest.mark.timeout(300)]

PAGE, LAYERS, TOKENS = 4, 3, 64
_ns = itertools.count()


@pytest.fixture
def ns() -> str:
    return f"sglang{next(_ns)}-{os.getpid()}"


def mha_pool(layout: str = "page_first") -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.float16, head_num=2, head_dim=8,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    return MHATokenToKVPoolHost(device._mha_buffer_info(), 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)


def mla_pool() -> MLATokenToKVPoolHost:
    device = MLATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=16,
                              qk_rope_head_dim=8, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    return MLATokenToKVPoolHost(device._mla_buffer_info(), 2.0, 0, PAGE, "page_first", pin_memory=False,
                                device="cpu", device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)


@pytest.fixture
def backend(kvfs_cluster, ns):
    """Makes backends as SGLang's cache controller does (the factory's dynamic loader, then the host pool) and
    closes them after the test."""
    made = []

    def make(pool, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, **extra):
        storage = _backend(kvfs_cluster, ns, pool, tp_rank=tp_rank, tp_size=tp_size, mla=mla, **extra)
        made.append(storage)
        return storage
    yield make
    for storage in made:
        storage.close()


def _backend(cluster, ns: str, pool, *, tp_rank: int, tp_size: int, mla: bool, **extra):
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True, model_name="org/tiny-model",
        extra_config={"backend_name": "kvfs", "module_path": "kvfs.kvclient.adapters.sglang",
                      "class_name": "KvfsHiCacheStorage", "interface_v1": 1,
                      "config": str(cluster.data / "client.toml"), "namespace": ns, **extra})
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage


def fill(pool, indices: torch.Tensor, seed: int) -> None:
    """Random bytes in every page of ``indices``, through the pool's own page accessors."""
    g = torch.Generator().manual_seed(seed)
    for i in range(0, len(indices), PAGE):
        page = pool.get_dummy_flat_data_page()
        page.view(torch.uint8).copy_(torch.randint(0, 256, (page.numel() * page.element_size(),), generator=g,
                                                   dtype=torch.uint8))
        pool.set_from_flat_data_page(int(indices[i]), page)


def pages(pool, indices: torch.Tensor) -> list[bytes]:
    return [pool.get_data_page(int(indices[i]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(0, len(indices), PAGE)]


TOKENS_IDS = list(range(100, 100 + 4 * PAGE))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head", "layer_first"])
def test_mha_pages_round_trip_through_the_host_pool(backend, layout) -> None:
    pool = mha_pool(layout)
    storage = backend(pool)
    keys = get_hash_str(TOKENS_IDS, None, page_size=PAGE)
    src, dst = torch.arange(0, 4 * PAGE), torch.arange(8 * PAGE, 12 * PAGE)
    fill(pool, src, 1)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert storage.batch_exists(keys, info) == 0
    assert storage.batch_set_v1(keys[:3], src[:3 * PAGE], info) == [True] * 3
    assert storage.batch_exists(keys, info) == 3 and storage.exists(keys[0]) and not storage.exists(keys[3])
    assert storage.batch_get_v1(keys, dst, info) == [True, True, True, False]
    assert pages(pool, dst)[:3] == pages(pool, src)[:3]


def test_another_layout_or_dtype_misses_rather_than_reads_garbage(backend) -> None:
    """page_first and page_first_direct pages have the same sizes but another byte order: the geometry tag in
    the entry names keeps them apart, as it does pools of another dtype."""
    pool = mha_pool("page_first")
    storage = backend(pool)
    keys = get_hash_str(TOKENS_IDS, None, page_size=PAGE)[:2]
    fill(pool, torch.arange(0, 2 * PAGE), 5)
    assert storage.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
    other = backend(mha_pool("page_first_direct"))
    assert other.batch_exists(keys) == 0
    assert other.batch_get_v1(keys, torch.arange(0, 2 * PAGE)) == [False, False]
    assert backend(mla_pool(), mla=True).batch_exists(keys) == 0


def test_entries_carry_the_tp_rank_and_ranks_do_not_share(backend, kvfs_cluster, ns) -> None:
    pool = mha_pool()
    rank0 = backend(pool, tp_rank=0, tp_size=2)
    rank1 = backend(pool, tp_rank=1, tp_size=2)
    keys = get_hash_str(TOKENS_IDS, None, page_size=PAGE)[:2]
    fill(pool, torch.arange(0, 2 * PAGE), 2)
    assert rank0.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
    assert rank1.batch_exists(keys) == 0
    names = sorted(p.name for p in (kvfs_cluster.mount / "kvcache" / ns).iterdir())
    assert len(names) == 4 and all("-tp0of2-" in n for n in names)  # K and V of two pages


def test_mla_is_written_by_rank_zero_and_read_by_every_rank(backend, kvfs_cluster, ns) -> None:
    pool = mla_pool()
    rank0 = backend(pool, tp_rank=0, tp_size=2, mla=True)
    rank1 = backend(pool, tp_rank=1, tp_size=2, mla=True)
    keys = get_hash_str(TOKENS_IDS, None, page_size=PAGE)[:2]
    src, dst = torch.arange(0, 2 * PAGE), torch.arange(4 * PAGE, 6 * PAGE)
    fill(pool, src, 3)
    assert rank1.batch_set_v1(keys, src) == [True, True]  # not the writer: nothing written
    assert rank0.batch_exists(keys) == 0
    assert rank0.batch_set_v1(keys, src) == [True, True]
    assert len(list((kvfs_cluster.mount / "kvcache" / ns).iterdir())) == 2  # one entry per page, no rank
    assert rank1.batch_exists(keys) == 2
    assert rank1.batch_get_v1(keys, dst) == [True, True]
    assert pages(pool, dst) == pages(pool, src)


def test_wrong_sized_entries_fail_their_page_and_stay_intact(backend, kvfs_cluster, ns) -> None:
    """An entry longer or shorter than the page's buffer is a failed page (HiCache stops there); the stored
    bytes are not touched, nor is a repeated put of an existing page rewritten."""
    pool = mha_pool()
    storage = backend(pool)
    keys = get_hash_str(TOKENS_IDS, None, page_size=PAGE)[:3]
    fill(pool, torch.arange(0, 3 * PAGE), 4)
    assert storage.batch_set_v1(keys[:1], torch.arange(0, PAGE)) == [True]
    long_name, short_name = storage._entries(keys[1:2])[0], storage._entries(keys[2:3])[1]
    with KVClient.from_config(kvfs_cluster.data / "client.toml", ns) as kv:
        kv.put(long_name, b"x" * 10_000)
        kv.put(short_name, b"y" * 3)
        assert storage.batch_set_v1(keys, torch.arange(0, 3 * PAGE)) == [True] * 3
        assert storage.batch_get_v1(keys, torch.arange(8 * PAGE, 11 * PAGE)) == [True, False, False]
        assert kv.get(long_name) == b"x" * 10_000 and kv.get(short_name) == b"y" * 3


@pytest.mark.parametrize(("extra", "message"), [
    ({"namespace": ""}, "namespace"),
    ({"interface_v1": 0}, "interface_v1"),
])
def test_bad_config_is_a_clear_error(backend, extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        backend(mha_pool(), **extra)
