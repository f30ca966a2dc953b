"""Streaming a new file through a write-only open against a read-write one, side by side on one directory.

    .venv/bin/python benchmarks/stream_write.py DIR [--size 2G] [--repeat 2]

DIR is usually a kvfs mount (``make up`` mounts one at ``./mnt``). Each pass writes a new file of ``--size``
in 1 MiB ``write`` calls, once opened ``O_WRONLY`` (how ``cp``, ``tar`` and checkpoint writers open, which the
kvfs mount serves around the page cache, fuse/README.md "Caching") and once ``O_RDWR`` (which keeps the page
cache), alternating which goes first, each after ``drop_caches`` when run as root. Printed per open mode: the
median MB/s to the end of ``close``, the writer's system CPU seconds, and how much the host's page cache grew
(``Cached`` less ``Shmem`` from /proc/meminfo, so the shared-memory buffers of kvfs's processes are left out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from fs_compare import parse_size

MIB = 1 << 20
MODES = {"O_WRONLY": os.O_WRONLY, "O_RDWR": os.O_RDWR}


def page_cache_mib() -> float:
    """File pages the host's page cache holds, in MiB (shared memory left out)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["Cached"].split()[0]) - int(fields["Shmem"].split()[0])) / 1024


def drop_caches() -> None:
    os.sync()
    if os.geteuid() == 0:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def write_file(path: Path, flags: int, size: int, block: bytes) -> tuple[float, float, float]:
    """(MB/s, system CPU seconds, page cache growth in MiB) of writing ``size`` bytes to a new file."""
    cache0, sys0, t0 = page_cache_mib(), os.times().system, time.perf_counter()
    fd = os.open(path, flags | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(size // len(block)):
            os.write(fd, block)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    return size / seconds / 1e6, os.times().system - sys0, page_cache_mib() - cache0


def describe(mode: str, figures: tuple[float, float, float] | list[float]) -> str:
    mbps, sys_s, cache = figures
    return f"{mode:8s} {mbps:7.0f} MB/s  sys {sys_s:5.2f} s  page cache +{cache:,.0f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--size", type=parse_size, default=parse_size("2G"), help="bytes per file (default 2G)")
    p.add_argument("--repeat", type=int, default=2, help="passes per open mode (default 2)")
    args = p.parse_args()
    size = args.size // MIB * MIB
    if size < MIB or args.repeat < 1:
        p.error("--size must be at least 1M and --repeat positive")
    if os.geteuid() != 0:
        print("not root: the page cache is not dropped between passes")
    block = os.urandom(MIB)
    results: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
    for i in range(args.repeat):
        order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
        for mode in order:
            path = args.directory / f"stream-write-{mode}"
            drop_caches()
            figures = write_file(path, MODES[mode], size, block)
            path.unlink()
            results[mode].append(figures)
            print(f"pass {i + 1} {describe(mode, figures)}")
    print(f"\n{size / MIB:,.0f} MiB per file, median of {args.repeat} passes:")
    medians = {mode: [statistics.median(f[k] for f in rows) for k in range(3)] for mode, rows in results.items()}
    for mode, figures in medians.items():
        print(f"  {describe(mode, figures)}")
    print(f"  O_WRONLY/O_RDWR: {medians['O_WRONLY'][0] / medians['O_RDWR'][0]:.2f}x")


if __name__ == "__main__":
    main()
