"""Resync and repair by changed blocks (chunkserver/engine.py ``write_delta``, ``repair_blocks``; kvfs/crc.py
``changed_blocks``): a copy made of only the blocks that differ from the receiver's copy is byte for byte the
sender's version, it checks every block it keeps, and it stages nothing when its base or its result is wrong."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_slots_accounted
from kvfs.chunkserver.engine import BLOCK, ChunkEngine, ChunkId, StaleVersion
from kvfs.crc import block_crcs, block_runs, changed_blocks
from kvfs.errors import ChecksumMismatch, KvfsError

CS = 1 << 22
C = ChunkId(9, 0)


def commit(e: ChunkEngine, version: int, offset: int, data: bytes, **kw) -> None:
    e.write_pending(C, version, offset, data, crc32c(data), chunk_size=CS, **kw)
    e.commit(C, version)


def content(e: ChunkEngine) -> bytes:
    return bytes(e.read(C, 0, CS)[0])


def delta(src: ChunkEngine, dst: ChunkEngine) -> tuple[list[int], list[tuple[int, int]], bytearray]:
    """What a resync sends from ``src``'s committed version to ``dst``: the changed blocks, their runs, their bytes."""
    version = src.meta(C).version
    length, ours = src.version_blocks(C, version)
    base = dst.meta(C)
    theirs = dst.version_blocks(C, base.version) if base and base.version else (0, [])
    changed = changed_blocks(ours, length, theirs[1], theirs[0])
    runs = block_runs(changed, length)
    return changed, runs, src.read_runs(C, version, runs)


def apply_delta(src: ChunkEngine, dst: ChunkEngine, runs: list[tuple[int, int]], data: bytes, *,
                base: int | None = None) -> None:
    meta = src.meta(C)
    base = (dst.meta(C).version if dst.meta(C) else 0) if base is None else base
    dst.write_delta(C, meta.version, base, meta.length, meta.crc, data, crc32c(data), runs)
    dst.commit(C, meta.version)


def corrupt_block(e: ChunkEngine, b: int) -> None:
    """Flip a byte of block ``b`` of C's committed version where it lies on disk (its base: no overrides)."""
    path, off, _, _ = e.local_location(C)
    with open(path, "r+b") as f:
        f.seek(off + b * BLOCK + 5)
        byte = f.read(1)
        f.seek(off + b * BLOCK + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def pair(tmp_path: Path):
    with ChunkEngine(tmp_path / "src", fsync=False) as src, ChunkEngine(tmp_path / "dst", fsync=False) as dst:
        yield src, dst


def same_chunk(pair: tuple[ChunkEngine, ChunkEngine], version: int, size: int) -> bytes:
    """Commit one random chunk of ``size`` bytes as ``version`` on both engines (replicas in step); returns it."""
    chunk = os.urandom(size)
    for e in pair:
        commit(e, version, 0, chunk)
    return chunk


def test_a_few_small_writes_cross_as_their_blocks_and_make_the_same_version(pair) -> None:
    src, dst = pair
    same_chunk(pair, 1, CS)
    for v, at in enumerate((5, 3 * BLOCK + 100, 40 * BLOCK - 2), start=2):  # the last straddles two blocks
        commit(src, v, at, os.urandom(4096))
    changed, runs, data = delta(src, dst)
    assert changed == [0, 3, 39, 40] and len(data) == 4 * BLOCK
    apply_delta(src, dst, runs, data)
    assert content(dst) == content(src) and dst.meta(C) == src.meta(C)
    assert dst.space()[1] == CS + 4 * BLOCK  # the new version shares the other 60 blocks with the old one
    assert_slots_accounted(dst)


def test_a_kept_block_that_is_corrupt_on_disk_fails_the_delta_and_a_whole_copy_repairs(pair) -> None:
    src, dst = pair
    same_chunk(pair, 1, CS)
    commit(src, 2, 0, b"new")
    corrupt_block(dst, 7)  # its CRC in the row still matches the sender's: only a read can tell
    _, runs, data = delta(src, dst)
    with pytest.raises(ChecksumMismatch):
        apply_delta(src, dst, runs, data)
    assert dst.versions(C)[1] is None and dst.meta(C).version == 1  # nothing staged
    whole = content(src)
    dst.replace_full(C, 2, whole, crc32c(whole))
    assert content(dst) == whole
    assert_slots_accounted(dst)


def test_a_delta_made_against_another_version_or_with_wrong_blocks_stages_nothing(pair) -> None:
    src, dst = pair
    chunk = same_chunk(pair, 1, 2 * BLOCK)
    commit(src, 2, 0, b"x" * 10)
    _, runs, data = delta(src, dst)
    with pytest.raises(StaleVersion):  # the receiver's copy moved on since it listed v0
        apply_delta(src, dst, runs, data, base=0)
    wrong = bytes(len(data))
    with pytest.raises(ChecksumMismatch):  # blocks that do not make the sender's version
        apply_delta(src, dst, runs, wrong)
    with pytest.raises(KvfsError, match="whole blocks") as refused:
        dst.write_delta(C, 2, 1, 2 * BLOCK, 0, b"ab", crc32c(b"ab"), [(1, 2)])
    assert refused.value.errno == errno.EINVAL
    assert dst.versions(C)[1] is None and content(dst) == chunk
    assert_slots_accounted(dst)


def test_repair_fetches_only_the_bad_blocks_and_keeps_the_version(pair) -> None:
    src, dst = pair
    chunk = same_chunk(pair, 3, CS)
    corrupt_block(dst, 2)
    corrupt_block(dst, 50)
    version, bad = dst.bad_blocks(C)
    assert (version, bad) == (3, [2, 50])
    runs = block_runs(bad, CS)
    blocks = src.read_runs(C, 3, runs)
    with pytest.raises(ChecksumMismatch):  # only block 2 fetched: block 50 is still bad, so nothing changes
        dst.repair_blocks(C, 3, blocks[:BLOCK], crc32c(blocks[:BLOCK]), runs[:1])
    dst.repair_blocks(C, 3, blocks, crc32c(blocks), runs)
    assert content(dst) == chunk and dst.meta(C).version == 3 and dst.bad_blocks(C) == (3, [])
    with pytest.raises(StaleVersion):
        dst.repair_blocks(C, 2, blocks, crc32c(blocks), runs)
    assert_slots_accounted(dst)


@settings(max_examples=40, deadline=None)
@given(
    theirs=st.binary(max_size=6 * BLOCK + 7),
    edits=st.lists(st.tuples(st.integers(0, 7 * BLOCK), st.binary(min_size=1, max_size=BLOCK + 3)), max_size=4),
    cut=st.none() | st.integers(0, 7 * BLOCK),
)
def test_any_receiver_copy_plus_the_changed_blocks_is_the_sender_s_version(theirs: bytes, edits, cut) -> None:
    """Related copies (the sender's version is the receiver's with writes and a truncation on top) and, with no
    edits and no cut, equal ones; the receiver ends with the sender's bytes, CRCs and length."""
    ours = bytearray(theirs)
    for at, data in edits:
        ours.extend(bytes(max(0, at + len(data) - len(ours))))
        ours[at : at + len(data)] = data
    if cut is not None:
        ours = ours[:cut] + bytes(max(0, cut - len(ours)))
    ours = bytes(ours)
    with tempfile.TemporaryDirectory() as tmp, ChunkEngine(Path(tmp) / "src", fsync=False) as src, \
            ChunkEngine(Path(tmp) / "dst", fsync=False) as dst:
        commit(src, 2, 0, ours)
        if theirs:
            commit(dst, 1, 0, theirs)
        changed, runs, data = delta(src, dst)
        assert len(changed) <= len(block_crcs(ours))
        apply_delta(src, dst, runs, data)
        assert content(dst) == ours and dst.version_blocks(C, 2) == src.version_blocks(C, 2)
        assert_slots_accounted(dst)
