"""How long a full garbage collection stops a chunk server, by how many chunks it holds, with and without
``kvfs.service.freeze_after_full_collections`` (what every kvfs server process runs).

    .venv/bin/python benchmarks/gc_pause.py [--chunks 25000 100000 200000]

Builds, in this process, what a chunk server keeps per chunk: a chunk engine (write-back, in a temporary
directory) holding each chunk at one committed version, and a chain member (the middle of a chain of three)
that has seen each chunk's update persisted and acknowledged; 4 KiB chunks, so that only the count matters.
At each count it prints the objects the collector tracks, the process's resident memory per chunk held (what a
server's RAM must grow by with its disk), the pause of a full collection as Python runs it by default (median of
three), and the pause once a full collection has frozen its survivors, the steady state of a server: later full
collections walk only what was made since.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from crc32c import crc32c

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvfs.chunkserver.engine import ChunkEngine, PendingWrite  # noqa: E402
from kvfs.craq.member import ChainMember, Configure, Persisted, PersistPending  # noqa: E402
from kvfs.craq.messages import (  # noqa: E402
    AckStatus, ChainConfig, ChainTarget, ChunkId, TargetState, UpdateAck, UpdateReq,
)
from kvfs.crc import block_crcs  # noqa: E402
from kvfs.service import freeze_after_full_collections  # noqa: E402

BATCH = 256
CHUNKS_PER_INODE = 16


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def full_collection_ms() -> float:
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[25_000, 100_000, 200_000])
    args = parser.parse_args()
    data = os.urandom(4096)
    crc, blocks = crc32c(data), block_crcs(data)
    config = ChainConfig(1, 1, tuple(ChainTarget(t, t, TargetState.SERVING) for t in (1, 2, 3)))
    member = ChainMember(2, 1, None)
    member.handle(Configure(config, lease_until=float("inf")))
    print(f"{'chunks':>8} {'tracked objects':>15} {'RSS bytes/chunk':>15} {'full collection ms':>18}"
          f" {'after a freeze ms':>17}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVFS_BENCH_DIR")) as tmp:
        engine = ChunkEngine(Path(tmp), fsync=False, write_through=False, direct_io=False)
        held, empty = 0, resident_bytes()
        for target in sorted(args.chunks):
            gc.unfreeze()
            for first in range(held, target, BATCH):
                ids = [ChunkId(i // CHUNKS_PER_INODE + 1, i % CHUNKS_PER_INODE)
                       for i in range(first, min(target, first + BATCH))]
                engine.write_pending_many([PendingWrite(c, 1, 0, data, crc, True, block_crcs=blocks) for c in ids],
                                          chunk_size=1 << 22)
                engine.commit_many([(c, 1) for c in ids], durable=False)
                for c in ids:
                    update = UpdateReq(1, 1, c, 1, 1, 0, crc, full_replace=True, client_id=5, request_id=1, data=data)
                    for effect in member.handle(update):
                        if isinstance(effect, PersistPending):
                            member.handle(Persisted(c, 1, crc, len(data)))
                    member.handle(UpdateAck(1, 1, c, 3, 1, AckStatus.OK, 1, crc, len(data)))
            held = target
            tracked = len(gc.get_objects())
            default = statistics.median(full_collection_ms() for _ in range(3))
            freeze_after_full_collections()
            gc.collect()  # freezes what it finds alive
            frozen = statistics.median(full_collection_ms() for _ in range(3))
            gc.callbacks.clear()
            per_chunk = (resident_bytes() - empty) / target
            print(f"{target:>8} {tracked:>15,} {per_chunk:>15,.0f} {default:>18.1f} {frozen:>17.2f}")
        engine.close()


if __name__ == "__main__":
    main()
