"""kvclient's batch get path against real clusters (``kvfs up``): one ``chunk.locate_many`` call per chunk server
per batch, locations kept for repeated gets and dropped when the object changes, a chunk server restarted between
gets, and an object whose stored bytes are shorter than its size (ShortObject, never zeros)."""

from __future__ import annotations

import errno
import os
import random
import signal
from collections import Counter

import pytest

from cluster_fixtures import NEEDS_FUSE, started
from kvfs.chunkserver import protocol as p
from kvfs.kvclient import KVClient, ShortObject
from test_kvclient_local import local_bytes

pytest_plugins = ["cluster_fixtures"]
pytestmark = [NEEDS_FUSE, pytest.mark.timeout(300)]


@pytest.fixture
def kv(kvfs_cluster, request):
    ns = "get-" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:40] + f"-{os.getpid()}"
    with KVClient.from_config(kvfs_cluster.data / "client.toml", ns) as client:
        yield client


def _chunk_size(kv: KVClient, key: str) -> int:
    (found,) = kv._call(kv._core.lookup_many, [key.encode()])
    return found.layout.chunk_size


def _count_locates(kv: KVClient) -> Counter:
    """Counts ``chunk.locate_many`` calls per chunk server address from now on."""
    rpc, calls = kv._core.storage.rpc, Counter()
    real = rpc.call

    async def call(address, method, *args, **kw):
        if method is p.LOCATE_MANY:
            calls[address] += 1
        return await real(address, method, *args, **kw)

    rpc.call = call
    return calls


def test_a_batch_get_locates_with_one_call_per_chunk_server_and_a_repeat_asks_nothing(kv) -> None:
    kv.put("probe", b"x")
    chunk = _chunk_size(kv, "probe")
    values = [random.Random(i).randbytes(2 * chunk + 100 * i + 1) for i in range(8)]  # 3 chunks each
    keys = [f"k{i}" for i in range(8)]
    assert kv.batch_put(keys, values) == [0] * 8
    calls = _count_locates(kv)
    outs = [bytearray(len(v)) for v in values]
    before = local_bytes()
    assert kv.batch_get_into(keys, outs) == [len(v) for v in values]
    assert [bytes(o) for o in outs] == values
    assert local_bytes() - before == sum(map(len, values))  # every chunk from this host's replicas
    servers = len(set(kv._call(kv._core.storage.routing).addresses.values()))
    assert 1 <= sum(calls.values()) <= servers and max(calls.values()) == 1
    calls.clear()
    outs = [bytearray(len(v)) for v in values]
    assert kv.batch_get_into(keys, outs) == [len(v) for v in values]  # within the pins: the kept locations
    assert [bytes(o) for o in outs] == values and not calls


def test_a_kept_location_is_dropped_when_the_object_changes(kv) -> None:
    first, second = random.Random(1).randbytes(300_000), random.Random(2).randbytes(300_000)
    kv.put("k", first)
    assert kv.get("k") == first  # located and kept
    assert kv.remove("k") == 0
    kv.put("k", second)
    assert kv.get("k") == second
    out = bytearray(len(second))
    assert kv.batch_get_into(["k"], [out]) == [len(second)] and bytes(out) == second


def test_a_get_after_a_chunk_server_restart_reads_the_bytes() -> None:
    with started("kvfs-get-restart-") as cluster, KVClient.from_config(cluster.data / "client.toml", "r") as kv:
        data = random.Random(3).randbytes(3 << 20)
        kv.put("obj", data)
        assert kv.get("obj") == data
        name = "cs1"  # kvfs up names its chunk servers cs<node>
        cluster.kill(name, signal.SIGKILL)
        cluster.up()  # starts what is not running
        out = bytearray(len(data))
        assert kv.batch_get_into(["obj"], [out]) == [len(data)] and bytes(out) == data
        assert kv.get("obj") == data


@pytest.mark.parametrize("short_circuit", [True, False])
def test_an_object_shorter_than_its_size_is_an_error_not_zeros(kvfs_cluster, kv, short_circuit: bool) -> None:
    kv.put("probe", b"x")
    chunk = _chunk_size(kv, "probe")
    data = random.Random(4).randbytes(3 * chunk)
    kv.put("short", data)
    kv.put("whole", b"intact")
    core = kv._core

    async def drop_last_chunk() -> None:  # the chunk servers lose chunk 2; meta still says 3 chunks
        (found,) = await core.lookup_many([b"short"])
        await core.storage.truncate(found.attr.ino, found.layout, len(data), 2 * chunk)

    kv._call(drop_last_chunk)
    with KVClient.from_config(kvfs_cluster.data / "client.toml", kv.namespace, short_circuit=short_circuit) as c:
        with pytest.raises(ShortObject):
            c.get("short")
        with pytest.raises(ShortObject):
            c.get_into("short", bytearray(len(data)))
        whole = bytearray(6)
        assert c.batch_get_into(["short", "whole"], [bytearray(len(data)), whole]) == [-errno.EIO, 6]
        assert whole == b"intact"
