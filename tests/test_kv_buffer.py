"""The SQLite engine's write buffer (kvfs/kv/buffer.py) against a plain dict that applies each write at once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs.kv.buffer import Atomic, WriteBuffer, apply_atomic

keys = st.binary(min_size=1, max_size=2).map(lambda b: bytes(x % 4 + 97 for x in b))  # few keys: many overlaps
values = st.binary(max_size=3)
ops = st.one_of(
    st.tuples(st.just("set"), keys, values),
    st.tuples(st.just("clear"), keys, st.none()),
    st.tuples(st.just("clear_range"), keys, keys),
    st.tuples(st.sampled_from(["add", "max"]), keys, st.integers(0, 1 << 64)),
)
UNIVERSE = sorted({bytes([a]) for a in b"abcd"} | {bytes([a, b]) for a in b"abcd" for b in b"abcd"})


def apply_to_dict(store: dict[bytes, bytes], op: str, a: bytes, b) -> None:
    if op == "set":
        store[a] = b
    elif op == "clear":
        store.pop(a, None)
    elif op == "clear_range":
        for k in [k for k in store if a <= k < b]:
            del store[k]
    else:
        store[a] = apply_atomic(op, store.get(a), b)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, values), st.lists(ops, max_size=30), keys, keys, st.booleans())
def test_reads_and_commit_match_writes_applied_in_order(snapshot, script, begin, end, reverse) -> None:
    buf, model = WriteBuffer(), dict(snapshot)
    for op, a, b in script:
        if op == "set":
            buf.set(a, b)
        elif op == "clear":
            buf.clear(a)
        elif op == "clear_range":
            buf.clear_range(a, b)
        else:
            buf.atomic(op, a, b)
        apply_to_dict(model, op, a, b)

    for k in UNIVERSE:
        assert buf.overlay_get(k, lambda k=k: snapshot.get(k)) == model.get(k)
    stored = sorted((k, v) for k, v in snapshot.items() if begin <= k < end)
    got = list(buf.overlay_range(begin, end, reverse, reversed(stored) if reverse else stored, snapshot.get))
    assert got == sorted(((k, v) for k, v in model.items() if begin <= k < end), reverse=reverse)

    ranges = buf.cleared  # what a commit applies: the cleared ranges first, then each key's latest write
    assert all(b < e for b, e in ranges) and all(e1 < b2 for (_, e1), (b2, _) in zip(ranges, ranges[1:]))
    committed = {k: v for k, v in snapshot.items() if not any(b <= k < e for b, e in ranges)}
    for k, w in buf.writes.items():
        w = w.apply(committed.get(k)) if isinstance(w, Atomic) else w
        if w is None:
            committed.pop(k, None)
        else:
            committed[k] = w
    assert committed == model
