"""kvclient's read path against a real cluster (``kvfs up``): short-circuit reads of replicas on this host, their
CRC checks and fallbacks, clients the chunk servers or the target files turn away, raw and GPU buffers on CPU."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
from prometheus_client import REGISTRY

from cluster_fixtures import NEEDS_FUSE
from page_cache import resident
from kvfs.kvclient import KVClient
from kvfs.kvclient.gpu import GpuUnavailable

pytest_plugins = ["cluster_fixtures"]
pytestmark = [NEEDS_FUSE, pytest.mark.timeout(300)]

MIB = 1 << 20
GPU_MODULES = ("cupy", "torch", "kvikio", "numba")


@pytest.fixture
def kv(kvfs_cluster, request):
    ns = "local-" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:40] + f"-{os.getpid()}"
    with KVClient.from_config(kvfs_cluster.data / "client.toml", ns) as client:
        yield client


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def local_bytes() -> float:
    return metric("kvfs_kvclient_short_circuit_bytes_total")


def fallbacks(reason: str) -> float:
    return metric("kvfs_kvclient_short_circuit_fallbacks_total", reason=reason)


def test_short_circuit_read_gives_the_bytes_from_this_hosts_replica(kv) -> None:
    data = random.Random(1).randbytes(3 * MIB + 4321)  # several chunks, the last one short
    kv.put("obj", data)
    before = local_bytes()
    out = bytearray(len(data) + 100)
    assert kv.get_into("obj", out) == len(data)
    assert bytes(out[: len(data)]) == data
    assert local_bytes() - before == len(data)
    assert kv.capabilities()["short_circuit"] is True
    assert kv.get("obj") == data


def _located(kv: KVClient, key: str):
    """The location the client's reader will be given for the object's first chunk (the same replica: the first
    serving one on this host)."""
    core = kv._core

    async def locate():
        (found,) = await core.lookup_many([key.encode()])
        attr, layout = found.attr, found.layout
        return await core.storage.locate(attr.ino, layout, 0, 0, attr.size, core.reader.boot_id)

    return kv._call(locate)


def test_what_is_put_after_a_get_lands_in_the_page_cache_of_the_replica_gets_read(kv) -> None:
    """A kvclient's get tells the servers it located at that it reads back what is put; they then write whole
    versions through the page cache, so a get of a block put a moment ago reads memory, not the disk."""
    kv.put("first", random.Random(4).randbytes(256 * 1024))
    assert kv.get("first") is not None  # located with reads_back
    kv.put("fresh", random.Random(5).randbytes(256 * 1024))
    core = kv._core

    async def flush() -> None:  # held versions are written out now, as the next sync would
        (found,) = await core.lookup_many([b"fresh"])
        await core.storage.flush(found.attr.ino)

    kv._call(flush)
    loc = _located(kv, "fresh")
    assert loc is not None and all(resident(loc.path, loc.file_offset, loc.length))


def test_corrupt_block_on_disk_is_caught_and_read_over_the_network(kv) -> None:
    data = random.Random(2).randbytes(300 * 1024)
    kv.put("bad", data)
    loc = _located(kv, "bad")
    assert loc is not None and loc.length == len(data)
    with open(loc.path, "r+b") as f:  # flip one byte of the third 64 KiB block of that replica
        f.seek(loc.file_offset + 2 * 65536 + 17)
        f.write(bytes([data[2 * 65536 + 17] ^ 0xFF]))
    crc_before, local_before = fallbacks("crc"), local_bytes()
    out = bytearray(len(data))
    assert kv.get_into("bad", out) == len(data)
    assert bytes(out) == data  # another replica's bytes, or this one's repaired by its server
    assert fallbacks("crc") == crc_before + 1
    assert local_bytes() == local_before


def test_client_on_another_host_is_refused_and_reads_over_the_network(kv) -> None:
    data = random.Random(3).randbytes(MIB + 1)
    kv.put("far", data)
    kv._core.reader.boot_id = "0" * 36  # what a client on another kernel sends: the servers refuse chunk.locate
    before = local_bytes()
    assert kv.get("far") == data
    assert local_bytes() == before
    assert sorted(kv._core.storage._not_local)  # each server that refused is not asked again


def test_reads_that_are_not_short_circuit_come_through_shared_memory(kvfs_cluster, kv) -> None:
    data = random.Random(7).randbytes(2 * MIB + 3)
    kv.put("n", data)
    with KVClient.from_config(kvfs_cluster.data / "client.toml", kv.namespace, short_circuit=False) as net:
        assert net.get("n") == data
        assert net.capabilities()["short_circuit"] is False and net.capabilities()["shm_reads"] is True
        core = net._core

        async def replies() -> list[bool]:
            routing = await core.storage.routing()
            return [(await core.storage.rpc.connection(a)).links.shared_memory_replies
                    for a in sorted(set(routing.addresses.values()))]

        assert any(net._call(replies))  # the servers that answered wrote into this process's arena


_CLIENT = textwrap.dedent("""
    import hashlib, json, os, sys
    from prometheus_client import REGISTRY
    from kvfs.config import load_config
    from kvfs.kvclient import KVClient
    path, ns, key, size, uid = sys.argv[1:6]
    config = load_config(path)
    if int(uid):  # started as root (the interpreter lies under /root), from here on an ordinary user
        "".encode("idna")  # a codec the socket layer loads on first use, from the interpreter's own files
        os.setgroups([])
        os.setgid(int(uid))
        os.setuid(int(uid))
    with KVClient(config, ns) as kv:
        out = bytearray(int(size))
        n = kv.get_into(key, out)
        caps = kv.capabilities()
    print(json.dumps({
        "n": n, "sha": hashlib.sha256(out).hexdigest(), "caps": caps,
        "local": REGISTRY.get_sample_value("kvfs_kvclient_short_circuit_bytes_total") or 0,
        "gpu_modules": [m for m in %r if m in sys.modules],
    }))
""" % (GPU_MODULES,))


def _client_process(kvfs_cluster, ns: str, key: str, size: int, user: int = 0) -> dict:
    """A separate client process, as ``user`` (0: root), that reads one object and reports what it did."""
    done = subprocess.run([sys.executable, "-c", _CLIENT, str(kvfs_cluster.data / "client.toml"), ns, key, str(size),
                           str(user)], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_client_process_on_cpu_reads_short_circuit_and_imports_no_gpu_library(kvfs_cluster, kv) -> None:
    import hashlib
    data = random.Random(4).randbytes(2 * MIB)
    kv.put("p", data)
    report = _client_process(kvfs_cluster, kv.namespace.decode(), "p", len(data))
    assert report["n"] == len(data) and report["sha"] == hashlib.sha256(data).hexdigest()
    assert report["local"] == len(data)
    assert report["gpu_modules"] == []
    caps = report["caps"]
    assert caps["short_circuit"] is True and caps["gpu"] is False and caps["gds"] is False
    assert "no NVIDIA GPU" in caps["gpu_reason"]


def test_user_who_cannot_open_the_target_files_reads_over_the_network(kvfs_cluster, kv) -> None:
    import hashlib
    data = random.Random(5).randbytes(MIB + 77)
    kv.put("q", data)
    targets = kvfs_cluster.data / "targets"
    mode = targets.stat().st_mode & 0o777
    targets.chmod(0o700)  # the chunk servers (root) still reach their files; user nobody cannot
    try:
        report = _client_process(kvfs_cluster, kv.namespace.decode(), "q", len(data), 65534)
    finally:
        targets.chmod(mode)
    assert report["n"] == len(data) and report["sha"] == hashlib.sha256(data).hexdigest()
    assert report["local"] == 0
    assert report["caps"]["short_circuit"] is False
    assert "Permission denied" in report["caps"]["short_circuit_reason"]


def test_raw_pointers_numpy_and_gpu_buffers_without_a_gpu(kv) -> None:
    np = pytest.importorskip("numpy")
    arr = np.random.default_rng(6).integers(0, 255, 3 * MIB, dtype=np.uint8)
    kv.put("arr", arr)
    raw = (ctypes.c_char * arr.nbytes)()
    reg = kv.register_buffer(ctypes.addressof(raw), arr.nbytes, "cpu")
    assert kv.get_into("arr", reg) == arr.nbytes and bytes(raw) == arr.tobytes()
    back = np.zeros((3, MIB), dtype=np.uint8)  # any C-contiguous shape holds the bytes
    assert kv.get_into("arr", back) == arr.nbytes and np.array_equal(back.ravel(), arr)
    kv.put("from-raw", reg)
    assert kv.get("from-raw") == arr.tobytes()
    gpu = kv.register_buffer(0x7F0000000000, MIB, "cuda:0")  # never touched: there is no GPU here
    with pytest.raises(GpuUnavailable) as e:
        kv.get_into("arr", kv.register_buffer(0x7F0000000000, arr.nbytes, "cuda"))
    assert e.value.errno == errno.ENODEV and "no NVIDIA GPU" in str(e.value)
    with pytest.raises(GpuUnavailable):
        kv.put("gpu-value", gpu)
    assert kv.batch_exists(["gpu-value"]) == [False]
    with pytest.raises(ValueError):
        kv.register_buffer(1234, 10, "tpu")


def test_torch_tensors(kv) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (CPU tensors are tested where it is)")
    t = torch.arange(100_000, dtype=torch.float32)
    kv.put("t", t)
    back = torch.empty_like(t)
    assert kv.get_into("t", back) == t.numel() * 4 and torch.equal(t, back)


def test_a_gdr_region_without_an_rdma_link_reads_through_the_pinned_buffer(kvfs_cluster) -> None:
    """The whole NETWORK_GDR path on a CPU: a registered "GPU" region (host memory behind a fake backend) read from
    real chunk servers over TCP, so every chunk comes through the staging buffer; then unregistered, after which a
    read into it is refused before anything is sent."""
    from test_kvclient_gpu import HostAsGpu

    ns = f"gdr-{os.getpid()}"
    with KVClient.from_config(kvfs_cluster.data / "client.toml", ns, short_circuit=False) as kv:
        backend = HostAsGpu()
        kv._gpu_support, kv._gpu = backend.support, backend  # type: ignore[assignment]
        data = random.Random(7).randbytes(3 * MIB + 5)
        kv.put("blob", data)
        raw = (ctypes.c_char * (8 * MIB))()
        reg = kv.register_buffer(ctypes.addressof(raw), len(raw), "cuda")
        assert reg.span is not None and reg.span.region is not None and kv.capabilities()["gdr"] == "peer-memory"
        gdr_bytes = metric("kvfs_kvclient_gdr_bytes_total")
        assert kv.get_into("blob", reg) == len(data) and raw.raw[: len(data)] == data
        inside = reg.span[MIB : MIB + len(data)]  # a GPU array within the region finds it
        inside.region = None
        assert kv.batch_get_into(["blob"], [inside]) == [len(data)] and raw.raw[MIB : MIB + len(data)] == data
        assert backend.copied == 2 * len(data) and metric("kvfs_kvclient_gdr_bytes_total") == gdr_bytes
        kv.unregister_buffer(reg)
        raw[:] = bytes(len(raw))
        with pytest.raises(OSError) as e:
            kv.get_into("blob", reg)
        assert e.value.errno == errno.EFAULT and raw.raw == bytes(len(raw))
        assert kv.batch_get_into(["blob"], [inside]) == [len(data)]  # outside every region now: staged, no GDR
