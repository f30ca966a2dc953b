"""Chunk engine throughput, with direct I/O (the default) and through the page cache, beside plain
pwrite+fdatasync / preadv of the same sizes, in one run.

    .venv/bin/python benchmarks/chunk_engine_bench.py [--dir DIR] [--total-mib 128] [--sizes-mib 1 4 16]
    .venv/bin/python benchmarks/chunk_engine_bench.py --partial [--writes 300] [--sizes-mib 4]

Writes are write_pending(full_replace)+commit with fsync=True (data fdatasync + two SQLite WAL
fsyncs) into fresh slots, then again as overwrites into the pooled slots (steady state), from page-aligned
memory as a chunk server receives it. Reads are loans (``lend``, what a chunk server sends reads of 256 KiB and
more from) and copies into one reused buffer (``read``), cold (pages dropped with POSIX_FADV_DONTNEED) and warm.

``--partial``: random 4 KiB writes into one chunk, each made durable before the next (write-through; and
write-back with a flush after each write, what a file fsynced after every write costs a replica), committed as the
chain commits (``durable=False``): writes per second and the bytes each sends to the disk (``write_bytes`` of
/proc/self/io: data, block slots and SQLite's WAL together).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from crc32c import crc32c

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvfs.chunkserver.engine import ChunkEngine, ChunkId  # noqa: E402
from kvfs.pool import page_aligned  # noqa: E402

MiB = 1 << 20


def rate(total: int, fn: Callable[[], None]) -> str:
    t = time.perf_counter()
    fn()
    return f"{total / (time.perf_counter() - t) / 1e9:6.2f} GB/s"


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench(root: Path, size: int, count: int) -> None:
    data = memoryview(page_aligned(size))
    data[:] = os.urandom(size)
    crc = crc32c(data)
    buf = memoryview(bytearray(size))
    total = size * count
    ids = [ChunkId(size, i) for i in range(count)]
    for direct_io in (True, False):
        with ChunkEngine(root / f"engine{size}-{direct_io}", direct_io=direct_io) as e:

            def write(version: int) -> None:
                for cid in ids:
                    e.write_pending(cid, version, 0, data, crc, full_replace=True, chunk_size=size)
                    e.commit(cid, version)

            def lend() -> None:
                for cid in ids:
                    e.lend(cid, 0, size, 2).release()

            def read() -> None:
                for cid in ids:
                    e.read(cid, 0, size, into=buf)

            def after_drop(fn: Callable[[], None]) -> str:
                for p in {e.local_location(c)[0] for c in ids}:
                    drop(p)
                return rate(total, fn)

            fresh = rate(total, lambda: write(1))
            steady = rate(total, lambda: write(2))
            # reads first: a loan maps the pages without direct I/O, and mapped pages cannot be dropped
            figures = (f"read cold {after_drop(read)} warm {rate(total, read)}  "
                       f"lend cold {after_drop(lend)} warm {rate(total, lend)}")
        print(f"{size // MiB:3d} MiB engine, {'direct  ' if direct_io else 'buffered'}  write+commit fresh {fresh}"
              f"  overwrite {steady}  {figures}")

    path = root / f"raw{size}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, total)

        def raw_write() -> None:
            for i in range(count):
                os.pwrite(fd, data, i * size)
                os.fdatasync(fd)

        def raw_read() -> None:
            for i in range(count):
                os.preadv(fd, [buf], i * size)

        fresh = rate(total, raw_write)
        steady = rate(total, raw_write)
        drop(path)
        cold = rate(total, raw_read)
        warm = rate(total, raw_read)
    finally:
        os.close(fd)
    print(f"{size // MiB:3d} MiB raw pwrite+fdatasync, buffered  fresh {fresh}  overwrite {steady}  "
          f"preadv cold {cold} warm {warm}")


def disk_bytes() -> int:
    """Bytes this process has sent to the block layer so far."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def bench_partial(root: Path, size: int, writes: int) -> None:
    rng = random.Random(25)
    base = memoryview(page_aligned(size))
    base[:] = os.urandom(size)
    small = memoryview(page_aligned(4096))
    cid = ChunkId(size, 0)
    for write_through in (True, False):
        with ChunkEngine(root / f"partial{size}-{write_through}", write_through=write_through) as e:
            e.write_pending(cid, 1, 0, base, crc32c(base), full_replace=True, chunk_size=size)
            e.commit(cid, 1)
            e.flush()
            before, t = disk_bytes(), time.perf_counter()
            for version in range(2, writes + 2):
                small[:] = os.urandom(4096)
                e.write_pending(cid, version, rng.randrange(0, size // 4096) * 4096, small, crc32c(small),
                                chunk_size=size)
                e.commit(cid, version, durable=False)
                if not write_through:
                    e.flush()
            elapsed, sent = time.perf_counter() - t, disk_bytes() - before
        mode = "write-through        " if write_through else "write-back+flush each"
        print(f"{size // MiB:3d} MiB chunk, 4 KiB random writes, {mode}: {writes / elapsed:7.0f} writes/s "
              f"{elapsed / writes * 1e3:6.2f} ms each, {sent / writes / 1024:7.0f} KiB to the disk per write")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="target directory (default: a temp dir)")
    ap.add_argument("--total-mib", type=int, default=128, help="bytes written per size")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=None, help="chunk sizes (default 1 4 16; 4 with --partial)")
    ap.add_argument("--partial", action="store_true", help="random 4 KiB writes into one chunk instead")
    ap.add_argument("--writes", type=int, default=300, help="writes per mode with --partial")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for size in args.sizes_mib or ([4] if args.partial else [1, 4, 16]):
            if args.partial:
                bench_partial(Path(d), size * MiB, args.writes)
            else:
                bench(Path(d), size * MiB, max(1, args.total_mib // size))


if __name__ == "__main__":
    main()
