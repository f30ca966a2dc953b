"""Kill -9 a process that writes chunk versions at random instants; every reopen must find each
chunk at exactly one complete committed version, never older than the last one it reported.

In write-back mode the child acknowledges versions before they are on disk and syncs now and then: the
checker then also plays a power loss, tearing the data of versions staged since the last sync, and the
reopened engine must fall back to complete versions no older than the last sync. With held writes (write-back
with ``hold_bytes``) the kill alone loses the whole versions held in memory, with the same fallback.

Versions come from whole-chunk replaces, single writes, truncations, writes of several runs (a client's
gathered scattered writes, most of them parts of blocks) and resync deltas (a single write's change sent as the
whole blocks that differ from the committed version, ``write_delta``). Chunks grow to 16 blocks, so most partial writes make
versions with overrides (block slots shared with the version before) and every few a compaction writes a fresh
base; after every reopen each slot must be named by a row or free, never both, never leaked.

Run as a script, this file is the child: ``python test_chunk_engine_crash.py ROOT [write-back|held]``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from crc32c import crc32c

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvfs.chunkserver.engine import BLOCK, ChunkEngine, ChunkId, PendingWrite  # noqa: E402
from kvfs.crc import block_crcs, block_runs, changed_blocks  # noqa: E402
from harness import assert_slots_accounted, tear_unsynced  # noqa: E402

CHUNKS = [ChunkId(3, i) for i in range(4)]
CS = 1 << 20


def op(k: int, v: int) -> tuple[str, int, int]:
    """The write that makes version ``v`` of chunk ``k``: the same in the child and the checker."""
    rng = random.Random(f"{k}:{v}")
    kind = rng.choice(["full", "write", "write", "write", "runs", "runs", "trunc", "delta"])
    if kind in ("write", "delta"):
        return kind, rng.randrange(0, 14 * BLOCK), rng.randrange(1, 2 * BLOCK)
    return kind, 0, rng.randrange(0, 16 * BLOCK)


def runs(k: int, v: int) -> list[tuple[int, int]]:
    """The runs of a "runs" version: up to four, sorted and apart, from one byte to half a block each."""
    rng = random.Random(f"{k}:{v}:runs")
    starts = sorted(rng.sample(range(0, 15 * BLOCK, BLOCK // 2), rng.randint(1, 4)))
    return [(start + rng.randrange(0, 64), rng.randrange(1, BLOCK // 2 - 64)) for start in starts]


def payload(v: int, n: int) -> bytes:
    return bytes([v % 251 + 1]) * n  # never 0, so zero fill is told apart


def apply(k: int, v: int, old: bytes) -> bytes:
    kind, off, n = op(k, v)
    if kind == "full":
        return payload(v, n)
    if kind == "trunc":
        return old[:n] + bytes(max(0, n - len(old)))
    new = bytearray(old)
    for start, length in runs(k, v) if kind == "runs" else [(off, n)]:
        new.extend(bytes(max(0, start + length - len(new))))
        new[start : start + length] = payload(v, length)
    return bytes(new)


def child(root: Path, mode: str) -> None:
    batched = mode.endswith("+batch")  # a round's whole and partial writes as one write_pending_many/commit_many
    mode = mode.removesuffix("+batch")
    write_back = mode != "write-through"
    sys.stdout.write("open\n")  # the parent's kill window starts here, not at the spawn: imports take a while
    sys.stdout.flush()
    # room for a few whole versions (up to 16 blocks each): some wait for a sync, some are written to make room
    e = ChunkEngine(root, write_through=not write_back, hold_bytes=40 * BLOCK if mode == "held" else 0)
    out = threading.Lock()

    def say(line: str) -> None:
        with out:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def syncer() -> None:  # syncs while writes go on, as a chunk server's flushes do
        while True:
            say("presync")  # every version reported before this line is covered by the sync that follows
            e.flush()
            say("sync")
            time.sleep(random.uniform(0, 0.02))

    for cid in CHUNKS:  # resolve leftovers from the last crash the way a replication layer may
        m = e.meta(cid)
        if m is not None and m.pending_version is not None:
            e.abort(cid, m.pending_version)
    if write_back:
        threading.Thread(target=syncer, daemon=True).start()
    while True:
        batch: list[tuple[int, PendingWrite]] = []
        for k, cid in enumerate(CHUNKS):
            m = e.meta(cid)
            v = (m.version if m else 0) + 1
            kind, off, n = op(k, v)
            if kind == "trunc":
                e.truncate(cid, n, v)
            elif kind == "delta":
                old = bytes(e.read(cid, 0, CS)[0]) if m and m.version else b""
                new = apply(k, v, old)
                extents = block_runs(changed_blocks(block_crcs(new), len(new), block_crcs(old), len(old)), len(new))
                data = b"".join(new[start : start + length] for start, length in extents)
                e.write_delta(cid, v, v - 1, len(new), crc32c(new), data, crc32c(data), extents)
                e.commit(cid, v, durable=v % 2 == 0)
            else:
                extents = runs(k, v) if kind == "runs" else None
                if extents:
                    off, n = extents[0][0], sum(length for _, length in extents)
                data = payload(v, n)
                if batched:
                    batch.append((k, PendingWrite(cid, v, off, data, crc32c(data), kind == "full", extents=extents)))
                    continue
                e.write_pending(cid, v, off, data, crc32c(data), full_replace=kind == "full", chunk_size=CS,
                                extents=extents)
                e.commit(cid, v, durable=v % 2 == 0)  # as the chain commits (no fsync), and durably
            say(f"{k} {v}")
        if batch:
            staged = e.write_pending_many([w for _, w in batch], chunk_size=CS)
            assert not any(isinstance(r, Exception) for r in staged), staged
            committed = e.commit_many([(w.chunk_id, w.version) for _, w in batch], durable=random.random() < 0.5)
            assert not any(isinstance(r, Exception) for r in committed), committed
            for k, w in batch:
                say(f"{k} {w.version}")


def _read_lines(stream: IO[bytes], lines: list[bytes], started: threading.Event) -> None:
    """Collect the child's lines; ``started`` once the first has come."""
    for line in stream:
        lines.append(line)
        started.set()


class Model:
    def __init__(self) -> None:
        self.versions = {k: [b""] for k in range(len(CHUNKS))}

    def content(self, k: int, v: int) -> bytes:
        history = self.versions[k]
        while len(history) <= v:
            history.append(apply(k, len(history), history[-1]))
        return history[v]


def check(root: Path, reported: dict[int, int], model: Model) -> None:
    with ChunkEngine(root, fsync=False) as e:
        assert_slots_accounted(e)
        for k, cid in enumerate(CHUNKS):
            m = e.meta(cid)
            if m is None:
                assert reported.get(k, 0) == 0
                continue
            assert m.version >= reported.get(k, 0), (k, m, reported)
            want = model.content(k, m.version)
            got = bytes(e.read(cid, 0, CS)[0]) if m.version else b""
            assert got == want and (m.length, m.crc) == (len(want), crc32c(want)), (k, m)
            if m.pending_version is not None:
                assert m.pending_version == m.version + 1, m
                want = model.content(k, m.pending_version)
                assert bytes(e.read(cid, 0, CS, version=m.pending_version)[0]) == want


@pytest.mark.parametrize("mode", ["write-through", "write-back", "held", "write-through+batch", "write-back+batch"],
                         ids=["write-through", "write-back+power-loss", "write-back+held", "write-through+batch",
                              "write-back+power-loss+batch"])
def test_sigkill_at_random_instants(tmp_path: Path, mode: str) -> None:
    """Also with a round's writes of several chunks staged and committed as batches (each one transaction):
    every chunk still comes back at its old or its new version."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    model, reported, synced, covered, commits = Model(), {}, {}, {}, 0
    deadline = time.monotonic() + 20
    for _ in range(20):
        if time.monotonic() > deadline:
            break
        argv = [sys.executable, __file__, str(tmp_path), mode]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
        lines: list[bytes] = []
        started = threading.Event()
        reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines, started))
        reader.start()
        started.wait(60)  # the child is past its imports (on a loaded machine, past the window below)
        time.sleep(rng.uniform(0.1, 0.8))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join()
        for line in lines:
            if line == b"open\n":
                continue
            if line == b"presync\n":
                covered = dict(reported)
            elif line == b"sync\n":
                synced = covered
            elif line.endswith(b"\n"):
                k, v = map(int, line.split())
                reported[k] = v
                commits += 1
        if mode.removesuffix("+batch") == "write-back":
            tear_unsynced(tmp_path, rng)
        if not mode.startswith("write-through"):
            reported = dict(synced)  # what survives a power loss, or a kill with held writes: what a sync covered
        check(tmp_path, reported, model)
        synced = dict(reported)  # the reopen synced what it kept
    assert commits > 0



@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_reopen_tells_an_unclean_stop_from_a_clean_one(tmp_path: Path, mode: str) -> None:
    """A write-back target killed while writing may have lost acknowledged writes, and says so on reopen (the
    chunk server's heartbeats carry it to mgmtd); a clean close, a new target or write-through does not."""
    write_through = mode == "write-through"
    with ChunkEngine(tmp_path, write_through=write_through) as e:
        assert not e.unclean_stop  # a new target lost nothing
    proc = subprocess.Popen([sys.executable, __file__, str(tmp_path), mode], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"open\n"
    assert proc.stdout.readline()  # its engine is open: it has synced or written a version
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    e = ChunkEngine(tmp_path, write_through=write_through)
    assert e.unclean_stop is not write_through
    e.close()
    with ChunkEngine(tmp_path, write_through=write_through) as e:
        assert not e.unclean_stop  # the close above was clean


if __name__ == "__main__":
    child(Path(sys.argv[1]), sys.argv[2])
