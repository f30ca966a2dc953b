"""The LMCache remote-storage plugin against LMCache's real plugin loader, config, metadata and CPU allocator,
over a real ``kvfs up`` cluster. Runs in ``make test-engines`` (LMCache's own venv); elsewhere it skips."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading

import pytest

pytest.importorskip("lmcache", reason="needs LMCache (pip install lmcache; make test-engines)")
torch = pytest.importorskip("torch", reason="needs torch (LMCache's dependency)")

from cluster_fixtures import NEEDS_FUSE  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402

from kvfs.kvclient import KVClient  # noqa: E402
from kvfs.kvclient.adapters.lmcache import entry_name  # noqa: E402

pytest_plugins = ["cluster_fixtures"]
pytestmark = [NEEDS_FUSE, pytest.mark.timeout(300)]

CHUNK = 16
KV_SHAPE = (2, 2, CHUNK, 2, 8)  # layers, K/V, tokens per chunk, heads, head size
_ns = itertools.count()


@pytest.fixture
def ns() -> str:
    return f"lmcache{next(_ns)}-{os.getpid()}"


@pytest.fixture
def loop():
    """LMCache's connectors run their coroutines on an event loop in a thread of their own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def engine(kvfs_cluster, ns, loop):
    """The connector as LMCache builds it: its plugin loader, from the documented config keys."""
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, remote_storage_plugins=["kvfs"],
        extra_config={
            "remote_storage_plugin.kvfs.module_path": "kvfs.kvclient.adapters.lmcache",
            "remote_storage_plugin.kvfs.class_name": "KvfsConnector",
            "remote_storage_plugin.kvfs.config": str(kvfs_cluster.data / "client.toml"),
            "remote_storage_plugin.kvfs.namespace": ns,
        })
    metadata = LMCacheMetadata(model_name="org/tiny-model", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float16, kv_shape=KV_SHAPE, chunk_size=CHUNK)
    backend = LocalCPUBackend(config, metadata)
    connector = CreateConnector("plugin://kvfs", loop, backend, config, metadata)
    yield connector, backend, metadata
    asyncio.run_coroutine_threadsafe(connector.close(), loop).result(30)


def run(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(60)


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("org/tiny-model", 1, 0, 0x1000 + i, torch.float16)


def chunk(backend, metadata, seed: int, tokens: int = CHUNK):
    """A memory object from LMCache's allocator holding ``tokens`` tokens of random KV."""
    shapes = [torch.Size([*shape[:2], tokens, *shape[3:]]) for shape in metadata.get_shapes()]
    obj = backend.allocate(shapes, metadata.get_dtypes(), None)
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed)).half())
    return obj


def test_put_contains_get_into_lmcache_memory(engine, loop, kvfs_cluster, ns) -> None:
    connector, backend, metadata = engine
    objs = [chunk(backend, metadata, i) for i in range(3)]
    keys = [key(i) for i in range(3)]
    want = [bytes(o.byte_array) for o in objs]  # LMCache's wrapper releases each object once it is put
    run(loop, connector.batched_put(keys[:2], objs[:2]))
    run(loop, connector.put(keys[2], objs[2]))
    assert (kvfs_cluster.mount / "kvcache" / ns / entry_name(keys[0])).stat().st_size == len(want[0])
    assert run(loop, connector.exists(keys[1])) and not run(loop, connector.exists(key(99)))
    assert connector.exists_sync(keys[2])
    assert run(loop, connector.batched_async_contains("l1", [*keys, key(99), keys[0]])) == 3

    got = run(loop, connector.get(keys[1]))
    assert got is not None and bytes(got.byte_array) == want[1]
    assert got.tensor.shape == torch.Size(KV_SHAPE[:2] + (CHUNK, KV_SHAPE[3] * KV_SHAPE[4]))
    many = run(loop, connector.batched_get([keys[0], key(99), keys[2]]))
    assert many[1] is None
    assert [bytes(m.byte_array) for m in (many[0], many[2])] == [want[0], want[2]]
    prefix = run(loop, connector.batched_get_non_blocking("l2", [keys[0], key(99), keys[2]]))
    assert len(prefix) == 1 and bytes(prefix[0].byte_array) == want[0]
    for o in [got, *many, *prefix]:
        if o is not None:
            o.ref_count_down()


def test_partial_chunk_comes_back_with_its_token_count(engine, loop) -> None:
    connector, backend, metadata = engine
    partial = chunk(backend, metadata, 7, tokens=5)
    want = bytes(partial.byte_array)
    run(loop, connector.put(key(5), partial))
    got = run(loop, connector.get(key(5)))
    assert got is not None and got.tensor.shape[2] == 5
    assert bytes(got.byte_array) == want
    got.ref_count_down()


def test_objects_that_are_no_chunk_are_misses_and_stay_intact(engine, loop, kvfs_cluster, ns) -> None:
    """Too large for LMCache's buffer, or no whole number of tokens: None (LMCache's miss), never an exception;
    the stored bytes are untouched."""
    connector, backend, metadata = engine
    full = len(chunk(backend, metadata, 0).byte_array)
    with KVClient.from_config(kvfs_cluster.data / "client.toml", ns) as kv:
        kv.put(entry_name(key(20)), b"x" * (full + 1))
        kv.put(entry_name(key(21)), b"y" * 3)
        assert run(loop, connector.get(key(20))) is None
        assert run(loop, connector.batched_get([key(21), key(22)])) == [None, None]
        assert kv.get(entry_name(key(20))) == b"x" * (full + 1) and kv.get(entry_name(key(21))) == b"y" * 3


def test_long_and_slashed_keys() -> None:
    short = CacheEngineKey("a/b%c", 1, 0, 1, torch.float16)
    assert "/" not in entry_name(short) and entry_name(short).startswith("a%2Fb%25c@")
    long = CacheEngineKey("m" * 300, 1, 0, 1, torch.float16)
    assert len(entry_name(long)) <= 255 and entry_name(long) != entry_name(short)


@pytest.mark.parametrize(("settings", "message"), [
    ({}, "remote_storage_plugin.kvfs.config"),
    ({"use_layerwise": True, "extra_config": {"remote_storage_plugin.kvfs.config": "c.toml",
                                              "remote_storage_plugin.kvfs.namespace": "n"}}, "use_layerwise"),
])
def test_bad_config_is_a_clear_error(loop, settings, message) -> None:
    from kvfs.kvclient.adapters.lmcache import KvfsConnector
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, **settings)
    metadata = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.float16, kv_shape=KV_SHAPE, chunk_size=CHUNK)
    with pytest.raises(ValueError, match=message):
        KvfsConnector(loop, LocalCPUBackend(config, metadata), config)
