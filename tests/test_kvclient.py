"""kvclient against a real cluster (``kvfs up``) and its mount: API, write-once semantics, bad input."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import itertools
import os
import random
import threading
import time

import pytest
import trio

from cluster_fixtures import NEEDS_FUSE
from kvfs.errors import KvfsError
from kvfs.kvclient import AsyncKVClient, BufferTooSmall, ClientClosed, InvalidKey, KVClient
from kvfs.kvclient import client as kvclient_module

pytest_plugins = ["cluster_fixtures"]
pytestmark = [NEEDS_FUSE, pytest.mark.timeout(300)]

_ns = itertools.count()
MIB = 1 << 20


@pytest.fixture
def ns(request) -> str:
    return f"t{next(_ns)}-{os.getpid()}-" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]


@pytest.fixture
def kv(kvfs_cluster, ns):
    with KVClient.from_config(kvfs_cluster.data / "client.toml", ns) as client:
        yield client


def _payload(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.mark.parametrize("size", [0, 1, MIB, 4 * MIB + 12345])
def test_round_trip_and_visible_on_the_mount(kvfs_cluster, kv, ns, size) -> None:
    data = _payload(size)
    kv.put("k", data)
    assert kv.get("k") == data
    out = bytearray(size + 7)
    assert kv.get_into("k", out) == size
    assert bytes(out[:size]) == data
    path = kvfs_cluster.mount / "kvcache" / ns / "k"
    assert path.read_bytes() == data
    assert sorted(os.listdir(path.parent)) == ["k"]  # no temp file left behind


def test_numpy_registered_buffer_and_too_small(kv) -> None:
    np = pytest.importorskip("numpy")
    arr = np.arange(1000, dtype=np.float32)
    kv.put(b"np", arr)
    back = np.empty_like(arr)
    assert kv.get_into("np", back) == arr.nbytes
    assert np.array_equal(arr, back)
    raw = (ctypes.c_char * arr.nbytes)()
    reg = kv.register_buffer(ctypes.addressof(raw), arr.nbytes)
    assert kv.get_into("np", reg) == arr.nbytes and bytes(raw) == arr.tobytes()
    kv.put("raw", reg)
    assert kv.get("raw") == arr.tobytes()
    with pytest.raises(BufferTooSmall) as e:
        kv.get_into("np", bytearray(10))
    assert e.value.errno == errno.EMSGSIZE
    with pytest.raises(TypeError):
        kv.get_into("np", b"\0" * 8000)  # read-only
    with pytest.raises(ValueError):
        kv.register_buffer(1234, 10, device="tpu")


def test_batches_prefix_hits_remove(kv) -> None:
    vals = [_payload(100 * i + 1, i) for i in range(5)]
    assert kv.batch_put(["a", "b", "c", "d", "e"], vals) == [0] * 5
    assert kv.batch_exists(["a", "x", "c"]) == [True, False, True]
    assert kv.prefix_hits(["a", "b", "c", "x", "d"]) == 3
    assert kv.prefix_hits(["x", "a"]) == 0
    outs = [bytearray(1000) for _ in range(4)]
    outs[3] = bytearray(5)
    assert kv.batch_get_into(["a", "zz", "c", "e"], outs) == [1, -errno.ENOENT, 201, -errno.EMSGSIZE]
    assert bytes(outs[0][:1]) == vals[0] and bytes(outs[2][:201]) == vals[2]
    assert kv.remove("a") == 0 and kv.remove("a") == -errno.ENOENT
    assert kv.get("a") is None and kv.get_into("a", bytearray(5)) == -errno.ENOENT
    assert kv.batch_remove(["b", "nope", "c"]) == [0, -errno.ENOENT, 0]
    assert kv.prefix_hits(["d", "e"]) == 2


def test_put_is_write_once(kv, kvfs_cluster, ns) -> None:
    kv.put("once", b"first")
    kv.put("once", b"second value")  # succeeds without rewriting
    assert kv.get("once") == b"first"
    assert kv.batch_put(["once"], [b"third"]) == [0]
    assert kv.get("once") == b"first"


def test_concurrent_puts_of_one_key(kv, kvfs_cluster, ns) -> None:
    a, b = _payload(5 * MIB, 1), _payload(5 * MIB, 2)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def put(v: bytes) -> None:
        try:
            barrier.wait()
            kv.put("race", v)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(v,)) for v in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = kv.get("race")
    assert got in (a, b)
    assert (kvfs_cluster.mount / "kvcache" / ns / "race").read_bytes() == got
    assert sorted(os.listdir(kvfs_cluster.mount / "kvcache" / ns)) == ["race"]


@pytest.mark.parametrize("key,code", [("", errno.EINVAL), ("a/b", errno.EINVAL), ("a\0b", errno.EINVAL),
                                      ("x" * 256, errno.ENAMETOOLONG), ("é" * 128, errno.ENAMETOOLONG),
                                      ("..", errno.EINVAL)])
def test_bad_keys_change_nothing(kv, kvfs_cluster, ns, key, code) -> None:
    kv.put("good", b"1")
    for call in (lambda: kv.put(key, b"v"), lambda: kv.get(key), lambda: kv.get_into(key, bytearray(4)),
                 lambda: kv.batch_put(["ok2", key], [b"v", b"v"]), lambda: kv.batch_exists([key]),
                 lambda: kv.remove(key)):
        with pytest.raises(InvalidKey) as e:
            call()
        assert e.value.errno == code
    assert sorted(os.listdir(kvfs_cluster.mount / "kvcache" / ns)) == ["good"]


def test_bad_values(kv) -> None:
    with pytest.raises(TypeError):
        kv.put("k", 12345)
    with pytest.raises(TypeError):
        kv.put("k", memoryview(bytearray(10))[::2])  # not contiguous
    with pytest.raises(ValueError):
        kv.batch_put(["a", "b"], [b"x"])
    assert kv.batch_exists(["k", "a"]) == [False, False]


def test_closed_client(kvfs_cluster, ns) -> None:
    kv = KVClient.from_config(kvfs_cluster.data / "client.toml", ns)
    kv.put("k", b"v")
    kv.close()
    kv.close()  # idempotent
    for call in (lambda: kv.put("k", b"v"), lambda: kv.get("k"), lambda: kv.batch_exists(["k"])):
        with pytest.raises(ClientClosed) as e:
            call()
        assert isinstance(e.value, KvfsError) and e.value.errno == errno.EBADF
    assert kv.capabilities()["gpu"] is False and kv.capabilities()["short_circuit"] is False


def test_asyncio_variant(kvfs_cluster, ns) -> None:
    async def main() -> None:
        async with AsyncKVClient.from_config(kvfs_cluster.data / "client.toml", ns) as akv:
            await akv.batch_put(["p", "q"], [b"pp", b"qqq"])
            assert await akv.get("p") == b"pp"
            out = bytearray(3)
            assert await akv.get_into("q", out) == 3 and out == b"qqq"
            assert await asyncio.gather(akv.batch_exists(["p", "z"]), akv.prefix_hits(["p", "q", "z"])) \
                == [[True, False], 2]
            assert await akv.remove("p") == 0

    asyncio.run(main())


def test_metrics(kv) -> None:
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = [value(n) for n in ("kvfs_kvclient_hits_total", "kvfs_kvclient_misses_total",
                                 "kvfs_kvclient_read_bytes_total", "kvfs_kvclient_written_bytes_total")]
    batches = value("kvfs_kvclient_batch_seconds_count", op="get")
    kv.put("m", b"12345")
    kv.put("m", b"12345")  # not rewritten, not counted
    assert kv.batch_get_into(["m", "absent"], [bytearray(8), bytearray(8)]) == [5, -errno.ENOENT]
    after = [value(n) for n in ("kvfs_kvclient_hits_total", "kvfs_kvclient_misses_total",
                                "kvfs_kvclient_read_bytes_total", "kvfs_kvclient_written_bytes_total")]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 5, 5]
    assert value("kvfs_kvclient_batch_seconds_count", op="get") == batches + 1


def test_many_threads_share_one_client(kv) -> None:
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(5):
                value = _payload(1000 + i, t * 100 + i)
                kv.put(f"t{t}-{i}", value)
                assert kv.get(f"t{t}-{i}") == value
                kv.put(f"shared-{i}", b"x" * (i + 1))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [kv.get(f"shared-{i}") for i in range(5)] == [b"x" * (i + 1) for i in range(5)]


def test_entries_are_files_on_the_mount(kv, kvfs_cluster, ns) -> None:
    kv.batch_put(["a", "b"], [b"A", b"BB"])
    d = kvfs_cluster.mount / "kvcache" / ns
    assert {p.name: p.stat().st_size for p in d.iterdir()} == {"a": 1, "b": 2}
    (d / "a").unlink()  # rm on the mount is a remove for the client
    assert kv.batch_exists(["a", "b"]) == [False, True]


def test_bad_config(tmp_path) -> None:
    with pytest.raises(KvfsError):
        KVClient.from_config(tmp_path / "missing.toml", "ns")
    (tmp_path / "empty.toml").write_text("")
    with pytest.raises(KvfsError):
        KVClient.from_config(tmp_path / "empty.toml", "ns")


def test_a_put_that_loses_the_commit_race_keeps_the_winner(kv, kvfs_cluster, ns, monkeypatch) -> None:
    """Another client commits the key between this put's begin and commit: the commit's EEXIST is success, the
    winner's value stays and this put's temporary file goes."""
    real_commit = kv._core.meta.commit_puts

    def rival_put() -> None:
        with KVClient.from_config(kvfs_cluster.data / "client.toml", ns) as rival:
            rival.put("won", b"winner")

    async def commit_after_a_rival(caller, parent, commits):
        await trio.to_thread.run_sync(rival_put)
        return await real_commit(caller, parent, commits)

    monkeypatch.setattr(kv._core.meta, "commit_puts", commit_after_a_rival)
    kv.put("won", b"loser, longer than the winner")
    monkeypatch.undo()
    assert kv.get("won") == b"winner"
    assert sorted(os.listdir(kvfs_cluster.mount / "kvcache" / ns)) == ["won"]


def test_one_metadata_round_trip_per_batch(kv, monkeypatch) -> None:
    """Counted at the client's RPC to meta: a batch of any size (here over MAX_BATCH keys for puts: two parts)
    costs one round trip for exists, prefix hits, gets and removes, and two per part for puts."""
    from kvfs.meta.api import MAX_BATCH

    kv.put("warm", b"x")  # the namespace directory exists and is known
    sent: list[str] = []
    real_call = kv._core.meta._call

    async def counting(method, request):
        if method.name not in ("meta.renew_client", "meta.touch_atimes"):  # background: lease, access times
            sent.append(method.name)
        return await real_call(method, request)

    monkeypatch.setattr(kv._core.meta, "_call", counting)

    def count(fn, *args):
        sent.clear()
        result = fn(*args)
        return result, list(sent)

    keys = [f"k{i}" for i in range(40)]
    values = [_payload(1000 + i, i) for i in range(40)]
    monkeypatch.setattr(kvclient_module, "FOUND_FOR", 60.0)  # a slow machine must not outlast it below
    assert count(kv.batch_put, keys, values) == ([0] * 40, ["meta.begin_puts", "meta.commit_puts"])
    assert count(kv.batch_exists, keys + ["nope"]) == ([True] * 40 + [False], ["meta.batch_lookup"])
    assert count(kv.prefix_hits, keys[:10] + ["nope"] + keys[10:]) == (10, ["meta.batch_lookup"])
    outs = [bytearray(2000) for _ in keys]
    # the exists calls just before answered for the gets that follow (FOUND_FOR)
    assert count(kv.batch_get_into, keys, outs) == ([1000 + i for i in range(40)], [])
    assert all(bytes(o[:1000 + i]) == values[i] for i, o in enumerate(outs))
    assert count(kv.get, "k5") == (values[5], [])
    monkeypatch.setattr(kvclient_module, "FOUND_FOR", 0.0)
    assert count(kv.batch_exists, keys) == ([True] * 40, ["meta.batch_lookup"])
    outs = [bytearray(2000) for _ in keys]
    assert count(kv.batch_get_into, keys, outs) == ([1000 + i for i in range(40)], ["meta.batch_lookup"])
    assert all(bytes(o[:1000 + i]) == values[i] for i, o in enumerate(outs))
    assert count(kv.get, "k3") == (values[3], ["meta.batch_lookup"])  # a single get: one as well
    assert count(kv.get_into, "k4", outs[0]) == (1004, ["meta.batch_lookup"])
    assert count(kv.batch_put, keys, values) == ([0] * 40, ["meta.begin_puts"])  # all exist: nothing to commit
    many = [f"m{i}" for i in range(MAX_BATCH + 1)]
    assert count(kv.batch_put, many, [b"v"] * len(many))[1] == ["meta.begin_puts"] * 2 + ["meta.commit_puts"] * 2
    assert count(kv.batch_remove, keys + ["nope"]) == ([0] * 40 + [-errno.ENOENT], ["meta.batch_unlink"])



def _wait_collected(kv: KVClient, found) -> None:
    """Until meta's collector has removed the chunks of the file ``found`` names (a round every ``gc_interval``,
    5 s; a busy machine may need a second one)."""

    async def chunk_bytes() -> int:
        return await kv._core.storage.read(found.attr.ino, found.layout, 0, memoryview(bytearray(found.attr.size)))

    deadline = time.monotonic() + 30
    while kv._call(chunk_bytes):
        if time.monotonic() > deadline:
            pytest.fail("the removed value's chunks were not collected within 30 s")
        time.sleep(0.05)


def test_a_kept_exists_answer_that_went_stale_is_looked_up_again(kvfs_cluster, kv, ns, monkeypatch) -> None:
    """A get uses what an exists call found just before; where another client removed the key and put it again
    meanwhile, and the old value's chunks are gone, the get looks the key up again and reads the new value
    (``get`` too, into a buffer of the new value's size). The client's own removal forgets the kept answer at
    once."""
    monkeypatch.setattr(kvclient_module, "FOUND_FOR", 60.0)  # outlasts the wait for the collector below
    old, new = _payload(3000, 1), _payload(3000, 2)
    kv.put("k", old)
    kv.put("k2", old[:1000])
    assert kv.batch_exists(["k", "k2"]) == [True, True]
    found = [kv._core._found[key][0] for key in (b"k", b"k2")]
    with KVClient.from_config(kvfs_cluster.data / "client.toml", ns) as other:
        assert other.batch_remove(["k", "k2"]) == [0, 0]
        other.put("k", new)
        other.put("k2", new[:2000])

    for f in found:
        _wait_collected(kv, f)
    out = bytearray(3000)
    assert kv.batch_get_into(["k"], [out]) == [3000] and bytes(out) == new
    assert kv.get("k2") == new[:2000]
    assert kv.batch_exists(["k"]) == [True] and kv.remove("k") == 0
    assert kv.batch_get_into(["k"], [out]) == [-errno.ENOENT]


def test_a_get_racing_a_removal_says_enoent(kvfs_cluster, kv, ns, monkeypatch) -> None:
    """The file a get found is removed, and its chunks collected, before the get reads them: the get answers
    -ENOENT (the key is gone; None from ``get``), not the chunk servers' error. The lookup is made to happen
    first by an exists call whose answer the get uses."""
    monkeypatch.setattr(kvclient_module, "FOUND_FOR", 60.0)
    kv.put("k", _payload(3000, 1))
    kv.put("k2", _payload(2000, 3))
    kv.put("stays", _payload(100, 2))
    assert kv.batch_exists(["k", "k2", "stays"]) == [True, True, True]
    found = [kv._core._found[key][0] for key in (b"k", b"k2")]
    with KVClient.from_config(kvfs_cluster.data / "client.toml", ns) as other:
        assert other.batch_remove(["k", "k2"]) == [0, 0]
    for f in found:
        _wait_collected(kv, f)
    outs = [bytearray(3000), bytearray(100)]
    assert kv.batch_get_into(["k", "stays"], outs) == [-errno.ENOENT, 100]
    assert bytes(outs[1]) == _payload(100, 2)
    assert kv.get("k2") is None
