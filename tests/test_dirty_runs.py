"""DirtyRuns, the mount's gathered scattered writes: whatever order writes come in, the runs hold exactly the
last bytes written at every offset, never overlap or touch, and never cross a chunk."""

from __future__ import annotations

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
