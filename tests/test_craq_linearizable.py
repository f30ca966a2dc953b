"""The register checker accepts linearizable histories and catches the anomalies CRAQ must prevent."""

from craq.linearizable import Op, check_register


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
