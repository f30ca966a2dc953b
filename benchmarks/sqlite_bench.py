"""SQLite on a directory: transactions per second of a small-update workload, the way a service keeping its
state in SQLite on the mount meets kvfs.

    .venv/bin/python benchmarks/sqlite_bench.py DIR [DIR ...] [--seconds 8] [--rows 20000] [--cache-kib 256 2000]

For each DIR (a kvfs mount, a local directory, another file system's mount), each journal mode (rollback
``delete`` and ``wal``, both ``synchronous=FULL``: every commit is fsynced) and each page-cache size, it fills a
table of ``--rows`` rows of 200 bytes, then for ``--seconds`` runs transactions that each update 10 random rows
and insert one, and prints transactions per second with p50 and p99 commit latencies. A small cache makes
SQLite re-read pages it wrote a moment ago, which on a mount that gathers small writes reads them while they are
still only in the mount.
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import time
from pathlib import Path


def run(directory: Path, mode: str, cache_kib: int, rows: int, seconds: float) -> tuple[float, float, float]:
    path = directory / f"sqlite-bench-{os.getpid()}-{mode}-{cache_kib}.db"
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute(f"PRAGMA journal_mode={mode}")
        db.execute("PRAGMA synchronous=FULL")
        db.execute(f"PRAGMA cache_size=-{cache_kib}")
        db.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB NOT NULL)")
        rng = random.Random(1)
        db.execute("BEGIN")
        db.executemany("INSERT INTO t VALUES (?, ?)", ((i, rng.randbytes(200)) for i in range(rows)))
        db.execute("COMMIT")
        latencies = []
        next_id = rows
        end = time.perf_counter() + seconds
        while (start := time.perf_counter()) < end:
            db.execute("BEGIN")
            for _ in range(10):
                db.execute("UPDATE t SET v = ? WHERE id = ?", (rng.randbytes(200), rng.randrange(next_id)))
            db.execute("INSERT INTO t VALUES (?, ?)", (next_id, rng.randbytes(200)))
            next_id += 1
            db.execute("COMMIT")
            latencies.append(time.perf_counter() - start)
        ok = db.execute("PRAGMA integrity_check").fetchone()[0]
        if ok != "ok":
            raise SystemExit(f"{path}: integrity_check says {ok}")
    finally:
        db.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
    latencies.sort()
    return (len(latencies) / seconds, statistics.median(latencies) * 1e3,
            latencies[int(len(latencies) * 0.99)] * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--cache-kib", type=int, nargs="+", default=[256, 2000])
    args = parser.parse_args()
    print(f"{'directory':40} {'journal':7} {'cache KiB':>9} {'txn/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for mode in ("delete", "wal"):
        for cache in args.cache_kib:
            for directory in args.dirs:
                rate, p50, p99 = run(directory, mode, cache, args.rows, args.seconds)
                print(f"{str(directory):40} {mode:7} {cache:9} {rate:8.1f} {p50:8.2f} {p99:8.2f}", flush=True)


if __name__ == "__main__":
    main()
