"""Server processes freeze what survives a full garbage collection (``kvfs.service.freeze_after_full_collections``),
so a later full collection walks only what was made since; run in child processes, whose collectors they change."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from cluster_fixtures import NEEDS_FUSE, second_mount, started, wait_until

METRICS = re.compile(r"metrics on (http://\S+/metrics)")
COUNT = re.compile(r'^kvfs_gc_pause_seconds_count\{generation="0"\} (\S+)$', re.MULTILINE)


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_full_collection_freezes_its_survivors_and_young_cycles_are_still_collected():
    out = _run("""
        import gc, json
        from prometheus_client import REGISTRY, generate_latest
        from kvfs.service import freeze_after_full_collections
        freeze_after_full_collections()
        freeze_after_full_collections()  # installed once however often it is asked
        kept = [[i] for i in range(50_000)]
        gc.collect()
        frozen = gc.get_freeze_count()
        cycle = []
        cycle.append(cycle)
        del cycle
        young_garbage = gc.collect()
        full = REGISTRY.get_sample_value("kvfs_gc_pause_seconds_count", {"generation": "2"})
        slow = REGISTRY.get_sample_value("kvfs_gc_pause_seconds_bucket", {"generation": "2", "le": "+Inf"})
        assert b'kvfs_gc_pause_seconds_bucket{generation="0",le="0.001"}' in generate_latest()
        print(json.dumps({"frozen": frozen, "young_garbage": young_garbage, "full": full, "all": slow,
                          "installed": len(gc.callbacks)}))
    """)
    assert out["frozen"] >= 50_000
    assert out["young_garbage"] >= 1  # a cycle made after the freeze is still found
    assert out["full"] >= 2  # the two asked for (and any the allocations set off), each observed
    assert out["all"] == out["full"]  # the +Inf bucket counts every one
    assert out["installed"] == 1


def test_run_service_installs_it_before_the_service_starts():
    """``run_service`` runs meta, mgmtd and the chunk servers."""
    out = _run("""
        import gc, json
        from kvfs.service import _on_collection, run_service
        seen = {}
        async def main():
            seen["installed"] = _on_collection in gc.callbacks
        run_service(main)
        print(json.dumps(seen))
    """)
    assert out == {"installed": True}


@NEEDS_FUSE
@pytest.mark.timeout(120)
def test_a_mount_counts_its_collections_on_its_metrics_endpoint(tmp_path):
    """The mount has an entry point of its own; its ``/metrics`` shows the collections the hook observed."""
    log = tmp_path / "mount.log"
    with started("kvfs-gc-") as cluster, second_mount(cluster, tmp_path / "mnt", "--http", "127.0.0.1:0", log=log):
        url = wait_until(lambda: METRICS.search(log.read_text()), 15, "the mount's metrics address").group(1)

        def young_collections() -> float:
            with urllib.request.urlopen(url, timeout=5) as reply:
                found = COUNT.search(reply.read().decode())
            return float(found.group(1)) if found else 0.0

        wait_until(lambda: young_collections() > 0, 15, "a collection counted in kvfs_gc_pause_seconds")


def test_a_collection_completes_while_this_thread_holds_every_metrics_lock():
    """A collection may start inside an allocation that a metric makes under its own lock (a scrape copies a
    labelled metric's children under it); the callback must not ask for any such lock, or it waits for itself."""
    out = _run("""
        import gc, json
        from prometheus_client import REGISTRY
        import kvfs.chunkserver.service  # labelled metrics of a server beside the collector's own
        from kvfs.service import freeze_after_full_collections
        freeze_after_full_collections()
        held = [c._lock for c in list(REGISTRY._collector_to_names) if hasattr(c, "_lock")]
        for lock in held:
            lock.acquire()
        gc.collect()
        for lock in held:
            lock.release()
        print(json.dumps({"held": len(held), "full": REGISTRY.get_sample_value(
            "kvfs_gc_pause_seconds_count", {"generation": "2"})}))
    """)
    assert out["held"] > 0 and out["full"] >= 1


def test_kvclient_leaves_its_host_process_collector_and_metrics_alone():
    out = _run("""
        import gc, json
        from prometheus_client import REGISTRY
        import kvfs.kvclient
        from kvfs.service import _on_collection
        print(json.dumps({"hooked": _on_collection in gc.callbacks,
                          "metric": REGISTRY.get_sample_value("kvfs_gc_pause_seconds_count", {"generation": "0"})}))
    """)
    assert out == {"hooked": False, "metric": None}
