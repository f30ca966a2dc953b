"""Block-level copy-on-write in the chunk engine (chunkserver/engine.py, "Block-level copy-on-write"): a partial
write shares every block it leaves alone with the version before it, the engine matches a model of bytearrays
through any mix of writes, commits, aborts, removals, flushes and reopens, no slot is leaked or doubly used, and
a long run of small writes keeps the chunk's slot space within a quarter of its size."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from harness import assert_slots_accounted
from kvfs.chunkserver.engine import BLOCK, ChunkEngine, ChunkId

CS = 1 << 22  # 4 MiB: 64 blocks, the default chunk
CHUNKS = [ChunkId(5, 0), ChunkId(5, 1)]
SPAN = 24 * BLOCK  # writes land in the first 24 blocks, so a version keeps up to 6 overrides


def _runs(draw_cuts: list[int]) -> list[tuple[int, int]]:
    cuts = sorted(set(draw_cuts))
    return [(cuts[k], cuts[k + 1] - cuts[k]) for k in range(0, len(cuts) - 1, 2) if cuts[k + 1] > cuts[k]]


def _apply(old: bytes, runs: list[tuple[int, int]], data: bytes) -> bytes:
    new, at = bytearray(old), 0
    for start, n in runs:
        new.extend(bytes(max(0, start + n - len(new))))
        new[start : start + n] = data[at : at + n]
        at += n
    return bytes(new)


class EngineAgainstModel(RuleBasedStateMachine):
    """Each chunk's committed and pending versions against bytes; write-back, so flushes keep and release the
    synced fallback and unflushed versions' slots are reused at once."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvfs-blocks-"))
        self.engine = ChunkEngine(self.root, write_through=False)
        self.committed = {c: (0, b"") for c in CHUNKS}  # chunk -> (version, bytes)
        self.pending: dict[ChunkId, tuple[int, bytes]] = {}

    def _stage(self, cid: ChunkId, offset: int, data: bytes, new: bytes, **kw) -> None:
        version = max(self.committed[cid][0], self.pending.get(cid, (0, b""))[0]) + 1
        m = self.engine.write_pending(cid, version, offset, data, crc32c(data), chunk_size=CS, **kw)
        assert (m.length, m.crc) == (len(new), crc32c(new))
        self.pending[cid] = (version, new)

    @rule(cid=st.sampled_from(CHUNKS), cuts=st.lists(st.integers(0, SPAN), min_size=2, max_size=8))
    def write_partial(self, cid: ChunkId, cuts: list[int]) -> None:
        runs = _runs(cuts)
        if not runs:
            return
        data = os.urandom(sum(n for _, n in runs))
        self._stage(cid, runs[0][0], data, _apply(self.committed[cid][1], runs, data), extents=runs)

    @rule(cid=st.sampled_from(CHUNKS), n=st.integers(0, SPAN))
    def write_full(self, cid: ChunkId, n: int) -> None:
        data = os.urandom(n)
        self._stage(cid, 0, data, data, full_replace=True)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), durable=st.booleans())
    def commit(self, data: st.DataObject, durable: bool) -> None:
        cid = data.draw(st.sampled_from(sorted(self.pending)))
        self.engine.commit(cid, self.pending[cid][0], durable=durable)
        self.committed[cid] = self.pending.pop(cid)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.pending)))
        self.engine.abort(cid, self.pending.pop(cid)[0])

    @rule(cid=st.sampled_from(CHUNKS), n=st.integers(0, SPAN))
    def truncate(self, cid: ChunkId, n: int) -> None:
        if cid in self.pending:
            self.engine.abort(cid, self.pending.pop(cid)[0])
        version, old = self.committed[cid]
        self.engine.truncate(cid, n, version + 1)
        self.committed[cid] = (version + 1, old[:n] + bytes(max(0, n - len(old))))

    @rule(cid=st.sampled_from(CHUNKS))
    def remove(self, cid: ChunkId) -> None:
        self.engine.remove_from(cid.inode, cid.index)  # a truncation's tail: this chunk and those after it
        for c in CHUNKS:
            if c.index >= cid.index:
                self.committed[c] = (0, b"")
                self.pending.pop(c, None)

    @rule()
    def flush(self) -> None:
        self.engine.flush()

    @rule()
    def reopen(self) -> None:
        self.engine.close()
        self.engine = ChunkEngine(self.root, write_through=False)
        assert not self.engine.unclean_stop
        assert_slots_accounted(self.engine)

    @invariant()
    def matches_the_model(self) -> None:
        for cid in CHUNKS:
            m = self.engine.meta(cid)
            version, want = self.committed[cid]
            assert (m.version if m else 0) == version
            if version:
                assert bytes(self.engine.read(cid, 0, CS)[0]) == want
            if cid in self.pending:
                v, want = self.pending[cid]
                assert bytes(self.engine.read(cid, 0, CS, version=v)[0]) == want

    def teardown(self) -> None:
        self.engine.close()
        with ChunkEngine(self.root, write_through=False) as e:
            assert_slots_accounted(e)
        shutil.rmtree(self.root)


def test_engine_matches_the_model_through_partial_writes_flushes_and_reopens() -> None:
    run_state_machine_as_test(EngineAgainstModel, settings=settings(max_examples=30, stateful_step_count=40,
                                                                    deadline=None))


def _committed_random_chunk(e: ChunkEngine, c: ChunkId) -> bytearray:
    """Version 1 of ``c``, a whole chunk of random bytes, committed; the bytes, for a model of later writes."""
    model = bytearray(os.urandom(CS))
    e.write_pending(c, 1, 0, bytes(model), crc32c(model), chunk_size=CS, full_replace=True)
    e.commit(c, 1)
    return model


def _used(e: ChunkEngine) -> int:
    return e.space()[1]


def test_random_small_writes_keep_a_chunk_within_a_quarter_of_its_size_and_removed_space_is_reused(
        tmp_path: Path) -> None:
    """500 random 4 KiB writes to a 4 MiB chunk, committed as the chain does: after a flush the chunk's slots
    (its base and the block slots of its overrides) hold at most 1.25x its bytes, and a removed chunk's slots serve the next chunk without growing any slot file."""
    rng = random.Random(25)
    c = ChunkId(6, 0)
    with ChunkEngine(tmp_path / "t", write_through=False) as e:
        model = _committed_random_chunk(e, c)
        for version in range(2, 502):
            at, data = rng.randrange(0, CS - 4096), os.urandom(4096)
            model[at : at + 4096] = data
            e.write_pending(c, version, at, data, crc32c(data), chunk_size=CS)
            e.commit(c, version, durable=False)
            if version % 50 == 0:
                e.flush()
        e.flush()
        assert bytes(e.read(c, 0, CS)[0]) == bytes(model)
        assert _used(e) <= 1.25 * CS
        files = {p.name: p.stat().st_size for p in (tmp_path / "t" / "data").iterdir()}
        e.remove_files([c.inode])
        e.flush()
        assert _used(e) == 0
        again = ChunkId(7, 0)
        e.write_pending(again, 1, 0, bytes(model), crc32c(model), chunk_size=CS, full_replace=True)
        e.commit(again, 1)
        for version in range(2, 40):
            at, data = rng.randrange(0, CS - 4096), os.urandom(4096)
            e.write_pending(again, version, at, data, crc32c(data), chunk_size=CS)
            e.commit(again, version)
        e.flush()
        assert {p.name: p.stat().st_size for p in (tmp_path / "t" / "data").iterdir()} == files
    with ChunkEngine(tmp_path / "t", write_through=False) as e:
        assert_slots_accounted(e)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_changed_blocks_are_the_blocks_that_are_not_shared(data) -> None:
    """_changed_blocks looks only at the blocks the runs touch and those at the versions' ends: the same answer as
    asking about every block."""
    from kvfs.chunkserver.engine import _OLD, _block_kind, _changed_blocks, _nblocks, _Version
    from kvfs.chunkserver.slots import class_for

    old_len = data.draw(st.integers(1, 4 * BLOCK + 100))
    starts = sorted(data.draw(st.sets(st.integers(0, 5 * BLOCK), min_size=1, max_size=6)))
    runs, at = [], 0
    for start, nxt in zip(starts, starts[1:] + [6 * BLOCK]):
        length = data.draw(st.integers(1, nxt - start))
        runs.append((start, at, length))
        at += length
    new_len = max(old_len, max(s + n for s, _, n in runs))
    old = _Version(1, old_len, 0, [0] * _nblocks(old_len), class_for(old_len), 0, None, b"")
    everything = [b for b in range(_nblocks(new_len)) if _block_kind(runs, old_len, new_len, b)[0] != _OLD]
    fresh = _changed_blocks(old, runs, new_len)
    if fresh is not None:
        assert fresh == everything


def _random_4k_writes(e: ChunkEngine, c: ChunkId, model: bytearray, rng: random.Random, versions: range,
                      blocks: list[int] | None = None) -> None:
    """4 KiB writes committed and flushed one by one (a mount's fsync after each), into random blocks or
    ``blocks`` in turn; ``model`` follows them."""
    for k, version in enumerate(versions):
        block = blocks[k] if blocks else rng.randrange(CS // BLOCK)
        at, data = block * BLOCK + rng.randrange(0, BLOCK - 4096), os.urandom(4096)
        model[at : at + 4096] = data
        e.write_pending(c, version, at, data, crc32c(data), chunk_size=CS)
        e.commit(c, version, durable=False)
        e.flush()


def test_small_writes_fold_their_blocks_into_the_base_instead_of_copying_the_chunk(tmp_path: Path) -> None:
    """Once a version's block slots would reach a quarter of its blocks, a write whose base no reader holds and no
    other row reads there writes the blocks it keeps in block slots into the base in place (a fold: 64 KiB a
    block) rather than the whole chunk into a fresh base: the base never moves, the block slots stay under a
    quarter, the bytes are right, after a reopen too."""
    rng = random.Random(7)
    c = ChunkId(8, 0)
    with ChunkEngine(tmp_path / "t", write_through=False) as e:
        model = _committed_random_chunk(e, c)
        base = (e._entry(c).committed.cls, e._entry(c).committed.slot)
        for start in range(2, 202, 20):
            _random_4k_writes(e, c, model, rng, range(start, start + 20))
            v = e._entry(c).committed
            assert (v.cls, v.slot) == base and len(v.overrides) < CS // BLOCK // 4
        assert bytes(e.read(c, 0, CS)[0]) == bytes(model)
        assert _used(e) <= 1.25 * CS
    with ChunkEngine(tmp_path / "t", write_through=False) as e:
        assert bytes(e.read(c, 0, CS)[0]) == bytes(model)
        assert_slots_accounted(e)


def test_a_base_a_reader_holds_is_copied_not_folded_into(tmp_path: Path) -> None:
    """A short-circuit reader's location stays the bytes of the version it pinned while writes go on: the
    compaction that comes while it holds the pin writes a fresh base, and the pinned slot keeps its bytes."""
    rng = random.Random(8)
    c = ChunkId(9, 0)
    with ChunkEngine(tmp_path / "t", write_through=False) as e:
        model = _committed_random_chunk(e, c)
        e.flush()
        pinned, loc = bytes(model), e.pin_location(c, None, 0, CS)
        _random_4k_writes(e, c, model, rng, range(2, 40), blocks=list(range(38)))
        assert e._entry(c).committed.slot != loc.offset >> e._entry(c).committed.cls
        with open(loc.path, "rb") as f:
            f.seek(loc.offset)
            assert f.read(CS) == pinned
        loc.release()
        _random_4k_writes(e, c, model, rng, range(40, 80))
        assert bytes(e.read(c, 0, CS)[0]) == bytes(model)
