"""DirtyRuns, the mount's gathered scattered writes: whatever order writes come in, the runs hold exactly the
last bytes written at every offset, never overlap or touch, and never cross a chunk."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs.fuse.writes import DirtyRuns

CHUNK = 256
SPACE = 4 * CHUNK

writes = st.lists(
    st.tuples(st.integers(0, SPACE - 1), st.integers(1, CHUNK + 40), st.integers(1, 255)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(writes)
def test_runs_hold_the_last_write_of_every_byte(ops: list[tuple[int, int, int]]) -> None:
    runs = DirtyRuns(CHUNK)
    model: dict[int, int] = {}
    for off, n, byte in ops:
        runs.add(off, bytes([byte]) * n)
        model.update((off + i, byte) for i in range(n))
    seen: dict[int, int] = {}
    for index, (starts, pieces) in runs.chunks.items():
        assert starts == sorted(starts)
        for k, (start, piece) in enumerate(zip(starts, pieces)):
            assert piece and start // CHUNK == (start + len(piece) - 1) // CHUNK == index
            if k:
                assert starts[k - 1] + len(pieces[k - 1]) < start  # neither overlapping nor touching
            seen.update((start + i, b) for i, b in enumerate(piece))
    assert seen == model
    assert runs.size == len(model)
    assert runs.overlaps(min(model), max(model) + 1)
    assert runs.bounds() == (min(model), max(model) + 1)
    gaps = [x for x in range(SPACE + CHUNK) if x not in model]
    assert all(not runs.overlaps(x, x + 1) for x in gaps)


@settings(max_examples=300, deadline=None)
@given(writes, st.lists(st.tuples(st.integers(0, SPACE + CHUNK), st.integers(0, 3 * CHUNK)), min_size=1, max_size=10))
def test_a_read_sees_the_runs_over_what_storage_holds(ops: list[tuple[int, int, int]],
                                                      reads: list[tuple[int, int]]) -> None:
    """What a read of the mount lays over storage's bytes (``copy_into``), and whether it needs to (``overlaps``),
    for any range, the whole file's (``sys.maxsize``) included."""
    runs = DirtyRuns(CHUNK)
    model = bytearray(SPACE + 4 * CHUNK)  # storage's bytes: zeros
    written: set[int] = set()
    for off, n, byte in ops:
        runs.add(off, bytes([byte]) * n)
        model[off:off + n] = bytes([byte]) * n
        written.update(range(off, off + n))
    assert runs.overlaps(0, sys.maxsize)
    for off, n in reads:
        assert runs.overlaps(off, off + n) == any(off <= x < off + n for x in written)
        out = bytearray(n)
        runs.copy_into(memoryview(out), off)
        assert out == model[off:off + n]
