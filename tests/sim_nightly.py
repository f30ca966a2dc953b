"""Nightly-sized CRAQ simulation: many seeds of every fault profile, failing seeds printed with the command that
replays each one. ``make test`` runs a few hundred seeds (tests/test_craq_sim.py); this runs as many as asked.

    nice -n 15 .venv/bin/python tests/sim_nightly.py --seeds 20000 --jobs 2
    .venv/bin/python tests/sim_nightly.py --start 5000 --seeds 1000 --profile harsh
    .venv/bin/python tests/sim_nightly.py --scan-every 0.025 --seeds 3000   # delayed retransmissions

Exit status 1 if any seed fails.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from kvfs.craq import sim


logging.disable(logging.ERROR)  # mgmtd's warnings of each recovering chain, thousands of runs over


def run_one(job: tuple[str, int, float]) -> tuple[str, int, list[str], collections.Counter[str]]:
    profile, seed, scan_every = job
    result = sim.run(seed, dataclasses.replace(sim.PROFILES[profile], retransmit_scan_every=scan_every))
    return profile, seed, sim.check(result), result.faults


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10000, help="seeds per profile (default 10000)")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--profile", action="append", choices=sorted(sim.PROFILES),
                    help="profile to run (repeatable; default: default, harsh, liveness)")
    ap.add_argument("--scan-every", type=float, default=0.0, help="members look for unacknowledged updates this often")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    args = ap.parse_args()
    profiles = args.profile or ["default", "harsh", "liveness"]
    jobs = [(p, s, args.scan_every) for p in profiles for s in range(args.start, args.start + args.seeds)]
    started = time.monotonic()
    failed: list[tuple[str, int]] = []
    faults: collections.Counter[str] = collections.Counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        for profile, seed, problems, seen in pool.map(run_one, jobs, chunksize=20):
            faults += seen
            if problems:
                failed.append((profile, seed))
                print(f"FAIL {profile} seed {seed}: replay with\n  KVFS_SIM_SCAN_EVERY={args.scan_every} "
                      f"KVFS_SIM_SEED={seed} .venv/bin/python -m pytest tests/test_craq_sim.py -k '{profile}-seed'\n  "
                      + "\n  ".join(problems), flush=True)
    print(f"{len(jobs)} runs ({', '.join(profiles)}; seeds {args.start}..{args.start + args.seeds - 1}) in "
          f"{time.monotonic() - started:.0f} s: {len(failed)} failed {failed}")
    print("faults seen: " + ", ".join(f"{k} {v}" for k, v in sorted(faults.items())))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
