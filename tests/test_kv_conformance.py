"""One conformance suite for every KV engine (FoundationDB skips where it cannot run)."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import threading
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvfs.errors import KvfsError, TransactionConflict, TransactionTooLarge, TransactionTooOld
from kvfs.kv.base import STAMP_BYTES
from kvfs.kv import FdbDatabase, SqliteDatabase, Transaction, open_database, transactional
from kvfs.kv.fdb_engine import load_fdb
from kvfs.kv.keys import decode_int, encode_int, key_after, pack, prefix_range, unpack


def _fdb_database() -> FdbDatabase:
    """A real cluster if this host has one; otherwise skip and say what is missing."""
    try:
        load_fdb()
    except KvfsError as exc:
        pytest.skip(f"FoundationDB: {exc}")
    cluster = os.environ.get("KVFS_FDB_CLUSTER_FILE", "/etc/foundationdb/fdb.cluster")
    if not os.path.exists(cluster):
        pytest.skip(f"FoundationDB: no cluster file at {cluster} (set KVFS_FDB_CLUSTER_FILE)")
    return FdbDatabase(cluster)


@pytest.fixture(params=["sqlite", "fdb"])
def db(request, tmp_path):
    if request.param == "sqlite":
        database = SqliteDatabase(str(tmp_path / "kv.db"), max_bytes=100_000, max_age_s=1.0)
    else:
        database = _fdb_database()
    database.run(lambda tr: tr.clear_range(*prefix_range("kvtest")))
    yield database
    database.close()


def k(*parts) -> bytes:
    return pack("kvtest", *parts)


ALL = prefix_range("kvtest")


def put(db, items: dict[bytes, bytes]) -> None:
    def fn(tr: Transaction) -> None:
        for key, value in items.items():
            tr.set(key, value)

    db.run(fn)


def test_keys_roundtrip_and_order():
    assert unpack(pack("meta", 3, b"x")) == ("meta", 3, b"x")
    begin, end = prefix_range("meta", 3)
    assert begin < pack("meta", 3, b"") < pack("meta", 3, b"\xff" * 9) < end
    assert pack("meta", 3) < key_after(pack("meta", 3)) < pack("meta", 3, b"")
    assert decode_int(encode_int(-5)) == -5 and decode_int(None) == 0


_key_parts = st.one_of(
    st.integers(-(1 << 70), 1 << 70), st.binary(max_size=12), st.text(max_size=6), st.booleans(), st.none()
)


@given(st.lists(_key_parts, max_size=5))
@example([(1 << 64) - 2, (1 << 64) - 1, 1 << 64])  # the edge of the 8-byte form (2**64 - 1 is not in it)
def test_fast_key_packing_is_the_tuple_layer(parts):
    """pack() encodes the schema's shapes itself; its bytes must be exactly fdb.tuple's, order included."""
    import fdb.tuple

    assert pack(*parts) == fdb.tuple.pack(tuple(parts))


def test_set_get_clear(db):
    put(db, {k(1): b"one", k(2): b"two"})
    tr = db.create_transaction()
    assert tr.get(k(1)) == b"one" and tr.get(k(3)) is None
    tr.clear(k(1))
    assert tr.get(k(1)) is None
    tr.commit()
    assert db.run(lambda tr: tr.get(k(1))) is None
    assert db.run(lambda tr: tr.get(k(2))) == b"two"


def test_get_many_reads_stored_and_own_writes_in_order(db):
    """More keys than one SQLite statement takes, repeats, missing keys, and the transaction's own writes."""
    put(db, {k(i): b"db%d" % i for i in range(0, 1200, 2)})

    def fn(tr: Transaction):
        tr.set(k(1), b"mine1")
        tr.clear(k(2))
        tr.add(k(3), 1)
        keys = [k(i) for i in range(1200)] + [k(0), k(1), k(2), k(5)]
        return tr.get_many(keys), [tr.get(key) for key in keys]

    many, one_by_one = db.run(fn)
    assert many == one_by_one
    assert many[:5] == [b"db0", b"mine1", None, encode_int(1), b"db4"]
    assert many[-4:] == [b"db0", b"mine1", None, None] and db.run(lambda tr: tr.get_many([])) == []


def test_ryw_range_merging_limit_reverse(db):
    put(db, {k(i): b"db%d" % i for i in range(0, 10, 2)})  # 0 2 4 6 8

    def fn(tr: Transaction):
        tr.set(k(3), b"mine3")
        tr.set(k(4), b"mine4")
        tr.clear(k(6))
        tr.set(k(9), b"mine9")
        full = tr.get_range(*ALL)
        return (
            full,
            tr.get_range(*ALL, limit=3),
            tr.get_range(*ALL, limit=3, reverse=True),
            tr.get_range(k(3), k(8)),
        )

    full, first3, last3, middle = db.run(fn)
    assert [(unpack(a)[1], b) for a, b in full] == [
        (0, b"db0"), (2, b"db2"), (3, b"mine3"), (4, b"mine4"), (8, b"db8"), (9, b"mine9")
    ]
    assert first3 == full[:3]
    assert last3 == full[::-1][:3]
    assert [unpack(a)[1] for a, _ in middle] == [3, 4]


def test_clear_range_then_set(db):
    put(db, {k(i): b"v" for i in range(6)})

    def fn(tr: Transaction):
        tr.set(k(2), b"before")
        tr.clear_range(k(1), k(4))
        tr.set(k(3), b"after")
        tr.add(k(2), 7)  # base is known cleared: 0 + 7
        return tr.get_range(*ALL)

    inside = db.run(fn)
    outside = db.run(lambda tr: tr.get_range(*ALL))
    assert inside == outside
    assert [(unpack(a)[1], b) for a, b in outside] == [
        (0, b"v"), (2, encode_int(7)), (3, b"after"), (4, b"v"), (5, b"v")
    ]


def test_atomic_add_max(db):
    db.run(lambda tr: tr.set(k("n"), encode_int(10)))

    def fn(tr: Transaction):
        tr.add(k("n"), 5)
        tr.add(k("n"), -3)
        tr.max(k("m"), 4)
        tr.max(k("m"), 2)
        return decode_int(tr.get(k("n"))), decode_int(tr.get(k("m")))

    assert db.run(fn) == (12, 4)
    assert decode_int(db.run(lambda tr: tr.get(k("n")))) == 12
    db.run(lambda tr: tr.max(k("n"), 100))
    assert decode_int(db.run(lambda tr: tr.get(k("n")))) == 100


def test_atomic_ops_do_not_conflict(db):
    a, b = db.create_transaction(), db.create_transaction()
    a.add(k("c"), 1)
    b.add(k("c"), 1)
    a.commit()
    b.commit()
    assert decode_int(db.run(lambda tr: tr.get(k("c")))) == 2


def test_conflict_between_two_transactions(db):
    db.run(lambda tr: tr.set(k("x"), b"0"))
    a, b = db.create_transaction(), db.create_transaction()
    assert a.get(k("x")) == b"0" and b.get(k("x")) == b"0"
    a.set(k("x"), b"a")
    b.set(k("x"), b"b")
    a.commit()
    with pytest.raises(TransactionConflict):
        b.commit()
    assert db.run(lambda tr: tr.get(k("x"))) == b"a"


def test_snapshot_reads_do_not_conflict(db):
    db.run(lambda tr: tr.set(k("x"), b"0"))
    a, b = db.create_transaction(), db.create_transaction()
    assert b.get(k("x"), snapshot=True) == b"0"
    assert b.get_range(*ALL, snapshot=True) == [(k("x"), b"0")]
    a.get(k("x"))
    a.set(k("x"), b"a")
    a.commit()
    b.set(k("y"), b"b")
    b.commit()
    assert db.run(lambda tr: tr.get_range(*ALL)) == [(k("x"), b"a"), (k("y"), b"b")]


def test_read_only_transaction_commits(db):
    tr = db.create_transaction()
    tr.get(k("nothing"))
    tr.commit()


def test_too_large(db):
    if isinstance(db, SqliteDatabase):
        limit = db.max_bytes
    else:
        limit = 10_000_000
    tr = db.create_transaction()
    with pytest.raises(TransactionTooLarge):
        for i in range(limit // 50_000 + 2):
            tr.set(k("big", i), b"x" * 50_000)
        tr.commit()


def test_too_old(db):
    if not isinstance(db, SqliteDatabase):
        pytest.skip("FoundationDB's 5 s limit is too slow for this suite")
    tr = db.create_transaction()
    tr.get(k("x"))
    time.sleep(db.max_age_s + 0.05)
    with pytest.raises(TransactionTooOld):
        tr.get(k("x"))
        tr.commit()


def test_cancel_drops_writes(db):
    tr = db.create_transaction()
    tr.set(k("x"), b"1")
    tr.cancel()
    assert db.run(lambda tr: tr.get(k("x"))) is None


def test_run_retries_on_conflict_and_reraises_others(db):
    db.run(lambda tr: tr.set(k("x"), b"0"))
    calls = []

    def fn(tr: Transaction):
        calls.append(1)
        value = tr.get(k("x"))
        if len(calls) == 1:  # someone else commits between our read and our commit
            db.run(lambda other: other.set(k("x"), b"other"))
        tr.set(k("x"), value + b"!")
        return value

    assert db.run(fn) == b"other"
    assert len(calls) == 2
    assert db.run(lambda tr: tr.get(k("x"))) == b"other!"

    def boom(tr: Transaction):
        tr.set(k("y"), b"1")
        raise ValueError("no")

    with pytest.raises(ValueError):
        db.run(boom)
    assert db.run(lambda tr: tr.get(k("y"))) is None


def test_transactional_decorator(db):
    @transactional
    def incr(tr: Transaction, key: bytes) -> int:
        value = decode_int(tr.get(key)) + 1
        tr.set(key, encode_int(value))
        return value

    @transactional
    def incr_twice(tr: Transaction, key: bytes) -> int:
        incr(tr, key)
        return incr(tr, key)

    assert incr(db, k("c")) == 1
    assert incr_twice(db, k("c")) == 3


def test_threads_increment_exactly(db):
    def incr(tr: Transaction):
        tr.set(k("c"), encode_int(decode_int(tr.get(k("c"))) + 1))

    def worker():
        for _ in range(20):
            db.run(incr)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert decode_int(db.run(lambda tr: tr.get(k("c")))) == 80


def test_stamped_keys_grow_in_commit_order(db):
    """Stamps are the log's order: a later commit's record sorts after an earlier one's, also when the later
    transaction started first, and stamped writes do not make transactions conflict."""
    early, late = db.create_transaction(), db.create_transaction()
    early.get(k("unrelated"), snapshot=True)  # both read before either commits (snapshot: no false conflict)
    late.get(k("unrelated"), snapshot=True)
    late.set_stamped(k("log"), b"first")
    late.commit()
    early.set_stamped(k("log"), b"second")
    early.commit()
    db.run(lambda tr: tr.set_stamped(k("log"), b"third"))
    rows = db.run(lambda tr: tr.get_range(*prefix_range("kvtest", "log")))
    assert [v for _, v in rows] == [b"first", b"second", b"third"]
    stamps = [key[len(k("log")):] for key, _ in rows]
    assert all(len(s) == STAMP_BYTES for s in stamps) and stamps == sorted(set(stamps))


def test_stamped_keys_from_threads_are_unique(db):
    def worker():
        for _ in range(20):
            db.run(lambda tr: tr.set_stamped(k("log"), b"x"))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(db.run(lambda tr: tr.get_range(*prefix_range("kvtest", "log")))) == 80


def test_stamped_keys_keep_growing_after_the_log_is_cleared(db):
    """A reader's position stays meaningful when old records are trimmed: stamps never go back."""
    db.run(lambda tr: tr.set_stamped(k("log"), b"a"))
    (old, _), = db.run(lambda tr: tr.get_range(*prefix_range("kvtest", "log")))
    db.run(lambda tr: tr.clear_range(*prefix_range("kvtest", "log")))
    db.run(lambda tr: tr.set_stamped(k("log"), b"b"))
    (new, _), = db.run(lambda tr: tr.get_range(*prefix_range("kvtest", "log")))
    assert new > old


def _process_increments(path: str, n: int) -> None:
    db = SqliteDatabase(path)

    def incr(tr: Transaction):
        tr.set(k("c"), encode_int(decode_int(tr.get(k("c"))) + 1))  # read-modify-write: conflicts

    for _ in range(n):
        db.run(incr)
    db.close()


def test_sqlite_processes_increment_exactly(tmp_path):
    path = str(tmp_path / "shared.db")
    SqliteDatabase(path).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_process_increments, args=(path, 150)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    db = SqliteDatabase(path)
    assert decode_int(db.run(lambda tr: tr.get(k("c")))) == 300


def _write_megabytes(db: SqliteDatabase, mib: int) -> None:
    for n in range(2 * mib):
        tr = db.create_transaction()
        for i in range(64):
            tr.set(k("big", n, i), os.urandom(8192))
        tr.commit()


def test_sqlite_commits_leave_checkpoints_to_a_thread_of_their_own(tmp_path):
    """A checkpoint fsyncs; meta commits on its event loop, so no commit may run one (SQLite's autocheckpoint
    would, at 1,000 WAL pages): the database's own thread copies the WAL into the file once it has grown by about
    as much, and stops with close."""
    threads = set(threading.enumerate())
    never = SqliteDatabase(str(tmp_path / "never.db"), checkpoint_interval_s=3600)
    _write_megabytes(never, 8)  # ~2,000 pages: twice SQLite's autocheckpoint threshold
    assert os.path.getsize(tmp_path / "never.db") < 1 << 20
    assert os.path.getsize(tmp_path / "never.db-wal") > 8 << 20
    soon = SqliteDatabase(str(tmp_path / "soon.db"), checkpoint_interval_s=0.05)
    _write_megabytes(soon, 8)
    deadline = time.monotonic() + 30
    while os.path.getsize(tmp_path / "soon.db") < 2 << 20:
        assert time.monotonic() < deadline, "the checkpoint thread copied nothing into the database file"
        time.sleep(0.05)
    never.close()
    soon.close()
    assert set(threading.enumerate()) == threads


def test_sqlite_checkpoint_held_back_by_a_reader_is_finished_once_it_is_gone(tmp_path):
    """A PASSIVE checkpoint copies nothing past an open reader's snapshot; what it left is copied at a later look,
    without waiting for another 1,000 pages of commits."""
    db = SqliteDatabase(str(tmp_path / "x.db"), checkpoint_interval_s=0.05)
    reader = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM kv").fetchone()  # pins the snapshot from before the writes
    _write_megabytes(db, 8)
    time.sleep(0.5)  # several looks: each checkpoints what it can, nothing here
    assert os.path.getsize(tmp_path / "x.db") < 1 << 20
    reader.execute("COMMIT")
    reader.close()
    deadline = time.monotonic() + 30
    while os.path.getsize(tmp_path / "x.db") < 4 << 20:  # no commit since: only a retry copies the frames
        assert time.monotonic() < deadline, "what the reader held back stayed in the WAL"
        time.sleep(0.05)
    db.close()


def test_open_database(tmp_path):
    db = open_database(f"sqlite://{tmp_path}/x.db")
    assert isinstance(db, SqliteDatabase) and db.path == f"{tmp_path}/x.db"
    db.close()
    with pytest.raises(KvfsError):
        open_database("nope://x")
    try:
        open_database(f"fdb://{tmp_path}/missing.cluster")
    except KvfsError as exc:  # no libfdb_c here, or no such cluster file: either is named
        assert "libfdb_c" in str(exc) or "cluster file" in str(exc)


# --- model-based check: a transaction's view equals a dict with the same operations -----------

_keys = st.integers(0, 15)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), _keys, st.binary(max_size=3)),
        st.tuples(st.just("clear"), _keys),
        st.tuples(st.just("clear_range"), _keys, _keys),
        st.tuples(st.just("add"), _keys, st.integers(-5, 5)),
        st.tuples(st.just("max"), _keys, st.integers(0, 9)),
    ),
    max_size=12,
)


def _model_apply(model: dict[int, bytes], op) -> None:
    from kvfs.kv.buffer import apply_atomic

    if op[0] == "set":
        model[op[1]] = op[2]
    elif op[0] == "clear":
        model.pop(op[1], None)
    elif op[0] == "clear_range":
        for key in [x for x in model if op[1] <= x < op[2]]:
            del model[key]
    else:
        model[op[1]] = apply_atomic(op[0], model.get(op[1]), op[2])


def _tr_apply(tr: Transaction, op) -> None:
    if op[0] in ("set", "add", "max"):
        getattr(tr, op[0])(k(op[1]), *op[2:])
    elif op[0] == "clear":
        tr.clear(k(op[1]))
    else:
        tr.clear_range(k(op[1]), k(op[2]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=_ops, during=_ops, begin=_keys, end=_keys, limit=st.integers(0, 4), reverse=st.booleans())
def test_model(db, before, during, begin, end, limit, reverse):
    db.run(lambda tr: tr.clear_range(*ALL))
    model: dict[int, bytes] = {}

    def apply_all(tr: Transaction, ops) -> None:
        for op in ops:
            _tr_apply(tr, op)

    for op in before:
        _model_apply(model, op)
    db.run(apply_all, before)
    for op in during:
        _model_apply(model, op)
    expect = sorted((key, v) for key, v in model.items() if begin <= key < end)
    if reverse:
        expect.reverse()
    if limit:
        expect = expect[:limit]

    def view(tr: Transaction):
        apply_all(tr, during)
        rows = tr.get_range(k(begin), k(end), limit=limit, reverse=reverse)
        return rows, {key: tr.get(k(key)) for key in range(16)}, tr.get_many([k(key) for key in range(16)])

    rows, point, many = db.run(view)
    assert [(unpack(a)[1], b) for a, b in rows] == expect
    assert point == {key: model.get(key) for key in range(16)}
    assert many == [model.get(key) for key in range(16)]
    stored = db.run(lambda tr: tr.get_range(*ALL))
    assert [(unpack(a)[1], b) for a, b in stored] == sorted(model.items())
