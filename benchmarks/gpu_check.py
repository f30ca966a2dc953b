"""GPU read check for kvclient: GB/s of N MiB blocks landing in GPU memory, each way kvclient has, on one local cluster.

    .venv/bin/python benchmarks/gpu_check.py [--block-mib 4] [--blocks 64] [--batch 16] [--device 0]

Brings up mgmtd, meta and 3 chunk servers with ``kvfs up`` (no mount, replication 3) in a temporary directory
(``$KVFS_BENCH_DIR`` picks where), puts ``--blocks`` blocks of ``--block-mib`` MiB through kvclient, and reads them
all back in batches of ``--batch``:

* host, short-circuit: ``batch_get_into`` host buffers, the chunks read from this host's replicas' files;
* host, network: the same with ``short_circuit=False`` (through the chunk servers, which on this host write the
  answers into the client's shared memory), and again with shared memory off (loopback TCP);
* GPU, kvclient GDS path: ``batch_get_into`` GPU buffers (KvikIO reads into GPU memory, CRCs checked on a copy
  back to pinned host memory);
* GPU, raw KvikIO: ``kvikio.CuFile(path).pread`` of the same slot-file ranges into the same GPU buffers, no
  checks, as the ceiling of what GDS gives here;
* GPU, host read + copy: ``batch_get_into`` pinned host buffers, then a copy of each to the GPU;
* GPU, network, GPUDirect RDMA: ``batch_get_into`` GPU buffers registered with ``register_buffer(..., "cuda")``
  with ``short_circuit=False``, so the chunk servers RDMA-WRITE each chunk straight into GPU memory (the row says
  what share of the bytes went that way, from ``kvfs_kvclient_gdr_bytes_total``); beside it the same reads into
  unregistered GPU buffers (network into a pinned buffer, then a copy).

Without a GPU (or without cupy/torch, or KvikIO, or an RDMA NIC the GPU can reach) the rows that need them are
skipped with the reason and the others still run, so the script is known to work up to the GPU calls. Every read
is checked against the payload (the first block's bytes on the GPU are copied back for that).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from prometheus_client import REGISTRY

from kvfs.config import ClusterConfig, load_config
from kvfs.kvclient import KVClient
from kvfs.kvclient.buffers import DeviceSpan
from kvfs.kvclient.gpu import GpuBackend, GpuSupport, probe
from kvfs.localcluster import LocalCluster

MIB = 1 << 20


def payload(i: int, size: int) -> bytes:
    """Block ``i``'s deterministic bytes (a hash chain: incompressible, cheap to make)."""
    seed = hashlib.sha256(i.to_bytes(8, "little")).digest()
    return (seed * (size // len(seed) + 1))[:size]


def rate(total_bytes: int, run: Callable[[], Any], repeat: int) -> float:
    """GB/s of the best of ``repeat`` runs (the first may pay for connections and page faults; a shared machine
    adds noise)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return total_bytes / best / 1e9


def batches(keys: list[str], outs: list[Any], size: int) -> list[tuple[list[str], list[Any]]]:
    return [(keys[i : i + size], outs[i : i + size]) for i in range(0, len(keys), size)]


def read_all(kv: KVClient, work: list[tuple[list[str], list[Any]]], block: int) -> None:
    for keys, outs in work:
        got = kv.batch_get_into(keys, outs)
        if got != [block] * len(keys):
            raise SystemExit(f"batch_get_into returned {got}")


def slot_ranges(kv: KVClient, key: str) -> list[tuple[str, int, int, int]]:
    """(slot file, file offset, object offset, length) of each chunk of ``key`` on this host's replicas, as the
    kvclient reader locates them (the benchmark reaches into the client for it: there is no public call)."""
    core = kv._core
    assert core is not None

    async def locate() -> list[tuple[str, int, int, int]]:
        (found,) = await core.lookup_many([key.encode()])
        attr, layout = found.attr, found.layout
        ranges = []
        for index, at in enumerate(range(0, attr.size, layout.chunk_size)):
            n = min(layout.chunk_size, attr.size - at)
            loc = await core.storage.locate(attr.ino, layout, index, 0, n, core.reader.boot_id)
            if loc is None:
                raise SystemExit(f"chunk {index} of {key} has no replica on this host")
            ranges.append((loc.path, loc.file_offset, at, n))
        return ranges

    return kv._call(locate)


def gpu_arrays(gpu: GpuBackend, count: int, block: int, device: int) -> tuple[list[Any], Callable[[], None]]:
    """``count`` GPU arrays of ``block`` bytes (cupy or torch, as the backend copies) and a device synchronize."""
    lib = gpu._lib
    if gpu.support.copier == "cupy":
        with lib.cuda.Device(device):
            return [lib.empty(block, dtype=lib.uint8) for _ in range(count)], lib.cuda.Device(device).synchronize
    return ([lib.empty(block, dtype=lib.uint8, device=f"cuda:{device}") for _ in range(count)],
            lambda: lib.cuda.synchronize(device))


def check_first(gpu: GpuBackend, span: DeviceSpan, block: int) -> None:
    back = memoryview(bytearray(block))
    gpu.to_host(back, span)
    if bytes(back) != payload(0, block):
        raise SystemExit("the GPU holds other bytes than block 0's payload")


def gpu_rows(kv: KVClient, support: GpuSupport, keys: list[str], block: int, batch: int, device: int,
             total: int, repeat: int) -> list[tuple[str, float]]:
    gpu = GpuBackend(support)
    outs, sync = gpu_arrays(gpu, len(keys), block, device)
    spans = [kv.register_buffer(_device_ptr(o), block, f"cuda:{device}") for o in outs]

    def check() -> None:
        check_first(gpu, spans[0].span, block)

    rows = []
    if support.gds:
        rows.append(("GPU, kvclient GDS path", rate(total, lambda: (read_all(kv, batches(keys, spans, batch), block),
                                                                    sync()), repeat)))
        check()
        import kvikio
        plans = [(span.span, slot_ranges(kv, key)) for span, key in zip(spans, keys)]
        files: dict[str, Any] = {}

        def raw() -> None:
            futures = []
            for span, ranges in plans:
                for path, file_offset, at, n in ranges:
                    handle = files.get(path) or files.setdefault(path, kvikio.CuFile(path, "r"))
                    futures.append(handle.pread(span[at : at + n], n, file_offset))
            for f in futures:
                f.get()
            sync()

        for span in spans:
            gpu.to_device(span.span, memoryview(bytes(block)))
        rows.append(("GPU, raw KvikIO, same files", rate(total, raw, repeat)))
        check()
        for handle in files.values():
            handle.close()
    pinned = [gpu.pinned(block) for _ in range(batch)]

    def host_then_copy() -> None:
        for keys_part, spans_part in batches(keys, spans, batch):
            read_all(kv, [(keys_part, pinned[: len(keys_part)])], block)
            for host, span in zip(pinned, spans_part):
                gpu.to_device(span.span, host)
        sync()

    rows.append(("GPU, host read + copy", rate(total, host_then_copy, repeat)))
    check()
    return rows


def gdr_rows(config: ClusterConfig, support: GpuSupport, keys: list[str], block: int, batch: int, device: int,
             total: int, repeat: int) -> tuple[list[tuple[str, float]], str]:
    """GPU reads from the chunk servers (no short-circuit): into registered GPU buffers (GPUDirect RDMA where the
    links allow) and into unregistered ones (pinned buffer + copy); with the share of bytes that went direct, or
    why GDR is off here."""
    gpu = GpuBackend(support)
    with KVClient(config, "gpu-check", short_circuit=False) as kv:
        caps = kv.capabilities()
        if caps["gdr"] is None:
            return [], caps["gdr_reason"]
        registered, sync = gpu_arrays(gpu, len(keys), block, device)  # kept: register_buffer holds no reference
        direct = [kv.register_buffer(_device_ptr(o), block, f"cuda:{device}") for o in registered]
        plain, _ = gpu_arrays(gpu, len(keys), block, device)
        before = REGISTRY.get_sample_value("kvfs_kvclient_gdr_bytes_total") or 0.0
        gdr = rate(total, lambda: (read_all(kv, batches(keys, direct, batch), block), sync()), repeat)
        share = ((REGISTRY.get_sample_value("kvfs_kvclient_gdr_bytes_total") or 0.0) - before) / (total * repeat)
        check_first(gpu, direct[0].span, block)
        staged = rate(total, lambda: (read_all(kv, batches(keys, plain, batch), block), sync()), repeat)
        check_first(gpu, DeviceSpan(_device_ptr(plain[0]), block, device), block)
    return [(f"GPU, network, GDR ({share:.0%} direct)", gdr), ("GPU, network, pinned + copy", staged)], ""


def _device_ptr(array: Any) -> int:
    return int(array.__cuda_array_interface__["data"][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-mib", type=int, default=4, help="block size in MiB")
    parser.add_argument("--blocks", type=int, default=64, help="blocks put and read back")
    parser.add_argument("--batch", type=int, default=16, help="blocks per batch_get_into")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row; the best counts")
    args = parser.parse_args()
    block, total = args.block_mib * MIB, args.blocks * args.block_mib * MIB
    support = probe()
    keys = [f"blk-{i:05d}" for i in range(args.blocks)]
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVFS_BENCH_DIR")) as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster")
        try:
            cluster.up(Path(tmp) / "mnt", mounted=False, echo=lambda *a: None)
            config = load_config(cluster.client_config_path)
            rows = []
            with KVClient(config, "gpu-check") as kv:
                for i, key in enumerate(keys):
                    kv.put(key, payload(i, block))
                outs = [bytearray(block) for _ in range(args.batch)]
                work = [(part, outs[: len(part)]) for part, _ in batches(keys, keys, args.batch)]
                rows.append(("host, short-circuit", rate(total, lambda: read_all(kv, work, block), args.repeat)))
                if bytes(outs[0]) != payload((args.blocks - 1) // args.batch * args.batch, block):
                    raise SystemExit("host read returned other bytes than the payload")
                caps = kv.capabilities()
                if support.gpu and support.copier is not None:
                    rows += gpu_rows(kv, support, keys, block, args.batch, args.device, total, args.repeat)
            gdr_off = support.reason or "no GPU support"
            if support.gpu and support.copier is not None:
                more, gdr_off = gdr_rows(config, support, keys, block, args.batch, args.device, total, args.repeat)
                rows += more
            with KVClient(config, "gpu-check", short_circuit=False) as kv:
                rows.append(("host, network, shared memory", rate(total, lambda: read_all(kv, work, block),
                                                                  args.repeat)))
            tcp_only = msgspec.structs.replace(config, shared_memory=False)  # $KVFS_SHM=0 would stop it for all
            with KVClient(tcp_only, "gpu-check", short_circuit=False) as kv:
                rows.append(("host, network, loopback TCP", rate(total, lambda: read_all(kv, work, block),
                                                                 args.repeat)))
        finally:
            cluster.down(echo=lambda *a: None)
    print(f"{args.blocks} blocks of {args.block_mib} MiB, batches of {args.batch}, replication 3;"
          f" gpu={caps['gpu']} gds={caps['gds']} gds_direct={caps['gds_direct']} copier={caps['gpu_copier']}"
          f" gdr={caps['gdr']}")
    for name, gbps in rows:
        print(f"  {name:<32} {gbps:8.2f} GB/s")
    if not (support.gpu and support.copier is not None):
        print(f"  GPU rows skipped: {support.reason}")
    elif not support.gds:
        print(f"  GDS rows skipped: {support.reason}")
    elif not support.gds_direct:
        print(f"  note: {support.reason}")
    if gdr_off:
        print(f"  GDR rows skipped: {gdr_off}")


if __name__ == "__main__":
    main()
