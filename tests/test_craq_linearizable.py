"""The register checker accepts linearizable histories and catches the anomalies CRAQ must prevent."""

import itertools

from hypothesis import given, settings, strategies as st

from kvfs.craq.linearizable import Op, check_register


def w(value: bytes, start: float, end: float | None) -> Op:
    return Op("write", value, start, end)


def r(value: bytes, start: float, end: float) -> Op:
    return Op("read", value, start, end)


def test_sequential_history_is_linearizable():
    assert check_register([w(b"a", 0, 1), r(b"a", 2, 3), w(b"b", 4, 5), r(b"b", 6, 7)])


def test_concurrent_read_may_see_old_or_new():
    assert check_register([w(b"a", 0, 1), w(b"b", 2, 6), r(b"a", 3, 4), r(b"b", 4.5, 5)])


def test_a_read_that_un_sees_a_write_is_caught():
    assert not check_register([w(b"a", 0, 1), w(b"b", 2, 6), r(b"b", 3, 4), r(b"a", 4.5, 5)])


def test_stale_read_after_acknowledged_write_is_caught():
    assert not check_register([w(b"a", 0, 1), w(b"b", 2, 3), r(b"a", 4, 5)])


def test_read_of_initial_value_after_a_write_is_caught():
    assert not check_register([w(b"a", 0, 1), r(b"", 2, 3)])


def test_unanswered_write_may_take_effect_late_or_never():
    assert check_register([w(b"a", 0, None), r(b"", 1, 2), r(b"a", 10, 11)])
    assert check_register([w(b"a", 0, None), w(b"b", 1, 2), r(b"b", 3, 4)])
    assert check_register([w(b"a", 0, None), w(b"b", 1, 2), r(b"a", 3, 4)])  # retried and applied late


def test_unanswered_write_takes_effect_at_most_once():
    assert not check_register([w(b"a", 0, None), w(b"b", 1, 2), r(b"a", 3, 4), r(b"b", 5, 6), r(b"a", 7, 8)])


def test_read_of_a_value_never_written_is_caught():
    assert not check_register([w(b"a", 0, 1), r(b"zz", 2, 3)])


def _brute_force(ops: list[Op]) -> bool:
    """Try every order of every allowed subset (unanswered writes may be left out)."""
    ops = [o for o in ops if o.kind == "write" or o.response is not None]
    optional = [o for o in ops if o.response is None]
    for k in range(len(optional) + 1):
        for left_out in itertools.combinations(optional, k):
            chosen = [o for o in ops if o not in left_out]
            for order in itertools.permutations(chosen):
                real_time = all(not (b.response is not None and b.response < a.invoke)
                                for i, a in enumerate(order) for b in order[i + 1:])
                value, ok = b"", real_time
                for o in order:
                    if not ok:
                        break
                    if o.kind == "write":
                        value = o.value
                    else:
                        ok = o.value == value
                if ok:
                    return True
    return False


_raw_op = st.tuples(st.sampled_from(["write", "read"]), st.integers(0, 3), st.integers(0, 20), st.integers(1, 8),
                   st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(_raw_op, min_size=1, max_size=6))
def test_checker_agrees_with_brute_force_on_small_histories(raw):
    ops = []
    for i, (kind, value, start, length, answered) in enumerate(raw):
        data = f"w{i}".encode() if kind == "write" else (b"" if value == 0 else f"w{value}".encode())
        ops.append(Op(kind, data, float(start), float(start + length) if answered or kind == "read" else None))
    assert check_register(ops) == _brute_force(ops)
