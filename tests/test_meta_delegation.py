"""Directory delegations in MetaStore (meta/delegation.py): grants, recalls, and changes applied for their holder."""

from __future__ import annotations

import errno
import os
import stat

import msgspec
import pytest

from kvfs.errors import KvfsError
from kvfs.meta.chunks import MemoryChunkRemover
from kvfs.meta.delegation import DelegationHeld
from kvfs.meta.feed import ORIGIN
from kvfs.meta.fsck import check
from kvfs.meta.posix import child_attr
from kvfs.meta.store import MetaStore
from kvfs.meta.types import ID_BLOCK
from kvfs.meta.types import ROOT, Caller, CreateOp, DirEntry, Layout, UnlinkOp

A = Caller(1000, 1000, client=b"client-a")
B = Caller(1000, 1000, client=b"client-b")
LEASE = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def ms(db, clock):
    m = MetaStore(db, chunk_remover=MemoryChunkRemover(), clock=clock, delegation_lease=LEASE)
    m.format(mode=0o777)
    yield m
    assert check(db) == []


@pytest.fixture
def d(ms):
    return ms.mkdir(A, 1, b"d", 0o755).ino


def create_op(grant, name: bytes, i: int, clock: Clock, who: Caller = A, mode: int = 0o640) -> CreateOp:
    layout = msgspec.structs.replace(grant.layout, seed=1234 + i)
    return CreateOp(who, name, grant.ids + i, mode, os.O_WRONLY | os.O_CREAT, clock() + i, layout, 99 + i)


def test_a_grant_carries_the_listing_and_excludes_other_clients(ms, d):
    ms.create(A, d, b"old", 0o644)
    grant = ms.delegate(A, d)
    assert grant.granted and grant.epoch and grant.lease == LEASE
    assert grant.names == [b"old"] and grant.attr.ino == d and grant.layout == Layout()
    assert not ms.delegate(B, d).granted  # held: no error, just no grant
    for op in (lambda: ms.lookup(B, d, b"old"), lambda: ms.readdir(B, d), lambda: ms.getattr(B, d),
               lambda: ms.create(B, d, b"new", 0o644), lambda: ms.unlink(B, d, b"new"),
               lambda: ms.setattr(B, d, mode=0o700), lambda: ms.rmdir(B, 1, b"d"),
               lambda: ms.rename(B, 1, b"x", d, b"y")):
        with pytest.raises(DelegationHeld) as info:
            op()
        assert info.value.errno == errno.EAGAIN and info.value.directory == d
    assert ms.lookup(A, d, b"old").ino  # the holder itself goes on as ever
    assert ms.getattr(B, 1).ino == 1  # other directories are not affected
    assert ms.undelegate(A, [d]) == 1 and ms.undelegate(A, [d]) == 0
    assert ms.lookup(B, d, b"old").ino
    assert ms.delegate(B, d).granted


def test_another_client_removes_a_file_the_holder_did_not_make_without_a_recall(ms, d, clock):
    """Rule 5: the holder answers removals only of files it made under its grant and creates only of names its
    listing lacks, so another client's removal of any other file's name needs no recall. A name the holder made
    under the grant (it may have removed it already), an absent one (it may have made it) and a directory still
    wait for the holder."""
    ms.create(A, d, b"before", 0o644)
    ms.create(B, d, b"theirs", 0o644)
    ms.mkdir(A, d, b"sub", 0o755)
    grant = ms.delegate(A, d)
    assert ms.apply_delegated(A, d, grant.epoch, [create_op(grant, b"made", 0, clock)]) == [0]
    ms.create(A, d, b"after", 0o644)  # the holder's own synchronous create: not made under the grant either
    for name in (b"before", b"theirs", b"after"):
        ms.unlink(B, d, name)  # no DelegationHeld
    for op in (lambda: ms.unlink(B, d, b"made"), lambda: ms.unlink(B, d, b"absent"), lambda: ms.rmdir(B, d, b"sub"),
               lambda: ms.unlink(B, d, b"sub")):
        with pytest.raises(DelegationHeld):
            op()
    assert ms.apply_delegated(A, d, grant.epoch, [UnlinkOp(A, b"made", grant.ids, clock())]) == [0]  # still held
    assert sorted(e.name for e in ms.readdir(A, d).entries) == [b"sub"]
    clock.advance(LEASE)  # lapsed: broken first as ever, so the holder's late changes cannot follow the removal
    ms.create(A, d, b"late", 0o644)
    with pytest.raises(DelegationHeld) as held:
        ms.unlink(B, d, b"late")
    assert held.value.lapsed


def test_a_grant_for_removals_names_each_inode_and_keeps_other_removers_out(ms, d, clock):
    """A mount that removes another client's files asks for a grant for removals: it waits for the holder's grant
    (a recall, not a silent refusal), carries each name's inode and type, and rule 5 does not apply to it, so the
    holder's answered unlinks of files it did not make cannot race another client's; a renewal keeps it so."""
    theirs = ms.create(A, d, b"theirs", 0o644).attr.ino
    sub = ms.mkdir(A, d, b"sub", 0o755).ino
    ms.delegate(A, d)
    with pytest.raises(DelegationHeld) as held:
        ms.delegate(B, d, removes=True)
    assert not held.value.lapsed
    assert not ms.delegate(B, d).granted  # an ordinary grant still just is not granted
    ms.undelegate(A, [d])
    grant = ms.delegate(B, d, removes=True)
    assert grant.granted and dict(zip(grant.names, grant.entries)) == {
        b"sub": DirEntry(sub, stat.S_IFDIR), b"theirs": DirEntry(theirs, stat.S_IFREG)}
    with pytest.raises(DelegationHeld):
        ms.unlink(A, d, b"theirs")  # made outside the grant, but the holder may have removed it already
    assert ms.apply_delegated(B, d, grant.epoch, [UnlinkOp(B, b"theirs", theirs, clock())]) == [0]
    ms.create(B, d, b"later", 0o644)
    assert ms.delegate(B, d, grant.epoch).granted  # renewed: still for removals
    with pytest.raises(DelegationHeld):
        ms.unlink(A, d, b"later")
    clock.advance(LEASE)
    with pytest.raises(DelegationHeld) as held:
        ms.delegate(A, d, removes=True)
    assert held.value.lapsed  # the service breaks it, and the retry is granted
    ms.break_lapsed(d)
    assert ms.delegate(A, d, removes=True).names == [b"later", b"sub"]


def test_a_grant_lapses_without_renewal(ms, d, clock):
    grant = ms.delegate(A, d)
    clock.advance(LEASE - 1)
    renewed = ms.delegate(A, d, grant.epoch)
    assert renewed.granted and renewed.ids != grant.ids and renewed.names is None
    clock.advance(LEASE - 1)
    with pytest.raises(DelegationHeld) as held:
        ms.lookup(B, d, b"x")
    assert not held.value.lapsed  # live: recalled
    clock.advance(2)
    assert ms.apply_delegated(A, d, grant.epoch, []) == []  # lapsed, but nobody used the directory: still good
    clock.advance(LEASE)
    with pytest.raises(DelegationHeld) as held:
        ms.lookup(B, d, b"x")
    assert held.value.lapsed
    ms.answer_held(held.value)  # what the service does: the lapsed grant is broken...
    with pytest.raises(KvfsError) as info:  # ...the other client goes ahead...
        ms.lookup(B, d, b"x")
    assert info.value.errno == errno.ENOENT
    assert not ms.delegate(A, d, grant.epoch).granted  # ...and the old grant can neither be renewed
    with pytest.raises(KvfsError) as info:  # ...nor apply anything
        ms.apply_delegated(A, d, grant.epoch, [create_op(grant, b"late", 0, clock)])
    assert info.value.errno == errno.ENOLCK
    assert ms.readdir(B, d).entries == []


def test_a_batch_sent_again_after_a_lost_answer_applies_once(ms, d, clock):
    grant = ms.delegate(A, d)
    batch = [create_op(grant, b"a", 0, clock), create_op(grant, b"b", 1, clock), UnlinkOp(A, b"a", grant.ids, clock())]
    assert ms.apply_delegated(A, d, grant.epoch, batch) == [0, 0, 0]
    assert ms.apply_delegated(A, d, grant.epoch, batch) == [0, 0, 0]  # the same changes, already there
    assert [e.name for e in ms.readdir(A, d).entries] == [b"b"]


def test_applied_creates_match_what_the_holder_answered(ms, db, d, clock):
    ms.setattr(A, d, mode=0o2775)  # setgid: children take the directory's group
    grant = ms.delegate(A, d)
    ops = [create_op(grant, f"f{i}".encode(), i, clock) for i in range(3)]
    assert ms.apply_delegated(A, d, grant.epoch, ops) == [0, 0, 0]
    ms.undelegate(A, [d])
    for op in ops:
        attr, layout = child_attr(op.who, grant.attr, grant.layout, stat.S_IFREG | op.mode, op.ino, op.time_ns,
                                  seed=op.layout.seed)
        assert layout == op.layout
        got = ms.lookup(B, d, op.name)
        assert got == attr and got.gid == grant.attr.gid
        assert ms.get_layout(B, op.ino) == layout
        ms.report_length(A, op.ino, op.session, 10)  # the write session the holder chose exists
    parent = ms.getattr(B, d)
    assert parent.mtime_ns == parent.ctime_ns == ops[-1].time_ns


def test_applied_unlinks_and_refusals(ms, d, clock):
    grant = ms.delegate(A, d)
    made = [create_op(grant, b"a", 0, clock), create_op(grant, b"b", 1, clock)]
    assert ms.apply_delegated(A, d, grant.epoch, made) == [0, 0]
    bad = [
        UnlinkOp(A, b"a", made[0].ino, clock()),
        create_op(grant, b"b", 2, clock),  # EEXIST: changes nothing, the others still apply
        CreateOp(A, b"c", grant.ids + ID_BLOCK, 0o644, os.O_RDONLY, clock(), grant.layout, None),  # not a granted id
        create_op(grant, b"d", 1, clock),  # the id of b, in use
        UnlinkOp(A, b"b", made[0].ino, clock()),  # b is another inode
        create_op(grant, b"e", 3, clock, who=Caller(1001, 1001)),  # no write permission on the directory
    ]
    assert ms.apply_delegated(A, d, grant.epoch, bad) == [0, errno.EEXIST, errno.EINVAL, errno.EINVAL, errno.ENOENT,
                                                          errno.EACCES]
    with pytest.raises(KvfsError) as info:
        ms.apply_delegated(A, d, grant.epoch + 1, [])
    assert info.value.errno == errno.ENOLCK
    with pytest.raises(KvfsError) as info:
        ms.apply_delegated(B, d, grant.epoch, [])
    assert info.value.errno == errno.ENOLCK
    ms.undelegate(A, [d])
    assert [e.name for e in ms.readdir(B, d).entries] == [b"b"]
    assert ms.gc_once() == 0  # a's write session is still open
    ms.close_sessions(A, [(made[0].ino, made[0].session, None)])
    assert ms.gc_once() == 1  # then its inode goes to the collector as with any unlink


def test_recall_and_apply_in_the_feed(ms, d, clock):
    head = ms.changes().cursor
    grant = ms.delegate(A, d)
    token = ORIGIN.set(A.client)  # as the service sets it around a call
    ms.apply_delegated(A, d, grant.epoch, [create_op(grant, b"a", 0, clock), create_op(grant, b"b", 1, clock)])
    ORIGIN.reset(token)
    ms.recall(d)
    page = ms.changes(head)
    assert len(page.changes) == 2
    applied, recall = page.changes
    assert applied.client == A.client and sorted(applied.entries) == [(d, b"a"), (d, b"b")]
    assert recall.recalls == [d] and not recall.inodes and not recall.entries
    assert ms.changes(head, skip_client=A.client).changes[-1].recalls == [d]


def test_delegations_need_a_client_and_write_access(ms, d):
    with pytest.raises(KvfsError) as info:
        ms.delegate(ROOT, d)
    assert info.value.errno == errno.EINVAL
    with pytest.raises(KvfsError) as info:
        ms.delegate(Caller(1001, 1001, client=b"c"), d)
    assert info.value.errno == errno.EACCES


def test_layouts_must_agree_and_layout_changes_recall(ms, d, clock):
    grant = ms.delegate(A, d)
    other = msgspec.structs.replace(create_op(grant, b"x", 0, clock), layout=Layout(chunk_size=1 << 20, seed=5))
    assert ms.apply_delegated(A, d, grant.epoch, [other]) == [errno.ESTALE]  # would misplace the file's chunks
    with pytest.raises(DelegationHeld):
        ms.set_layout(B, d, Layout(chunk_size=1 << 20))
    ms.set_layout(A, d, Layout(chunk_size=1 << 20))  # the holder may (its mount then stops answering there)
    assert ms.apply_delegated(A, d, grant.epoch, [other]) == [0]


def test_removing_a_held_directory_removes_its_delegation(ms, d, db):
    grant = ms.delegate(A, d)
    assert grant.granted
    ms.rmdir(A, 1, b"d")
    assert not ms.undelegate(A, [d])  # nothing left behind
