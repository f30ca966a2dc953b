"""The change feed (meta/feed.py): every change of an inode or entry is in it, once, in commit order."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfs.meta import schema
from kvfs.meta.feed import ORIGIN
from kvfs.kv import SqliteDatabase
from kvfs.kv.keys import prefix_range, unpack
from kvfs.meta.posix import RENAME_EXCHANGE, ROOT_INO
from kvfs.meta.store import MetaStore
from kvfs.meta.types import ROOT, Caller

MOUNT_A = Caller(0, 0, client=b"mount-a")


@pytest.fixture
def store(tmp_path):
    db = SqliteDatabase(str(tmp_path / "meta.db"))
    ms = MetaStore(db)
    ms.format(mode=0o777)
    yield ms
    db.close()


def _all_changes(ms: MetaStore, cursor: bytes, **kw):
    page = ms.changes(cursor, **kw)
    out = list(page.changes)
    while page.more:
        page = ms.changes(page.cursor, **kw)
        out += page.changes
    return out, page.cursor


def test_a_create_names_the_new_inode_its_parent_and_the_entry_and_who_made_it(store):
    head = store.changes().cursor  # an empty cursor starts at the head
    token = ORIGIN.set(b"mount-a")
    try:
        opened = store.create(MOUNT_A, ROOT_INO, b"f", 0o644)
    finally:
        ORIGIN.reset(token)
    page = store.changes(head)
    (change,) = page.changes
    assert change.client == b"mount-a"
    assert change.inodes == sorted([ROOT_INO, opened.attr.ino]) and change.entries == [(ROOT_INO, b"f")]
    assert page.cursor > head and not page.gap and not page.more
    assert store.changes(page.cursor).changes == []  # nothing new after it


def test_reads_leave_no_record_and_a_client_can_skip_its_own(store):
    head = store.changes().cursor
    store.mkdir(ROOT, ROOT_INO, b"d", 0o755)
    store.lookup(ROOT, ROOT_INO, b"d")
    store.readdir(ROOT, ROOT_INO)
    store.statfs(ROOT)
    token = ORIGIN.set(b"me")
    try:
        store.mkdir(ROOT, ROOT_INO, b"mine", 0o755)
    finally:
        ORIGIN.reset(token)
    everything = store.changes(head)
    assert [c.entries for c in everything.changes] == [[(ROOT_INO, b"d")], [(ROOT_INO, b"mine")]]
    others = store.changes(head, skip_client=b"me")
    assert [c.entries for c in others.changes] == [[(ROOT_INO, b"d")]]
    assert others.cursor == everything.cursor  # past the skipped change too


def test_pages_in_commit_order(store):
    head = store.changes().cursor
    for i in range(5):
        store.mknod(ROOT, ROOT_INO, f"n{i}", stat.S_IFREG | 0o644)
    page = store.changes(head, limit=2)
    assert page.more and len(page.changes) == 2
    changes, _ = _all_changes(store, head, limit=2)
    assert [c.entries[0][1] for c in changes] == [f"n{i}".encode() for i in range(5)]


def test_trimmed_records_are_a_gap_for_a_reader_behind_them(tmp_path):
    now = [10**18]
    store = MetaStore(SqliteDatabase(str(tmp_path / "meta.db")), clock=lambda: now[0])
    store.format()
    head = store.changes().cursor
    store.mkdir(ROOT, ROOT_INO, b"old", 0o755)
    now[0] += 200 * 10**9
    store.mkdir(ROOT, ROOT_INO, b"new", 0o755)
    assert store.trim_changes(keep_seconds=120) == 2  # format's record and "old"
    assert store.trim_changes(keep_seconds=120) == 0
    page = store.changes(head)
    assert page.gap and page.changes == [] and page.cursor >= head
    # From the new cursor the reader misses nothing that comes later.
    store.mkdir(ROOT, ROOT_INO, b"later", 0o755)
    changes, _ = _all_changes(store, page.cursor)
    assert [c.entries for c in changes] == [[(ROOT_INO, b"later")]]


def _snapshot(ms: MetaStore) -> dict[bytes, bytes]:
    def read(tr):
        rows = tr.get_range(*prefix_range(schema.NS, "i")) + tr.get_range(*prefix_range(schema.NS, "d"))
        return dict(rows)

    return ms.db.run(read)


def _footprint(before: dict[bytes, bytes], after: dict[bytes, bytes]) -> tuple[set, set]:
    inodes, entries = set(), set()
    for key in before.keys() | after.keys():
        if before.get(key) != after.get(key):
            parts = unpack(key)
            if parts[1] == "i":
                inodes.add(parts[2])
            else:
                entries.add((parts[2], parts[3]))
    return inodes, entries


NAMES = st.sampled_from([b"a", b"b", b"c"])
OPS = st.one_of(
    st.tuples(st.just("create"), NAMES),
    st.tuples(st.just("mkdir"), NAMES),
    st.tuples(st.just("unlink"), NAMES),
    st.tuples(st.just("rmdir"), NAMES),
    st.tuples(st.just("link"), NAMES, NAMES),
    st.tuples(st.just("rename"), NAMES, NAMES),
    st.tuples(st.just("exchange"), NAMES, NAMES),
    st.tuples(st.just("chmod"), NAMES),
    st.tuples(st.just("truncate"), NAMES),
    st.tuples(st.just("symlink"), NAMES),
)


def _apply(ms: MetaStore, op) -> None:
    kind, name, *rest = op

    def ino(n: bytes) -> int:
        return ms.lookup(ROOT, ROOT_INO, n).ino

    if kind == "create":
        ms.create(ROOT, ROOT_INO, name, 0o644)
    elif kind == "mkdir":
        ms.mkdir(ROOT, ROOT_INO, name, 0o755)
    elif kind == "unlink":
        ms.unlink(ROOT, ROOT_INO, name)
    elif kind == "rmdir":
        ms.rmdir(ROOT, ROOT_INO, name)
    elif kind == "link":
        ms.link(ROOT, ino(name), ROOT_INO, rest[0])
    elif kind == "rename":
        ms.rename(ROOT, ROOT_INO, name, ROOT_INO, rest[0])
    elif kind == "exchange":
        ms.rename(ROOT, ROOT_INO, name, ROOT_INO, rest[0], RENAME_EXCHANGE)
    elif kind == "chmod":
        ms.setattr(ROOT, ino(name), mode=0o600)
    elif kind == "truncate":
        ms.setattr(ROOT, ino(name), size=7)
    elif kind == "symlink":
        ms.symlink(ROOT, ROOT_INO, name, b"target")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=12))
def test_every_change_of_an_inode_or_entry_is_in_the_feed(tmp_path_factory, ops):
    """Whatever an operation does to inodes and entries, its feed record names exactly that: the mounts' caches
    are only as right as this."""
    db = SqliteDatabase(os.path.join(tmp_path_factory.mktemp("feed"), "meta.db"))
    try:
        ms = MetaStore(db)
        ms.format(mode=0o777)
        cursor = ms.changes().cursor
        for op in ops:
            before = _snapshot(ms)
            try:
                _apply(ms, op)
            except OSError:
                pass  # a refused operation changes nothing, and the feed must say nothing
            inodes, entries = _footprint(before, _snapshot(ms))
            changes, cursor = _all_changes(ms, cursor)
            assert {i for c in changes for i in c.inodes} == inodes, op
            assert {tuple(e) for c in changes for e in c.entries} == entries, op
    finally:
        db.close()
