"""MetaStore's batch operations (kvclient's one round trip per batch): answers per name, write-once puts in two
halves, removals and access-time records, each batch one transaction that leaves a consistent namespace."""

from __future__ import annotations

import errno
import stat

import pytest
from hypothesis import given, settings, strategies as st

from kvfs.errors import KvfsError
from kvfs.meta.api import MAX_BATCH
from kvfs.meta.chunks import MemoryChunkRemover
from kvfs.meta.fsck import check
from kvfs.meta.store import ROOT_INO, MetaStore
from kvfs.meta.types import ROOT, Caller, Commit, Layout

ALICE = Caller(1000, 1000, client=b"A" * 12)
BOB = Caller(1001, 1001)


@pytest.fixture
def remover():
    return MemoryChunkRemover()


@pytest.fixture
def now():
    return [10**18]


@pytest.fixture
def ms(db, remover, now):
    m = MetaStore(db, chunk_remover=remover, clock=lambda: now[0], client_lease=60,
                  root_layout=Layout(chunk_size=1 << 20))
    m.format(mode=0o777)
    yield m
    assert check(db) == []


def fails(code: int, fn, *args) -> None:
    with pytest.raises(KvfsError) as info:
        fn(*args)
    assert info.value.errno == code


def names(ms: MetaStore, ino: int) -> list[bytes]:
    return [e.name for e in ms.readdir(ALICE, ino, limit=1000).entries]


def put_all(ms: MetaStore, d: int, values: dict[bytes, int], caller: Caller = ALICE) -> list[int]:
    """Both halves of a batch put of ``name -> length`` (the chunk writes would go in between)."""
    order = list(values)
    opened = ms.begin_puts(caller, d, [(k, b".put-" + k) for k in order], 0o644)
    commits = [Commit(b".put-" + k, k, o.attr.ino, o.session, values[k]) for k, o in zip(order, opened) if o]
    done = dict(zip((c.name for c in commits), ms.commit_puts(caller, d, commits)))
    return [done.get(k, 0) for k in order]


def test_batch_lookup_answers_per_name_with_layouts(ms):
    d = ms.mkdir(ALICE, ROOT_INO, b"ns", 0o755).ino
    assert put_all(ms, d, {b"a": 10, b"b": 0}) == [0, 0]
    ms.mkdir(ALICE, d, b"sub", 0o755)
    a, missing, b, sub = ms.batch_lookup(ALICE, d, [b"a", b"zz", b"b", b"sub"])
    assert missing is None
    assert a.attr.size == 10 and stat.S_ISREG(a.attr.mode) and a.layout.chunk_size == 1 << 20
    assert b.attr.size == 0 and sub.layout is None and stat.S_ISDIR(sub.attr.mode)
    assert ms.batch_lookup(ALICE, d, []) == []


def test_bad_batches_fail_whole_and_change_nothing(ms):
    d = ms.mkdir(ALICE, ROOT_INO, b"ns", 0o755).ino
    fails(errno.EINVAL, ms.batch_lookup, ALICE, d, [b"ok", b"a/b"])
    fails(errno.EINVAL, ms.begin_puts, ALICE, d, [(b"ok", b".put-1"), (b"x", b"bad\0")], 0o644)
    fails(errno.EINVAL, ms.batch_unlink, ALICE, d, [b"."])
    fails(errno.EINVAL, ms.batch_lookup, ALICE, d, [b"k%d" % i for i in range(MAX_BATCH + 1)])
    fails(errno.ENOTDIR, ms.batch_lookup, ALICE, ms.mknod(ALICE, d, b"f", 0o644).ino, [b"x"])
    fails(errno.EACCES, ms.begin_puts, BOB, d, [(b"k", b".put-k")], 0o644)
    assert names(ms, d) == [b"f"]


def test_a_put_is_visible_only_once_committed(ms):
    d = ms.mkdir(ALICE, ROOT_INO, b"ns", 0o755).ino
    (o,) = ms.begin_puts(ALICE, d, [(b"k", b".put-k")], 0o644)
    assert ms.batch_lookup(ALICE, d, [b"k"]) == [None] and names(ms, d) == [b".put-k"]
    assert ms.commit_puts(ALICE, d, [Commit(b".put-k", b"k", o.attr.ino, o.session, 77)]) == [0]
    (found,) = ms.batch_lookup(ALICE, d, [b"k"])
    assert found.attr.ino == o.attr.ino and found.attr.size == 77 and names(ms, d) == [b"k"]
    # existing names begin nothing: written once
    assert ms.begin_puts(ALICE, d, [(b"k", b".put-k2"), (b"n", b".put-n")], 0o644)[0] is None
    assert sorted(names(ms, d)) == [b".put-n", b"k"]
    assert ms.expire_clients() == 0


def test_racing_puts_keep_the_first_commit_and_drop_the_loser(ms, remover):
    d = ms.mkdir(ALICE, ROOT_INO, b"ns", 0o755).ino
    first, second = (ms.begin_puts(ALICE, d, [(b"k", t)], 0o644)[0] for t in (b".put-1", b".put-2"))
    assert ms.commit_puts(ALICE, d, [Commit(b".put-2", b"k", second.attr.ino, second.session, 2)]) == [0]
    assert ms.commit_puts(ALICE, d, [Commit(b".put-1", b"k", first.attr.ino, first.session, 1)]) == [-errno.EEXIST]
    assert names(ms, d) == [b"k"] and ms.batch_lookup(ALICE, d, [b"k"])[0].attr.size == 2
    assert ms.gc_once() == 1 and remover.removed == [first.attr.ino]  # the loser's chunks go


def test_a_commit_whose_temp_went_or_whose_session_lapsed_fails_alone(ms, now):
    d = ms.mkdir(ALICE, ROOT_INO, b"ns", 0o755).ino
    gone, lapsed, fine = ms.begin_puts(ALICE, d, [(b"g", b".put-g"), (b"l", b".put-l"), (b"f", b".put-f")], 0o644)
    assert ms.batch_unlink(ALICE, d, [b".put-g"]) == [0]  # an orphan collector took it
    ms.close(ALICE, lapsed.attr.ino, lapsed.session)  # as a lapsed lease ends it
    commits = [Commit(b".put-g", b"g", gone.attr.ino, gone.session, 1),
               Commit(b".put-l", b"l", lapsed.attr.ino, lapsed.session, 1),
               Commit(b".put-f", b"f", fine.attr.ino, fine.session, 3)]
    assert ms.commit_puts(ALICE, d, commits) == [-errno.ENOENT, -errno.EBADF, 0]
    assert sorted(names(ms, d)) == [b".put-l", b"f"]
    assert ms.batch_unlink(ALICE, d, [b".put-l"]) == [0]


def test_batch_unlink_answers_per_name(ms):
    d = ms.mkdir(ROOT, ROOT_INO, b"ns", 0o1777).ino  # sticky, owned by neither
    put_all(ms, d, {b"a": 1, b"b": 1})
    bob_put = ms.begin_puts(BOB, d, [(b"bob", b".put-bob")], 0o644)[0]
    ms.commit_puts(BOB, d, [Commit(b".put-bob", b"bob", bob_put.attr.ino, bob_put.session, 0)])
    ms.mkdir(ALICE, d, b"dir", 0o755)
    assert ms.batch_unlink(ALICE, d, [b"a", b"nope", b"bob", b"dir", b"b"]) == \
        [0, -errno.ENOENT, -errno.EPERM, -errno.EISDIR, 0]  # sticky directory: bob's file stays
    assert sorted(names(ms, d)) == [b"bob", b"dir"]


def test_touch_atimes_sets_access_times_it_may_set(ms, now):
    d = ms.mkdir(ALICE, ROOT_INO, b"ns", 0o777).ino
    put_all(ms, d, {b"a": 1, b"b": 1})
    put_all(ms, d, {b"bobs": 1}, caller=BOB)
    before = {n: f.attr for n, f in zip((b"a", b"b", b"bobs"), ms.batch_lookup(ALICE, d, [b"a", b"b", b"bobs"]))}
    now[0] += 5 * 10**9
    assert ms.touch_atimes(ALICE, d, [b"a", b"gone", b"bobs"]) == 1  # bob's file is 0644: not alice's to touch
    a, b, bobs = (f.attr for f in ms.batch_lookup(ALICE, d, [b"a", b"b", b"bobs"]))
    assert a.atime_ns == now[0] and a.mtime_ns == before[b"a"].mtime_ns
    assert b.atime_ns == before[b"b"].atime_ns and bobs.atime_ns == before[b"bobs"].atime_ns


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.sampled_from([b"k%d" % i for i in range(6)]), max_size=6, unique=True),
                min_size=1, max_size=4), st.booleans())
def test_interleaved_batches_leave_one_complete_value_per_name(tmp_path_factory, batches, together):
    """Batches begun together and committed in any order, one commit call each or (``together``) all in one:
    every name ends with the value of the first commit that named it, and no temporary file stays."""
    from kvfs.kv.sqlite import SqliteDatabase

    db = SqliteDatabase(str(tmp_path_factory.mktemp("db") / "meta.db"))
    try:
        ms = MetaStore(db)
        ms.format(mode=0o777)
        d = ms.mkdir(ALICE, ROOT_INO, b"ns", 0o755).ino
        begun = []
        for n, batch in enumerate(batches):
            opened = ms.begin_puts(ALICE, d, [(k, b".put-%d-%s" % (n, k)) for k in batch], 0o644)
            begun.append([Commit(b".put-%d-%s" % (n, k), k, o.attr.ino, o.session, n + 1)
                          for k, o in zip(batch, opened) if o])
        winner: dict[bytes, int] = {}
        calls = [[c for commits in reversed(begun) for c in commits]] if together else list(reversed(begun))
        for commits in calls:
            for c, result in zip(commits, ms.commit_puts(ALICE, d, commits)):
                assert result == (-errno.EEXIST if c.name in winner else 0)
                winner.setdefault(c.name, c.length)
        assert sorted(names(ms, d)) == sorted(winner)
        assert [f.attr.size for f in ms.batch_lookup(ALICE, d, sorted(winner))] == [winner[k] for k in sorted(winner)]
        assert check(db) == []
    finally:
        db.close()
