#!/usr/bin/env python3
"""Memory of a ``kvfs up`` cluster while 1 GiB is written and read through its mount, and after.

    sudo .venv/bin/python benchmarks/memory_pss.py [--size 1G] [--after 0,5,10] [--up-arg=--memory-mb=1024]

Brings up a fresh cluster (``kvfs up``: mgmtd, meta, 3 chunk servers, replicas 3, the mount) in a temp dir,
writes a new file of ``--size`` in 1 MiB ``write`` calls through a write-only open (how ``cp`` writes) and
fsyncs it, drops the page cache, reads it back in 1 MiB reads, and samples every process of the cluster
(``/proc/PID/smaps_rollup``: ``Pss`` and its part ``Pss_Shmem``; ``/proc/PID/status``: ``RssShmem``) about five times a
second meanwhile. It prints, per process, the peak PSS during the write and during the read and the PSS
``--after`` seconds after the read ended (Pss_Shmem and RssShmem beside each), and the same summed over the
cluster. PSS
splits each page among the processes that map it, so the cluster's sum counts a shared-memory page once.
``--up-arg`` passes options to ``kvfs up`` (repeatable). Needs root (FUSE, ``drop_caches``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fs_compare import parse_size

from kvfs.fuse.mount import is_mounted

REPO = Path(__file__).resolve().parents[1]
KVFS = [sys.executable, "-m", "kvfs"]
MIB = 1 << 20
BLOCK = MIB


def memory_of(pid: int) -> tuple[int, int, int] | None:
    """(PSS, its shared-memory part Pss_Shmem, RssShmem) of ``pid`` in bytes, or None once it is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = {}
    for line in (*rollup.splitlines(), *status.splitlines()):
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key] = int(parts[0]) << 10
    return fields.get("Pss", 0), fields.get("Pss_Shmem", 0), fields.get("RssShmem", 0)


class Sampler:
    """Samples every process's memory in a thread; ``phase`` names what the samples are taken during."""

    def __init__(self, pids: dict[str, int], interval: float = 0.2) -> None:
        self.pids = pids
        self.interval = interval
        self.phase = "idle"
        self.peaks: dict[str, dict[str, tuple[int, int, int]]] = {}  # phase -> name (or "sum") -> figures at peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict[str, tuple[int, int, int]]:
        now = {name: m for name, pid in self.pids.items() if (m := memory_of(pid)) is not None}
        now["sum"] = tuple(sum(column) for column in zip(*now.values()))
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now, peaks = self.sample(), self.peaks.setdefault(self.phase, {})
            for name, figures in now.items():
                if figures[0] > peaks.get(name, (0, 0, 0))[0]:
                    peaks[name] = figures

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def write_file(path: Path, size: int) -> float:
    block = os.urandom(BLOCK)
    start = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(size // BLOCK):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size / (time.monotonic() - start) / 1e6


def read_file(path: Path) -> float:
    buf = bytearray(BLOCK)
    total, start = 0, time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total / (time.monotonic() - start) / 1e6


def mib(n: int) -> str:
    return f"{n / MIB:5.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="bytes to write and read back (default 1G)")
    parser.add_argument("--after", default="0,5,10", help="seconds after the read to sample (default 0,5,10)")
    parser.add_argument("--up-arg", action="append", default=[], help="an option for kvfs up (repeatable)")
    parser.add_argument("--work", default="/tmp", help="where the temp cluster directory goes (default /tmp)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (FUSE mount, drop_caches)")
    size = parse_size(args.size) // BLOCK * BLOCK
    after = sorted(float(x) for x in args.after.split(","))
    base = Path(tempfile.mkdtemp(prefix="memory_pss-", dir=args.work))
    data, mnt = base / "data", base / "mnt"
    try:
        subprocess.run([*KVFS, "up", "--data", str(data), "--mount", str(mnt), *args.up_arg], check=True,
                       cwd=REPO, stdout=subprocess.DEVNULL, timeout=180)
        pids = {p.stem: int(p.read_text()) for p in sorted((data / "run").glob("*.pid"))}
        sampler = Sampler(pids)
        rows: dict[str, dict[str, tuple[int, int, int]]] = {}
        with sampler:
            rows["idle"] = sampler.sample()
            sampler.phase = "write"
            write_mbs = write_file(mnt / "big", size)
            sampler.phase = "drop"
            drop_caches()
            sampler.phase = "read"
            read_mbs = read_file(mnt / "big")
            end = time.monotonic()
            sampler.phase = "after"
            for t in after:
                time.sleep(max(0.0, end + t - time.monotonic()))
                rows[f"+{t:g}s"] = sampler.sample()
        rows["write peak"] = sampler.peaks.get("write", {})
        rows["read peak"] = sampler.peaks.get("read", {})
        order = ["idle", "write peak", "read peak", *(f"+{t:g}s" for t in after)]
        names = [*pids, "sum"]
        print(f"kvfs up {' '.join(args.up_arg)}: wrote {size >> 20} MiB at {write_mbs:.0f} MB/s, read at "
              f"{read_mbs:.0f} MB/s")
        print("PSS / Pss_Shmem / RssShmem in MiB (peaks: the sample with the highest PSS of that process, or of the sum)")
        print(f"{'process':>8} " + " ".join(f"{o:>23}" for o in order))
        for name in names:
            cells = []
            for o in order:
                pss, pss_shmem, rss_shmem = rows[o].get(name, (0, 0, 0))
                cells.append(f"{mib(pss)} /{mib(pss_shmem)} /{mib(rss_shmem)}")
            print(f"{name:>8} " + " ".join(cells))
    finally:
        subprocess.run([*KVFS, "down", "--data", str(data)], cwd=REPO, stdout=subprocess.DEVNULL, timeout=120)
        if not is_mounted(str(mnt)):  # never remove through a live mount: that would delete cluster data
            subprocess.run(["rm", "-rf", str(base)])


if __name__ == "__main__":
    main()
