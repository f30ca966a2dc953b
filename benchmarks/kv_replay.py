"""KV-cache replay: the Mooncake trace against kvclient, Redis, Mooncake Store and a loopback socket pump, in one run.

    .venv/bin/python benchmarks/kv_replay.py [--requests 600] [--block-kib 128] [--systems kvclient,redis,...]
    .venv/bin/python benchmarks/kv_replay.py --block-mib 1 [--blocks 256] [--batch 16]

Replay (the default): every block id of ``../shared/traces/mooncake_synthetic_trace.jsonl`` (one request a line,
``hash_ids`` of 512-token blocks) becomes a key with a deterministic payload of ``--block-kib``; each request
does a prefix lookup of its blocks, gets the hits in one batch, puts the misses in one batch, and checks every
byte it got. ``--requests`` takes the trace's first N requests, to keep a run to a minute or two on a small
machine. Block mode (``--block-mib N``): batch puts then batch gets of ``--blocks`` blocks of N MiB, checked
the same way. Each system starts empty and sees the same operations:

* kvclient on ``kvfs up`` in a temporary directory (mgmtd, meta, 3 chunk servers, every block on 3 replicas, no
  mount);
* Redis (Debian's ``redis-server`` on loopback, persistence off; PyPI ``redis``), pipelined EXISTS, MGET, MSET;
* Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``): a master and a segment-server process holding the
  whole working set in memory, one replica, the client over TCP with the P2PHANDSHAKE metadata mode; their
  listeners bind every interface, so this script runs that part again as a child inside ``unshare -n`` (a
  network namespace with only loopback; needs root), which reports its figures as JSON;
* only when ``--systems`` names ``mooncake3``: Mooncake Store with three segment servers and every put on three of
  them (``ReplicateConfig.replica_num = 3``), as kvclient keeps every block on three chunk servers: the same
  replication on the same host (each segment server holds the whole working set, so it takes three times the
  memory);
* a plain loopback socket pump of one block per round trip: the ceiling for moving a block between processes.

It prints the hit ratio, get and put GB/s (payload bytes over the time spent in the batch calls, checking
excluded) and p50/p99 latency per batch call. What is absent is skipped with the reason. Where the host pages out
cold page cache with no memory pressure (a DAMON ``pageout`` scheme, as on some VMs), it says so: kvclient's
blocks may then come from the disk, the other stores' never.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rpc_bench import plain_pump, plain_server

from kvfs.kvclient import KVClient
from kvfs.localcluster import LocalCluster

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
MOONCAKE_PORT = 50051  # the master's RPC port, inside the benchmark's own network namespace


class Store(Protocol):
    name: str

    def prefix_hits(self, keys: Sequence[str]) -> int: ...
    def batch_get_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int]: ...
    def batch_put(self, keys: Sequence[str], values: Sequence[bytes]) -> None: ...


class KvStore:
    name = "kvclient (3 replicas)"

    def __init__(self, client: KVClient) -> None:
        self.client = client
        self.prefix_hits = client.prefix_hits
        self.batch_get_into = client.batch_get_into

    def batch_put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        failed = [r for r in self.client.batch_put(keys, values) if r]
        if failed:
            raise OSError(-failed[0], f"{len(failed)} kvclient puts failed: {os.strerror(-failed[0])}")


class RedisStore:
    name = "redis"

    def __init__(self, port: int) -> None:
        import redis

        self.db = redis.Redis(port=port)
        self.db.flushall()

    def prefix_hits(self, keys: Sequence[str]) -> int:
        pipe = self.db.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        n = 0
        for found in pipe.execute():
            if not found:
                break
            n += 1
        return n

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int]:
        sizes = []
        for value, out in zip(self.db.mget(keys), outs):  # redis-py hands back bytes: one copy into the buffer
            out[:len(value)] = value
            sizes.append(len(value))
        return sizes

    def batch_put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        self.db.mset(dict(zip(keys, values)))


class MooncakeStore:
    def __init__(self, local_buffer: int, replicas: int = 1) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.store = MooncakeDistributedStore()
        self.name = mooncake_name(replicas)
        self.config = ReplicateConfig()
        self.config.replica_num = replicas
        master = f"127.0.0.1:{MOONCAKE_PORT}"
        if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, local_buffer, "tcp", "", master):
            raise OSError("Mooncake Store client setup failed")
        self._registered: dict[int, int] = {}  # address -> size of the caller's buffers registered for gets

    def prefix_hits(self, keys: Sequence[str]) -> int:
        n = 0
        for found in self.store.batch_is_exist(list(keys)):
            if found != 1:
                break
            n += 1
        return n

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int]:
        """Straight into the caller's buffers (registered once each), as kvclient's batch_get_into."""
        ptrs = [ctypes.addressof(ctypes.c_char.from_buffer(out)) for out in outs]
        for ptr, out in zip(ptrs, outs):
            if self._registered.get(ptr) != len(out):
                if self.store.register_buffer(ptr, len(out)):
                    raise OSError("Mooncake Store could not register a buffer")
                self._registered[ptr] = len(out)
        return self.store.batch_get_into(list(keys), ptrs, [len(out) for out in outs])

    def batch_put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        if self.store.put_batch(list(keys), list(values), self.config):
            raise OSError("Mooncake Store put_batch failed")


def mooncake_name(replicas: int) -> str:
    return f"mooncake store ({replicas} replica{'s' if replicas > 1 else ''})"


@dataclass
class Figures:
    hits: int = 0
    lookups: int = 0
    got: int = 0
    put: int = 0
    lookup_s: list[float] = field(default_factory=list)
    get_s: list[float] = field(default_factory=list)
    put_s: list[float] = field(default_factory=list)

    HEADER = (f"{'system':<27} {'hit ratio':>9} {'get GB/s':>9} {'put GB/s':>9} {'get/pump':>9} {'lookup p50':>10}"
              f" {'get p50':>8} {'get p99':>8} {'put p50':>8} {'put p99':>8}   (latencies: ms per batch call)")

    def row(self, name: str, ceiling: float) -> str:
        get, put = _rate(self.got, self.get_s), _rate(self.put, self.put_s)
        ratio = f"{self.hits / self.lookups:9.3f}" if self.lookups else f"{'-':>9}"
        return (f"{name:<27} {ratio} {get:9.3f} {put:9.3f} {get / ceiling:9.2f} {_ms(self.lookup_s, 50):10.2f}"
                f" {_ms(self.get_s, 50):8.2f} {_ms(self.get_s, 99):8.2f} {_ms(self.put_s, 50):8.2f}"
                f" {_ms(self.put_s, 99):8.2f}")


def _rate(total: int, times: list[float]) -> float:
    return total / sum(times) / 1e9 if times else float("nan")


def _ms(times: list[float], q: int) -> float:
    if not times:
        return float("nan")
    return (statistics.quantiles(times, n=100)[q - 1] if len(times) > 1 else times[0]) * 1e3


class Payloads:
    """The deterministic payload of block ``h``: one random block rotated by a per-block offset."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.base = os.urandom(size) * 2

    def of(self, h: int) -> bytes:
        offset = (h * 2654435761) % self.size
        return self.base[offset:offset + self.size]


def timed(times: list[float], fn: Callable[..., Any], *args: Any) -> Any:
    start = time.perf_counter()
    result = fn(*args)
    times.append(time.perf_counter() - start)
    return result


def check(hashes: Sequence[int], outs: Sequence[memoryview], sizes: Sequence[int], payloads: Payloads) -> None:
    for h, out, size in zip(hashes, outs, sizes):
        if size != payloads.size or out != payloads.of(h):
            raise AssertionError(f"block {h}: wrong bytes back ({size} of {payloads.size})")


def warm_up(store: Store, payloads: Payloads) -> None:
    """One put and get outside the figures: connections, the namespace directory and chunk routes are set up
    once per client, as an engine's long-lived client has them."""
    out = memoryview(bytearray(payloads.size))
    store.batch_put(["warm-up"], [payloads.of(-1)])
    check([-1], [out], store.batch_get_into(["warm-up"], [out]), payloads)


def replay(store: Store, requests: list[list[int]], payloads: Payloads) -> Figures:
    """Each request: prefix lookup, get the hits, put the misses (one batch call each), check what came back."""
    warm_up(store, payloads)
    fig = Figures()
    outs = [memoryview(bytearray(payloads.size)) for _ in range(max(map(len, requests)))]
    for hashes in requests:
        keys = [f"b{h}" for h in hashes]
        n = timed(fig.lookup_s, store.prefix_hits, keys)
        if n:
            check(hashes[:n], outs, timed(fig.get_s, store.batch_get_into, keys[:n], outs[:n]), payloads)
            fig.got += n * payloads.size
        if n < len(keys):
            timed(fig.put_s, store.batch_put, keys[n:], [payloads.of(h) for h in hashes[n:]])
            fig.put += (len(keys) - n) * payloads.size
        fig.hits += n
        fig.lookups += len(keys)
    return fig


def blocks(store: Store, count: int, batch: int, payloads: Payloads) -> Figures:
    """Batch puts of ``count`` blocks, then batch gets of them all, checked."""
    warm_up(store, payloads)
    fig = Figures()
    outs = [memoryview(bytearray(payloads.size)) for _ in range(batch)]
    for first in range(0, count, batch):
        ids = range(first, min(first + batch, count))
        timed(fig.put_s, store.batch_put, [f"m{h}" for h in ids], [payloads.of(h) for h in ids])
        fig.put += len(ids) * payloads.size
    for first in range(0, count, batch):
        ids = range(first, min(first + batch, count))
        check(ids, outs, timed(fig.get_s, store.batch_get_into, [f"m{h}" for h in ids], outs[:len(ids)]), payloads)
        fig.got += len(ids) * payloads.size
    return fig


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[int | str]:
    """A loopback redis-server's port, or why there is none."""
    binary = shutil.which("redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        yield "Redis: skipped, PyPI redis is not installed (pip install redis)"
        return
    if binary is None:
        yield "Redis: skipped, no redis-server (Debian: apt-get install redis-server)"
        return
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(directory), "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    yield "Redis: skipped, redis-server did not start"
                    return
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def mooncake_child(run: Callable[[Store], Figures], working_set: int, largest_batch: int, replicas: int) -> None:
    """Inside the network namespace: the master, ``replicas`` segment servers each holding ``working_set`` bytes,
    and the measured client in this process, putting every object on ``replicas`` of them; the figures go to stdout
    as the last line."""
    venv = Path(sys.executable).parent
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    segment = f"""
import sys, time
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
if store.setup("127.0.0.1", "P2PHANDSHAKE", {working_set}, 16 << 20, "tcp", "", "127.0.0.1:{MOONCAKE_PORT}"):
    sys.exit("segment setup failed")
print("ready", flush=True)
time.sleep(86400)
"""
    quiet = dict(stderr=subprocess.DEVNULL, env={**os.environ, "GLOG_minloglevel": "2"})
    master = subprocess.Popen([str(venv / "mooncake_master"), "-rpc_port", str(MOONCAKE_PORT)],
                              stdout=subprocess.DEVNULL, **quiet)
    servers: list[subprocess.Popen] = []
    try:
        time.sleep(1)
        for _ in range(replicas):
            servers.append(subprocess.Popen([sys.executable, "-c", segment], stdout=subprocess.PIPE, **quiet))
            if servers[-1].stdout.readline().strip() != b"ready":  # type: ignore[union-attr]
                raise SystemExit("a Mooncake segment server did not start")
        store = MooncakeStore(2 * largest_batch + (64 << 20), replicas)
        fig = run(store)
        store.batch_put(["replica-probe"], [b"x" * 4096])
        copies = len(store.store.get_replica_desc("replica-probe"))
        if copies != replicas:
            raise SystemExit(f"Mooncake Store kept {copies} copies of an object put with replica_num={replicas}")
        print(json.dumps(dataclasses.asdict(fig)))
    finally:
        for proc in (*servers, master):
            proc.kill()
            proc.wait(10)


def mooncake_figures(argv: list[str], replicas: int) -> Figures | str:
    """Mooncake Store's figures (``replicas`` segment servers and copies) from a run of this script inside
    ``unshare -n``, or why there are none."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return "Mooncake Store: skipped, PyPI mooncake-transfer-engine-non-cuda is not installed"
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return "Mooncake Store: skipped, its run inside `unshare -n` needs root, unshare and ip (iproute2)"
    child = subprocess.run(["unshare", "-n", sys.executable, __file__, *argv, "--mooncake-child", str(replicas)],
                           capture_output=True, text=True, env={**os.environ, "GLOG_minloglevel": "2"})
    if child.returncode:
        return f"Mooncake Store: skipped, its run failed: {(child.stderr or child.stdout).strip()[-300:]}"
    return Figures(**json.loads(child.stdout.strip().splitlines()[-1]))


#: What ``--systems`` may name, and what it names by default.
SYSTEMS = ("kvclient", "redis", "mooncake", "mooncake3", "pump")
DEFAULT_SYSTEMS = ("kvclient", "redis", "mooncake", "pump")


def page_cache_reclaim() -> str | None:
    """A note when the host pages out cold page-cache pages with no memory pressure (a DAMON ``pageout`` scheme
    running, as on some VMs): kvclient's blocks then come from the disk now and then, where the other stores keep
    theirs in anonymous memory, which such a scheme leaves alone (benchmarks/RESULTS.md, "Session 33")."""
    for kdamond in sorted(Path("/sys/kernel/mm/damon/admin/kdamonds").glob("[0-9]*")):
        try:
            if (kdamond / "state").read_text().strip() != "on":
                continue
            actions = {a.read_text().strip() for a in kdamond.glob("contexts/*/schemes/*/action")}
        except OSError:
            continue
        if "pageout" in actions:
            return (f"host: DAMON pages out cold memory ({kdamond}, action pageout), page cache included, with no"
                    " memory pressure: kvclient's blocks may be read from the disk")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=600, help="replay the trace's first N requests")
    parser.add_argument("--block-kib", type=int, default=128, help="payload per trace block (replay)")
    parser.add_argument("--block-mib", type=int, default=0, help="block mode: batch get/put of N MiB blocks")
    parser.add_argument("--blocks", type=int, default=256, help="block mode: how many blocks")
    parser.add_argument("--batch", type=int, default=16, help="block mode: blocks per batch call")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})")
    parser.add_argument("--mooncake-child", type=int, metavar="REPLICAS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    systems = set(args.systems.split(","))
    if systems - set(SYSTEMS):
        parser.error(f"unknown systems {', '.join(sorted(systems - set(SYSTEMS)))}; choose from {', '.join(SYSTEMS)}")
    if args.block_mib:
        payloads = Payloads(args.block_mib << 20)
        run: Callable[[Store], Figures] = lambda store: blocks(store, args.blocks, args.batch, payloads)
        what = f"block mode: {args.blocks} blocks of {args.block_mib} MiB, {args.batch} per batch call"
        working_set, largest = (args.blocks + 1) * payloads.size, args.batch * payloads.size
    else:
        if not args.trace.exists():
            raise SystemExit(f"no trace at {args.trace} (see ../shared/README.md)")
        with args.trace.open() as f:
            requests = [json.loads(line)["hash_ids"] for line, _ in zip(f, range(args.requests))]
        payloads = Payloads(args.block_kib << 10)
        run = lambda store: replay(store, requests, payloads)  # noqa: E731
        what = (f"replay: the first {len(requests)} requests of {args.trace.name},"
                f" {sum(map(len, requests))} block references of {args.block_kib} KiB")
        working_set = (len({h for r in requests for h in r}) + 1) * payloads.size
        largest = max(map(len, requests)) * payloads.size
    if args.mooncake_child:
        mooncake_child(run, working_set + working_set // 4 + (64 << 20), largest, args.mooncake_child)
        return
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    pump = ctx.Process(target=plain_server, args=(queue,), daemon=True)
    if "pump" in systems:
        pump.start()
    rows: list[tuple[str, Figures]] = []
    notes: list[str] = []
    ceiling = float("nan")
    try:
        if "pump" in systems:
            ceiling = plain_pump(queue.get(timeout=30), payloads.size, 1.5) / 1e9
        with tempfile.TemporaryDirectory(dir=os.environ.get("KVFS_BENCH_DIR")) as tmp:
            if "kvclient" in systems:
                cluster = LocalCluster(Path(tmp) / "cluster")
                try:
                    cluster.up(Path(tmp) / "mnt", mounted=False, echo=lambda *a: None)
                    with KVClient.from_config(cluster.client_config_path, "replay") as client:
                        rows.append((KvStore.name, run(KvStore(client))))
                finally:
                    cluster.down(echo=lambda *a: None)
            if "redis" in systems:
                with redis_server(Path(tmp)) as redis_port:
                    if isinstance(redis_port, str):
                        notes.append(redis_port)
                    else:
                        rows.append((RedisStore.name, run(RedisStore(redis_port))))
        for system, replicas in (("mooncake", 1), ("mooncake3", 3)):
            if system in systems:
                mooncake = mooncake_figures(sys.argv[1:], replicas)
                if isinstance(mooncake, str):
                    notes.append(mooncake)
                else:
                    rows.append((mooncake_name(replicas), mooncake))
    finally:
        if pump.is_alive():
            pump.terminate()
    print(what)
    print(Figures.HEADER)
    for name, fig in rows:
        print(fig.row(name, ceiling))
    if "pump" in systems:
        print(f"{'socket pump (ceiling)':<27} {'-':>9} {ceiling:9.3f} {ceiling:9.3f}")
    reclaim = page_cache_reclaim()
    for note in [*notes, *([reclaim] if reclaim and "kvclient" in systems else [])]:
        print(note)


if __name__ == "__main__":
    main()
