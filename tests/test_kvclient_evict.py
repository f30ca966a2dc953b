"""kvclient eviction (capacity, TTL, least recently used first), orphan temporary files of a killed put, and the
refusal of values larger than a namespace: on a real cluster (``kvfs up``) and its mount, with real client
processes; the choice of victims also as a property of the pure function."""

from __future__ import annotations

import errno
import itertools
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, strategies as st

from cluster_fixtures import NEEDS_FUSE, wait_until
from kvfs.kvclient import KVClient, ValueTooLarge
from kvfs.kvclient.evict import LOW_WATER, EvictionPolicy, choose_victims, last_use
from kvfs.meta.types import Attr, Entry

pytest_plugins = ["cluster_fixtures"]
_ns = itertools.count()
S = 1_000_000_000


@pytest.fixture
def ns(request) -> str:
    return f"e{next(_ns)}-{os.getpid()}-" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]


def evictions(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("kvfs_kvclient_evictions_total", {"reason": reason}) or 0.0


def listing(cluster, ns: str) -> list[str]:
    return sorted(os.listdir(cluster.mount / "kvcache" / ns))


# ------------------------------------------------------------------------------ the choice, as a property
_files = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 100), st.integers(0, 100), st.booleans()),
                  max_size=30)


@given(_files, st.integers(1, 20000), st.one_of(st.none(), st.integers(1, 100)))
def test_victims_are_the_least_recently_used_until_under_capacity(files, capacity, ttl):
    now = 200 * S
    entries = [Entry((b".put-%d" if temp else b"k%d") % i, Attr(i + 2, 0o100644, 1, 0, 0, size=size,
                     atime_ns=atime * S, mtime_ns=mtime * S, ctime_ns=mtime * S))
               for i, (size, atime, mtime, temp) in enumerate(files)]
    policy = EvictionPolicy(capacity_bytes=capacity, ttl=ttl, orphan_grace=150)
    victims = choose_victims(entries, policy, now)
    by_name = {e.name: e.attr for e in entries}
    keys = {e.name for e in entries if not e.name.startswith(b".put-")}
    assert set(victims["orphan"]) == {n for n in by_name if n not in keys and now - by_name[n].ctime_ns >= 150 * S}
    assert set(victims["ttl"]) == {k for k in keys if ttl is not None and now - last_use(by_name[k]) >= ttl * S}
    kept = keys - set(victims["ttl"]) - set(victims["capacity"])
    total = sum(by_name[k].size for k in kept)
    assert total <= capacity
    if victims["capacity"]:
        assert total <= capacity * LOW_WATER
        assert max(last_use(by_name[v]) for v in victims["capacity"]) <= min(
            (last_use(by_name[k]) for k in kept), default=now)
        newest = max(victims["capacity"], key=lambda v: (last_use(by_name[v]), v))
        assert total + by_name[newest].size > capacity * LOW_WATER  # no more than needed


def test_bad_policies_are_refused() -> None:
    for bad in (dict(capacity_bytes=0), dict(ttl=-1), dict(orphan_grace=-1), dict(interval=0)):
        with pytest.raises(ValueError):
            EvictionPolicy(**bad)


# ------------------------------------------------------------------------------ on a real cluster


@pytest.mark.timeout(300)
@NEEDS_FUSE
def test_capacity_evicts_the_least_recently_used(kvfs_cluster, ns) -> None:
    config = kvfs_cluster.data / "client.toml"
    with KVClient.from_config(config, ns) as writer:  # no limits: it never sweeps
        for i in range(12):
            writer.put(f"k{i}", bytes([i]) * 1000)
        assert writer.get("k0") == b"\0" * 1000 and writer.get("k1") == b"\1" * 1000  # recorded, sent at close
    before = evictions("capacity")
    with KVClient.from_config(config, ns, capacity_bytes=10_000, evict_interval=0.2) as kv:
        wait_until(lambda: len(listing(kvfs_cluster, ns)) == 9, 30, "the sweep")
        time.sleep(0.5)  # a second sweep finds the namespace under capacity: nothing more goes
        assert listing(kvfs_cluster, ns) == sorted(["k0", "k1"] + [f"k{i}" for i in range(5, 12)])
        assert kv.batch_exists(["k2", "k3", "k4", "k0"]) == [False, False, False, True]
        assert evictions("capacity") == before + 3
        with pytest.raises(ValueTooLarge) as e:  # could never be kept: refused before anything is sent
            kv.batch_put(["ok", "big"], [b"x", bytes(10_001)])
        assert e.value.errno == errno.EFBIG
        assert kv.batch_exists(["ok", "big"]) == [False, False]


@pytest.mark.timeout(300)
@NEEDS_FUSE
def test_ttl_evicts_what_was_not_used_for_that_long(kvfs_cluster, ns) -> None:
    config = kvfs_cluster.data / "client.toml"
    with KVClient.from_config(config, ns, access_flush=0.1) as writer:
        writer.batch_put(["old", "used"], [b"o", b"u"])
        time.sleep(3)
        assert writer.get("used") == b"u"
        writer.put("new", b"n")
    before = evictions("ttl")
    with KVClient.from_config(config, ns, ttl=2.5, evict_interval=0.2):
        wait_until(lambda: "old" not in listing(kvfs_cluster, ns), 30, "the TTL sweep")
        assert listing(kvfs_cluster, ns) == ["new", "used"]
        assert evictions("ttl") == before + 1


_KILLED_PUT = """
import sys
from kvfs.kvclient import KVClient
kv = KVClient.from_config(sys.argv[1], sys.argv[2])
kv.put("big", b"\\xab" * (256 << 20))
print("put finished", flush=True)
"""


@pytest.mark.timeout(300)
@NEEDS_FUSE
def test_the_temporary_file_of_a_killed_put_goes_after_the_grace_period(kvfs_cluster, ns) -> None:
    config = str(kvfs_cluster.data / "client.toml")
    with KVClient.from_config(config, ns) as kv:
        kv.put("kept", b"k")
        child = subprocess.Popen([sys.executable, "-c", _KILLED_PUT, config, ns], stdout=subprocess.PIPE)
        try:
            temps = wait_until(lambda: [n for n in listing(kvfs_cluster, ns) if n.startswith(".put-")], 60,
                               "the put's temporary file")
            assert child.poll() is None, "the put finished before it could be killed"
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            assert child.wait(30) == -signal.SIGKILL and child.stdout.read() == b""
        assert kv.batch_exists(["big", "kept"]) == [False, True]  # a partial object is never a key
    with KVClient.from_config(config, ns, evict=True, orphan_grace=3600, evict_interval=0.2):
        time.sleep(1)  # sweeps within the grace period leave it
        assert listing(kvfs_cluster, ns) == sorted(["kept", *temps])
    before = evictions("orphan")
    with KVClient.from_config(config, ns, evict=True, orphan_grace=1, evict_interval=0.2) as kv:
        wait_until(lambda: listing(kvfs_cluster, ns) == ["kept"], 30, "the orphan sweep")
        assert evictions("orphan") == before + 1
        assert kv.get("kept") == b"k" and kv.get("big") is None


@pytest.mark.timeout(300)
@NEEDS_FUSE
def test_limits_stored_with_the_namespace_apply_to_every_client_of_it(kvfs_cluster, ns) -> None:
    """An operator sets them with setfattr on the mount, or a client with ``set_limits``; a client made without
    limits of its own sweeps under them and refuses what they could never hold."""
    config = kvfs_cluster.data / "client.toml"
    directory = kvfs_cluster.mount / "kvcache" / ns
    with KVClient.from_config(config, ns) as writer:
        for i in range(12):
            writer.put(f"k{i}", bytes([i]) * 1000)
        time.sleep(0.5)
        assert len(listing(kvfs_cluster, ns)) == 12  # no limit anywhere: nothing swept
    os.setxattr(directory, "user.kvfs.capacity_bytes", b"10000")
    with KVClient.from_config(config, ns, evict_interval=0.2) as kv:
        wait_until(lambda: len(listing(kvfs_cluster, ns)) == 9, 30, "the sweep under the stored capacity")
        with pytest.raises(ValueTooLarge):
            kv.put("big", bytes(10_001))
        kv.set_limits(capacity_bytes=4000, ttl=3600)
        assert os.getxattr(directory, "user.kvfs.capacity_bytes") == b"4000"
        assert os.getxattr(directory, "user.kvfs.ttl") == b"3600"
        wait_until(lambda: len(listing(kvfs_cluster, ns)) == 3, 30, "the sweep under the new capacity")
        kv.set_limits(capacity_bytes=None, ttl=None)
        for name in ("user.kvfs.capacity_bytes", "user.kvfs.ttl"):
            with pytest.raises(OSError) as gone:
                os.getxattr(directory, name)
            assert gone.value.errno == errno.ENODATA
        kv.put("big", bytes(10_001))  # no limit left
        with pytest.raises(ValueError):
            kv.set_limits(capacity_bytes=0)


@pytest.mark.timeout(300)
@NEEDS_FUSE
def test_a_clients_own_limit_wins_and_a_bad_stored_one_is_ignored(kvfs_cluster, ns, caplog) -> None:
    config = kvfs_cluster.data / "client.toml"
    directory = kvfs_cluster.mount / "kvcache" / ns
    with KVClient.from_config(config, ns) as kv:
        kv.put("k", b"k")
    os.setxattr(directory, "user.kvfs.capacity_bytes", b"10000")
    with KVClient.from_config(config, ns, capacity_bytes=20_000) as kv:
        kv.put("fits-its-own", bytes(15_000))
    os.setxattr(directory, "user.kvfs.capacity_bytes", b"plenty")
    os.setxattr(directory, "user.kvfs.ttl", b"-5")
    with caplog.at_level("WARNING", logger="kvfs.kvclient.evict"):
        with KVClient.from_config(config, ns, evict_interval=0.2) as kv:
            kv.put("fits", bytes(15_000))
            time.sleep(0.5)
    assert listing(kvfs_cluster, ns) == ["fits", "fits-its-own", "k"]
    assert "user.kvfs.capacity_bytes=b'plenty'" in caplog.text
    assert "user.kvfs.ttl=b'-5'" in caplog.text
