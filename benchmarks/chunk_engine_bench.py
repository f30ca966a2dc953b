"""Chunk engine throughput, with direct I/O (the default) and through the page cache, beside plain
pwrite+fdatasync / preadv of the same sizes, in one run.

    .venv/bin/python benchmarks/chunk_engine_bench.py [--dir DIR] [--total-mib 128] [--sizes-mib 1 4 16]

Writes are write_pending(full_replace)+commit with fsync=True (data fdatasync + two SQLite WAL
fsyncs) into fresh slots, then again as overwrites into the pooled slots (steady state), from page-aligned
memory as a chunk server receives it. Reads are loans (``lend``, what a chunk server sends reads of 256 KiB and
more from) and copies into one reused buffer (``read``), cold (pages dropped with POSIX_FADV_DONTNEED) and warm.
"""

from __future__ import annotations

import argparse
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="target directory (default: a temp dir)")
    ap.add_argument("--total-mib", type=int, default=128, help="bytes written per size")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for size in args.sizes_mib:
            bench(Path(d), size * MiB, max(1, args.total_mib // size))


if __name__ == "__main__":
    main()
