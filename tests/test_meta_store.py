"""MetaStore: every operation, its errnos and POSIX permission rules, on the SQLite engine."""

from __future__ import annotations

import errno
import inspect
import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfs.errors import KvfsError
from kvfs.meta.api import MetaApi
from kvfs.meta.ops import entries as entry_ops
from kvfs.meta.chunks import MemoryChunkRemover
from kvfs.meta.fsck import check
from kvfs.meta.posix import clears_only_set_id
from kvfs.kv.keys import pack
from kvfs.chunkserver.placement import chunk_chain, permutation, splitmix64
from kvfs.meta.store import (
    LAYOUT_XATTR,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    XATTR_CREATE,
    XATTR_REPLACE,
    MetaStore,
)
from kvfs.meta.types import ROOT, Caller, Layout

ALICE = Caller(1000, 1000)
BOB = Caller(1001, 1001)
CAROL = Caller(1002, 1002, (1000,))  # in alice's group


@pytest.fixture
def remover():
    return MemoryChunkRemover()


@pytest.fixture
def ms(db, remover):
    m = MetaStore(db, chunk_remover=remover, space=lambda: (10 << 30, 4 << 30))
    m.format(mode=0o777)
    yield m
    assert check(db) == []  # every test leaves a consistent namespace


def fails(code: int, fn, *args, **kw) -> None:
    with pytest.raises(KvfsError) as info:
        fn(*args, **kw)
    assert info.value.errno == code, f"expected {errno.errorcode[code]}, got {info.value}"


def names(ms: MetaStore, ino: int, caller: Caller = ROOT) -> list[bytes]:
    return [e.name for e in ms.readdir(caller, ino, limit=1000).entries]


# ----------------------------------------------------------------------------- basics ----------
def test_format_is_idempotent(ms, db):
    root = ms.getattr(ROOT, ROOT_INO)
    assert stat.S_ISDIR(root.mode) and root.nlink == 2 and root.ino == 1
    again = MetaStore(db).format()
    assert again.ctime_ns == root.ctime_ns
    assert ms.statfs(ROOT).files == 1


def test_mkdir_lookup_nlink_and_times(ms):
    before = ms.getattr(ROOT, ROOT_INO)
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    assert stat.S_ISDIR(d.mode) and d.nlink == 2 and d.uid == 1000 and d.gid == 1000
    root = ms.getattr(ROOT, ROOT_INO)
    assert root.nlink == 3 and root.mtime_ns >= before.mtime_ns and root.ctime_ns == root.mtime_ns
    assert ms.lookup(ALICE, ROOT_INO, "d").ino == d.ino
    assert ms.lookup(ALICE, d.ino, b".").ino == d.ino
    assert ms.lookup(ALICE, d.ino, b"..").ino == ROOT_INO
    fails(errno.ENOENT, ms.lookup, ALICE, ROOT_INO, b"nope")
    fails(errno.EEXIST, ms.mkdir, ALICE, ROOT_INO, b"d", 0o755)
    fails(errno.ENOENT, ms.mkdir, ALICE, 999_999, b"x", 0o755)


def test_names(ms):
    odd = b"\xff\x01 \xe2\x98\x83"
    ms.mknod(ALICE, ROOT_INO, odd, stat.S_IFREG | 0o644)
    assert names(ms, ROOT_INO) == [odd]
    fails(errno.ENAMETOOLONG, ms.mkdir, ALICE, ROOT_INO, b"x" * 256, 0o755)
    ms.mkdir(ALICE, ROOT_INO, b"y" * 255, 0o755)
    fails(errno.ENAMETOOLONG, ms.lookup, ALICE, ROOT_INO, b"x" * 256)
    for bad in (b"a/b", b"a\0b", b".", b"..", b""):
        fails(errno.EINVAL, ms.mkdir, ALICE, ROOT_INO, bad, 0o755)


def test_create_open_and_exclusive(ms):
    o = ms.create(ALICE, ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT)
    assert stat.S_ISREG(o.attr.mode) and o.session is not None
    fails(errno.EEXIST, ms.create, ALICE, ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    again = ms.create(ALICE, ROOT_INO, b"f", 0o644, os.O_RDONLY | os.O_CREAT)
    assert again.attr.ino == o.attr.ino and again.session is None
    fails(errno.ENOTDIR, ms.create, ALICE, o.attr.ino, b"g", 0o644)
    fails(errno.EACCES, ms.open, BOB, o.attr.ino, os.O_WRONLY)
    assert ms.open(BOB, o.attr.ino, os.O_RDONLY).session is None
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    fails(errno.EISDIR, ms.open, ALICE, d.ino, os.O_RDWR)


def test_mknod_types(ms):
    assert stat.S_ISFIFO(ms.mknod(ALICE, ROOT_INO, b"fifo", stat.S_IFIFO | 0o600).mode)
    assert stat.S_ISSOCK(ms.mknod(ALICE, ROOT_INO, b"sock", stat.S_IFSOCK | 0o600).mode)
    fails(errno.EPERM, ms.mknod, ALICE, ROOT_INO, b"chr", stat.S_IFCHR | 0o600, 0x0501)
    assert ms.mknod(ROOT, ROOT_INO, b"chr", stat.S_IFCHR | 0o600, 0x0501).rdev == 0x0501
    assert stat.S_ISBLK(ms.mknod(ROOT, ROOT_INO, b"blk", stat.S_IFBLK | 0o600, 7).mode)
    fails(errno.EINVAL, ms.mknod, ROOT, ROOT_INO, b"dir", stat.S_IFDIR | 0o755)


def test_unlink_rmdir(ms):
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    f = ms.mknod(ALICE, d.ino, b"f", stat.S_IFREG | 0o644)
    fails(errno.EISDIR, ms.unlink, ALICE, ROOT_INO, b"d")
    fails(errno.ENOTDIR, ms.rmdir, ALICE, d.ino, b"f")
    fails(errno.ENOTEMPTY, ms.rmdir, ALICE, ROOT_INO, b"d")
    fails(errno.ENOENT, ms.unlink, ALICE, d.ino, b"nope")
    ms.unlink(ALICE, d.ino, b"f")
    fails(errno.ENOENT, ms.mknod, ALICE, f.ino, b"x", 0o644)  # queued file: no longer a dir anyway
    ms.rmdir(ALICE, ROOT_INO, b"d")
    assert ms.getattr(ROOT, ROOT_INO).nlink == 2
    fails(errno.ENOENT, ms.getattr, ROOT, d.ino)
    fails(errno.ENOENT, ms.mkdir, ROOT, d.ino, b"x", 0o755)


def test_symlink_readlink_resolve(ms):
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    f = ms.mknod(ALICE, d.ino, b"f", stat.S_IFREG | 0o644)
    s = ms.symlink(ALICE, ROOT_INO, b"s", b"d/f")
    assert stat.S_ISLNK(s.mode) and s.size == 3
    assert ms.readlink(ALICE, s.ino) == b"d/f"
    fails(errno.EINVAL, ms.readlink, ALICE, f.ino)
    assert ms.resolve(ALICE, "/s").ino == f.ino
    assert ms.resolve(ALICE, "/s", follow=False).ino == s.ino
    ms.symlink(ALICE, ROOT_INO, b"abs", b"/d")
    assert ms.resolve(ALICE, b"/abs/f").ino == f.ino
    ms.symlink(ALICE, ROOT_INO, b"loop1", b"loop2")
    ms.symlink(ALICE, ROOT_INO, b"loop2", b"loop1")
    fails(errno.ELOOP, ms.resolve, ALICE, b"/loop1")
    fails(errno.ENOENT, ms.symlink, ALICE, ROOT_INO, b"e", b"")
    fails(errno.ENAMETOOLONG, ms.symlink, ALICE, ROOT_INO, b"e", b"x" * 5000)


def test_link_and_emlink(ms, monkeypatch):
    f = ms.mknod(ALICE, ROOT_INO, b"f", stat.S_IFREG | 0o644)
    assert ms.link(ALICE, f.ino, ROOT_INO, b"g").nlink == 2
    fails(errno.EEXIST, ms.link, ALICE, f.ino, ROOT_INO, b"g")
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    fails(errno.EPERM, ms.link, ALICE, d.ino, ROOT_INO, b"d2")
    monkeypatch.setattr(entry_ops, "LINK_MAX", 3)
    ms.link(ALICE, f.ino, ROOT_INO, b"h")
    fails(errno.EMLINK, ms.link, ALICE, f.ino, ROOT_INO, b"i")
    for i in range(4):  # subdirectories are not limited (ext4's dir_nlink): the count goes on
        ms.mkdir(ALICE, d.ino, f"sub{i}", 0o755)
    ms.mkdir(ALICE, ROOT_INO, b"moved", 0o755)
    ms.rename(ALICE, ROOT_INO, b"moved", d.ino, b"moved")
    assert ms.getattr(ALICE, d.ino).nlink == 2 + 5
    ms.unlink(ALICE, ROOT_INO, b"f")
    assert ms.lookup(ALICE, ROOT_INO, b"g").nlink == 2


# ----------------------------------------------------------------------------- permissions -----
def test_parent_permissions(ms):
    fails(errno.EACCES, ms.mkdir, ALICE, ms.mkdir(ROOT, ROOT_INO, b"rootonly", 0o755).ino, b"x", 0o755)
    private = ms.mkdir(ALICE, ROOT_INO, b"private", 0o700)
    ms.mknod(ALICE, private.ino, b"f", 0o644)
    fails(errno.EACCES, ms.lookup, BOB, private.ino, b"f")  # no search permission
    fails(errno.EACCES, ms.readdir, BOB, private.ino)
    fails(errno.EACCES, ms.resolve, BOB, b"/private/f")
    assert ms.lookup(ROOT, private.ino, b"f")  # root bypasses
    shared = ms.mkdir(ALICE, ROOT_INO, b"shared", 0o770)
    ms.mknod(CAROL, shared.ino, b"by-carol", 0o644)  # group member
    fails(errno.EACCES, ms.mknod, BOB, shared.ino, b"by-bob", 0o644)
    fails(errno.EACCES, ms.unlink, BOB, shared.ino, b"by-carol")
    readonly = ms.mkdir(ALICE, ROOT_INO, b"ro", 0o555)
    ms.mknod(ROOT, readonly.ino, b"f", 0o644)
    fails(errno.EACCES, ms.unlink, ALICE, readonly.ino, b"f")
    fails(errno.EACCES, ms.rename, ALICE, readonly.ino, b"f", ROOT_INO, b"g")


def test_sticky_directory(ms):
    tmp = ms.mkdir(ROOT, ROOT_INO, b"tmp", 0o1777)
    ms.mknod(ALICE, tmp.ino, b"a", 0o644)
    fails(errno.EPERM, ms.unlink, BOB, tmp.ino, b"a")
    fails(errno.EPERM, ms.rename, BOB, tmp.ino, b"a", tmp.ino, b"b")
    ms.mknod(BOB, tmp.ino, b"b", 0o644)
    fails(errno.EPERM, ms.rename, ALICE, tmp.ino, b"a", tmp.ino, b"b")  # would replace bob's file
    ms.unlink(ALICE, tmp.ino, b"a")
    ms.unlink(ROOT, tmp.ino, b"b")


def test_setgid_directory_inheritance(ms):
    d = ms.mkdir(ROOT, ROOT_INO, b"proj", 0o2777)
    ms.setattr(ROOT, d.ino, gid=500)
    f = ms.mknod(ALICE, d.ino, b"f", stat.S_IFREG | 0o2755)
    assert f.gid == 500 and not f.mode & stat.S_ISGID  # alice is not in group 500
    sub = ms.mkdir(ALICE, d.ino, b"sub", 0o755)
    assert sub.gid == 500 and sub.mode & stat.S_ISGID


def test_chmod_chown(ms):
    f = ms.mknod(ALICE, ROOT_INO, b"f", stat.S_IFREG | 0o644)
    fails(errno.EPERM, ms.setattr, BOB, f.ino, mode=0o777)
    assert stat.S_IMODE(ms.setattr(ALICE, f.ino, mode=0o6755).mode) == 0o6755
    fails(errno.EPERM, ms.setattr, ALICE, f.ino, uid=BOB.uid)
    fails(errno.EPERM, ms.setattr, ALICE, f.ino, gid=BOB.gid)
    a = ms.setattr(Caller(1000, 1000, (77,)), f.ino, gid=77)
    assert a.gid == 77 and not a.mode & (stat.S_ISUID | stat.S_ISGID)  # chown clears set-id bits
    assert ms.setattr(ROOT, f.ino, uid=BOB.uid, gid=BOB.gid).uid == BOB.uid
    ms.setattr(BOB, f.ino, mode=0o2755)
    assert ms.getattr(BOB, f.ino).mode & stat.S_ISGID


def test_chmod_by_non_member_clears_setgid(ms):
    f = ms.mknod(ALICE, ROOT_INO, b"f", stat.S_IFREG | 0o644)
    ms.setattr(ROOT, f.ino, gid=42)
    assert not ms.setattr(ALICE, f.ino, mode=0o2755).mode & stat.S_ISGID
    assert ms.setattr(ROOT, f.ino, mode=0o2755).mode & stat.S_ISGID


def test_truncate_and_times(ms):
    f = ms.mknod(ALICE, ROOT_INO, b"f", stat.S_IFREG | 0o644)
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    fails(errno.EACCES, ms.setattr, BOB, f.ino, size=0)
    fails(errno.EISDIR, ms.setattr, ALICE, d.ino, size=0)
    fails(errno.EINVAL, ms.setattr, ALICE, f.ino, size=-1)
    a = ms.setattr(ALICE, f.ino, size=4096)
    assert a.size == 4096 and a.blocks == 8
    fails(errno.EPERM, ms.setattr, BOB, f.ino, atime=5, mtime=6)
    fails(errno.EACCES, ms.setattr, BOB, f.ino, atime="now", mtime="now")
    a = ms.setattr(ALICE, f.ino, atime=0, mtime=123_456_789_012)
    assert (a.atime_ns, a.mtime_ns) == (0, 123_456_789_012) and a.ctime_ns > a.mtime_ns
    b = ms.setattr(ALICE, f.ino, mtime="now")
    assert b.atime_ns == 0 and b.mtime_ns > a.mtime_ns
    ms.setattr(ALICE, f.ino, mode=0o666)
    assert ms.setattr(BOB, f.ino, atime="now", mtime="now").atime_ns > 0  # writer may touch


def test_write_clears_setuid(ms):
    o = ms.create(ALICE, ROOT_INO, b"f", 0o6777)
    other = ms.open(BOB, o.attr.ino, os.O_WRONLY)
    a = ms.report_length(BOB, o.attr.ino, other.session, 10)
    assert a.size == 10 and not a.mode & (stat.S_ISUID | stat.S_ISGID)
    ms.setattr(ROOT, o.attr.ino, mode=0o6777)
    assert ms.report_length(ROOT, o.attr.ino, o.session, 5).mode & stat.S_ISUID  # root keeps them
    ms.setattr(ROOT, o.attr.ino, mode=0o2767)  # set-gid without group execute: kept for a member of the group
    assert ms.report_length(CAROL, o.attr.ino, ms.open(CAROL, o.attr.ino, os.O_WRONLY).session, 5).mode & stat.S_ISGID
    assert not ms.report_length(BOB, o.attr.ino, other.session, 5).mode & stat.S_ISGID  # dropped for anyone else


def test_a_writer_may_drop_set_id_bits_of_a_file_it_does_not_own(ms):
    """What the kernel asks for, in the writer's name, before a write or truncate through FUSE."""
    f = ms.mknod(ALICE, ROOT_INO, b"f", stat.S_IFREG | 0o6777).ino
    assert stat.S_IMODE(ms.setattr(CAROL, f, mode=0o2777).mode) == 0o2777
    ms.setattr(ALICE, f, mode=0o6777)
    assert stat.S_IMODE(ms.setattr(BOB, f, mode=0o2777).mode) == 0o777  # set-gid goes too: not in the group
    fails(errno.EPERM, ms.setattr, BOB, f, mode=0o775)  # anything more is a chmod: the owner's
    fails(errno.EPERM, ms.setattr, BOB, f, mode=0o4777)
    ms.setattr(ALICE, f, mode=0o6755)
    fails(errno.EACCES, ms.setattr, BOB, f, mode=0o755)  # not a writer
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o2777).ino
    fails(errno.EPERM, ms.setattr, BOB, d, mode=0o777)  # only files lose set-id bits to writes


@given(st.integers(0, 0o7777), st.integers(0, 0o7777))
def test_a_writer_may_ask_for_exactly_the_modes_with_set_id_bits_dropped(old, new):
    dropped = {old & ~bits for bits in (stat.S_ISUID, stat.S_ISGID, stat.S_ISUID | stat.S_ISGID)} - {old}
    assert clears_only_set_id(stat.S_IFREG | old, stat.S_IFREG | new) == (new in dropped)


def test_truncate_through_a_write_session_needs_no_write_permission_now(ms):
    o = ms.create(BOB, ROOT_INO, b"f", 0, os.O_RDWR)  # mode 0, opened for writing: ftruncate works
    assert ms.setattr(BOB, o.attr.ino, size=10, session=o.session).size == 10
    fails(errno.EACCES, ms.setattr, BOB, o.attr.ino, size=0)  # truncate(2) by name checks the mode
    reader = ms.open(ROOT, o.attr.ino, os.O_RDONLY, hold=True)
    fails(errno.EBADF, ms.setattr, BOB, o.attr.ino, size=0, session=reader.hold)  # a hold is no write session
    other = ms.mknod(BOB, ROOT_INO, b"g", stat.S_IFREG | 0o600).ino
    fails(errno.EBADF, ms.setattr, BOB, other, size=0, session=o.session)  # another file's session


# ----------------------------------------------------------------------------- rename ----------
def test_rename_basics(ms):
    a = ms.mkdir(ALICE, ROOT_INO, b"a", 0o755)
    b = ms.mkdir(ALICE, ROOT_INO, b"b", 0o755)
    f = ms.mknod(ALICE, a.ino, b"f", 0o644)
    ms.rename(ALICE, a.ino, b"f", b.ino, b"g")
    assert names(ms, a.ino) == [] and ms.lookup(ALICE, b.ino, b"g").ino == f.ino
    fails(errno.ENOENT, ms.rename, ALICE, a.ino, b"f", b.ino, b"x")
    # a directory changes parents: nlinks and ".."
    ms.rename(ALICE, ROOT_INO, b"a", b.ino, b"a")
    assert ms.getattr(ROOT, ROOT_INO).nlink == 3 and ms.getattr(ROOT, b.ino).nlink == 3
    assert ms.lookup(ALICE, a.ino, b"..").ino == b.ino
    # same file under two names: nothing happens
    ms.link(ALICE, f.ino, b.ino, b"h")
    ms.rename(ALICE, b.ino, b"g", b.ino, b"h")
    assert sorted(names(ms, b.ino)) == [b"a", b"g", b"h"]


def test_rename_replaces_and_type_errors(ms, remover):
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    full = ms.mkdir(ALICE, ROOT_INO, b"full", 0o755)
    ms.mknod(ALICE, full.ino, b"x", 0o644)
    empty = ms.mkdir(ALICE, ROOT_INO, b"empty", 0o755)
    f = ms.mknod(ALICE, ROOT_INO, b"f", 0o644)
    g = ms.mknod(ALICE, ROOT_INO, b"g", 0o644)
    fails(errno.ENOTEMPTY, ms.rename, ALICE, ROOT_INO, b"d", ROOT_INO, b"full")
    fails(errno.ENOTDIR, ms.rename, ALICE, ROOT_INO, b"d", ROOT_INO, b"f")
    fails(errno.EISDIR, ms.rename, ALICE, ROOT_INO, b"f", ROOT_INO, b"d")
    fails(errno.EEXIST, ms.rename, ALICE, ROOT_INO, b"f", ROOT_INO, b"g", RENAME_NOREPLACE)
    ms.rename(ALICE, ROOT_INO, b"f", ROOT_INO, b"g")
    assert ms.lookup(ALICE, ROOT_INO, b"g").ino == f.ino
    # never opened for writing, so no chunk server holds any of it: the replaced file goes at once, not via GC
    fails(errno.ENOENT, ms.getattr, ROOT, g.ino)
    assert ms.gc_once() == 0 and remover.removed == []
    nlink = ms.getattr(ROOT, ROOT_INO).nlink
    ms.rename(ALICE, ROOT_INO, b"d", ROOT_INO, b"empty")
    assert ms.getattr(ROOT, ROOT_INO).nlink == nlink - 1
    fails(errno.ENOENT, ms.getattr, ROOT, empty.ino)
    assert ms.lookup(ALICE, ROOT_INO, b"empty").ino == d.ino


def test_rename_into_itself(ms):
    a = ms.mkdir(ALICE, ROOT_INO, b"a", 0o755)
    b = ms.mkdir(ALICE, a.ino, b"b", 0o755)
    c = ms.mkdir(ALICE, b.ino, b"c", 0o755)
    fails(errno.EINVAL, ms.rename, ALICE, ROOT_INO, b"a", c.ino, b"a")
    fails(errno.EINVAL, ms.rename, ALICE, ROOT_INO, b"a", a.ino, b"self")
    fails(errno.ENOTEMPTY, ms.rename, ALICE, b.ino, b"c", ROOT_INO, b"a")  # onto its ancestor
    fails(errno.EINVAL, ms.rename, ALICE, b.ino, b"c", ROOT_INO, b"a", RENAME_EXCHANGE)
    ms.rename(ALICE, b.ino, b"c", ROOT_INO, b"c")  # moving up is fine
    ms.setattr(ROOT, a.ino, mode=0o777)
    ms.setattr(ROOT, ROOT_INO, mode=0o777)
    ms.setattr(ROOT, c.ino, uid=BOB.uid, gid=BOB.gid)
    ms.setattr(ROOT, c.ino, mode=0o555)
    fails(errno.EACCES, ms.rename, BOB, ROOT_INO, b"c", a.ino, b"c")  # its ".." would change
    ms.rename(BOB, ROOT_INO, b"c", ROOT_INO, b"c2")  # same parent: no write access needed
    assert ms.lookup(ALICE, c.ino, b"..").ino == ROOT_INO


def test_rename_exchange(ms):
    a = ms.mkdir(ALICE, ROOT_INO, b"a", 0o755)
    sub = ms.mkdir(ALICE, a.ino, b"sub", 0o755)
    f = ms.mknod(ALICE, ROOT_INO, b"f", 0o644)
    ms.rename(ALICE, a.ino, b"sub", ROOT_INO, b"f", RENAME_EXCHANGE)
    assert ms.lookup(ALICE, ROOT_INO, b"f").ino == sub.ino
    assert ms.lookup(ALICE, a.ino, b"sub").ino == f.ino
    assert ms.getattr(ROOT, a.ino).nlink == 2 and ms.getattr(ROOT, ROOT_INO).nlink == 4
    assert ms.lookup(ALICE, sub.ino, b"..").ino == ROOT_INO
    fails(errno.ENOENT, ms.rename, ALICE, ROOT_INO, b"f", ROOT_INO, b"none", RENAME_EXCHANGE)
    fails(errno.EINVAL, ms.rename, ALICE, ROOT_INO, b"f", ROOT_INO, b"a", RENAME_EXCHANGE | RENAME_NOREPLACE)
    fails(errno.EINVAL, ms.rename, ALICE, ROOT_INO, b"f", ROOT_INO, b"a", 8)


# ----------------------------------------------------------------------------- readdir ---------
def test_readdir_paging_while_changing(ms):
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    stable = {b"s%03d" % i for i in range(0, 60, 2)}
    doomed = {b"s%03d" % i for i in range(1, 60, 2)}
    for name in sorted(stable | doomed):
        ms.mknod(ALICE, d.ino, name, 0o644)
    seen: list[bytes] = []
    cookie, eof, step = b"", False, 0
    while not eof:
        page = ms.readdir(ALICE, d.ino, cookie, limit=7)
        assert all(e.attr.ino for e in page.entries)
        seen += [e.name for e in page.entries]
        cookie, eof = page.cookie, page.eof
        for name in sorted(doomed)[step * 3: step * 3 + 3]:  # the directory changes between pages
            ms.unlink(ALICE, d.ino, name)
        ms.mknod(ALICE, d.ino, b"new%02d" % step, 0o644)
        step += 1
    assert len(seen) == len(set(seen)) and seen == sorted(seen)
    assert stable <= set(seen)
    assert ms.readdir(ALICE, d.ino, cookie).entries == []
    fails(errno.ENOTDIR, ms.readdir, ALICE, ms.lookup(ALICE, d.ino, b"s000").ino)


# ----------------------------------------------------------------------------- statfs ----------
def test_statfs(ms):
    ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    s = ms.statfs(ALICE)
    assert s.files == 2 and s.blocks * s.frsize == 10 << 30 and s.bfree * s.bsize == 4 << 30 and s.namemax == 255


# ----------------------------------------------------------------------------- xattrs ----------
def test_xattrs(ms):
    f = ms.mknod(ALICE, ROOT_INO, b"f", 0o600).ino
    ms.setxattr(ALICE, f, b"user.a", b"1")
    ms.setxattr(ALICE, f, "user.b", b"", XATTR_CREATE)
    assert ms.getxattr(ALICE, f, b"user.a") == b"1" and ms.getxattr(ALICE, f, b"user.b") == b""
    fails(errno.EEXIST, ms.setxattr, ALICE, f, b"user.a", b"2", XATTR_CREATE)
    fails(errno.ENODATA, ms.setxattr, ALICE, f, b"user.c", b"2", XATTR_REPLACE)
    ms.setxattr(ALICE, f, b"user.a", b"2", XATTR_REPLACE)
    assert ms.getxattr(ALICE, f, b"user.a") == b"2"
    fails(errno.ENODATA, ms.getxattr, ALICE, f, b"user.zz")
    fails(errno.ERANGE, ms.setxattr, ALICE, f, b"user." + b"n" * 251, b"")
    fails(errno.E2BIG, ms.setxattr, ALICE, f, b"user.big", b"v" * (64 * 1024 + 1))
    ms.setxattr(ALICE, f, b"user.max", b"v" * (64 * 1024))
    fails(errno.EACCES, ms.getxattr, BOB, f, b"user.a")
    fails(errno.EPERM, ms.setxattr, ALICE, f, b"trusted.t", b"x")
    ms.setxattr(ROOT, f, b"trusted.t", b"x")
    fails(errno.EOPNOTSUPP, ms.setxattr, ALICE, f, b"system.posix_acl_access", b"x")
    fails(errno.EINVAL, ms.setxattr, ALICE, f, b"user.a", b"x", 3)
    assert ms.listxattr(ALICE, f) == [b"user.a", b"user.b", b"user.max"]
    assert b"trusted.t" in ms.listxattr(ROOT, f)
    ms.removexattr(ALICE, f, b"user.a")
    fails(errno.ENODATA, ms.removexattr, ALICE, f, b"user.a")
    link = ms.symlink(ALICE, ROOT_INO, b"l", b"f").ino
    fails(errno.EPERM, ms.setxattr, ALICE, link, b"user.a", b"x")


# ----------------------------------------------------------------------------- sessions + GC ---
def test_sessions_length_and_gc(ms, remover):
    o = ms.create(ALICE, ROOT_INO, b"f", 0o644, os.O_WRONLY)
    ino, sid = o.attr.ino, o.session
    assert ms.report_length(ALICE, ino, sid, 5000).size == 5000
    assert ms.report_length(ALICE, ino, sid, 100).size == 5000  # max, not last
    assert ms.set_length(ALICE, ino, sid, 4000).size == 4000
    fails(errno.EBADF, ms.report_length, ALICE, ino, 12345, 1)
    ms.unlink(ALICE, ROOT_INO, b"f")
    fails(errno.ENOENT, ms.open, ALICE, ino, os.O_RDONLY)
    assert ms.report_length(ALICE, ino, sid, 4500).size == 4500  # unlinked but open: still writable
    assert ms.gc_once() == 0 and remover.removed == []
    assert ms.close(ALICE, ino, sid, exact_length=4200).size == 4200
    ms.close(ALICE, ino, sid)  # retried close is harmless
    files = ms.statfs(ROOT).files
    assert ms.gc_once() == 1
    assert remover.removed == [ino]
    fails(errno.ENOENT, ms.getattr, ROOT, ino)
    assert ms.statfs(ROOT).files == files - 1
    assert ms.gc_once() == 0


def test_a_read_only_open_with_a_hold_keeps_a_removed_file_until_it_closes(ms, remover):
    """POSIX: a file stays readable through descriptors opened before its last name went. Read-only opens
    that ask for it get a hold session, which the collector waits for as for a write session."""
    w = ms.create(ALICE, ROOT_INO, b"written", 0o644, os.O_WRONLY)
    ms.close(ALICE, w.attr.ino, w.session, exact_length=4096)
    never = ms.mknod(ALICE, ROOT_INO, b"never", 0o644)  # no write session ever: no chunks anywhere
    assert ms.open(ALICE, never.ino, os.O_RDONLY).hold is None  # only when asked
    holds = {}
    for name, ino in ((b"written", w.attr.ino), (b"never", never.ino)):
        o = ms.open(BOB, ino, os.O_RDONLY, hold=True)
        assert o.session is None and o.hold is not None
        holds[ino] = o.hold
        ms.unlink(ALICE, ROOT_INO, name)
        assert ms.getattr(BOB, ino).nlink == 0  # still there for fstat
    assert ms.getattr(BOB, never.ino).size == 0 and ms.getattr(BOB, w.attr.ino).size == 4096
    assert ms.gc_once() == 0 and remover.removed == []
    # a hold cannot set lengths: a read-only open must not be a way to change the file
    ino, hold = w.attr.ino, holds[w.attr.ino]
    fails(errno.EBADF, ms.report_length, BOB, ino, hold, 1)
    fails(errno.EBADF, ms.set_length, BOB, ino, hold, 1)
    fails(errno.EBADF, ms.close, BOB, ino, hold, exact_length=1)
    assert ms.close_sessions(BOB, [(i, h, None) for i, h in holds.items()]) == 2
    assert ms.gc_once() == 2 and remover.removed == [w.attr.ino]  # the never-written one needs no chunk removal
    fails(errno.ENOENT, ms.getattr, ROOT, never.ino)


def test_holds_of_a_client_whose_lease_lapses_end(db, remover):
    now = [10**18]
    ms = MetaStore(db, chunk_remover=remover, clock=lambda: now[0], client_lease=60)
    ms.format(mode=0o777)
    crashed = Caller(1000, 1000, client=b"C" * 12)
    f = ms.mknod(crashed, ROOT_INO, b"f", 0o644)
    assert ms.open(crashed, f.ino, os.O_RDONLY, hold=True).hold is not None
    ms.unlink(crashed, ROOT_INO, b"f")
    assert ms.expire_clients() == 0 and ms.gc_once() == 0
    now[0] += 60 * 10**9 + 1
    assert ms.expire_clients() == 1 and ms.gc_once() == 1
    assert check(db) == []


def test_a_hold_asked_for_on_a_write_open_is_the_write_session(ms):
    f = ms.mknod(ALICE, ROOT_INO, b"f", 0o644)
    o = ms.open(ALICE, f.ino, os.O_RDWR, hold=True)
    assert o.session is not None and o.hold is None
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    assert ms.open(ALICE, d.ino, os.O_RDONLY | os.O_DIRECTORY, hold=True).hold is None  # files only
    ms.close(ALICE, f.ino, o.session)


def test_truncate_on_open(ms):
    o = ms.create(ALICE, ROOT_INO, b"f", 0o644, os.O_WRONLY)
    ms.report_length(ALICE, o.attr.ino, o.session, 100)
    t = ms.open(ALICE, o.attr.ino, os.O_WRONLY | os.O_TRUNC)
    assert t.attr.size == 0 and t.session not in (None, o.session)
    fails(errno.EACCES, ms.open, BOB, o.attr.ino, os.O_RDONLY | os.O_TRUNC)


def test_gc_passes_over_files_still_open(ms, remover):
    sessions = []
    for i in range(4):  # queued first (lower inode numbers) but still open
        o = ms.create(ALICE, ROOT_INO, b"open%d" % i, 0o644, os.O_WRONLY)
        sessions.append((o.attr.ino, o.session))
        ms.unlink(ALICE, ROOT_INO, b"open%d" % i)
    closed = []
    for i in range(3):
        o = ms.create(ALICE, ROOT_INO, b"closed%d" % i, 0o644, os.O_WRONLY)
        ms.close(ALICE, o.attr.ino, o.session)
        ms.unlink(ALICE, ROOT_INO, b"closed%d" % i)
        closed.append(o.attr.ino)
    assert ms.gc_once(limit=2) == 2 and ms.gc_once(limit=2) == 1
    assert sorted(remover.removed) == closed
    ms.close_sessions(ALICE, [(ino, sid, None) for ino, sid in sessions])
    assert ms.gc_once(limit=64) == 4


def test_sessions_of_a_client_that_stops_renewing_end_and_its_removed_files_are_collected(db, remover):
    now = [10**18]
    ms = MetaStore(db, chunk_remover=remover, clock=lambda: now[0], client_lease=60)
    ms.format(mode=0o777)
    crashed, alive = Caller(1000, 1000, client=b"A" * 12), Caller(1000, 1000, client=b"B" * 12)
    held = {}
    for who in (crashed, alive, ALICE):  # ALICE: no client id, so no lease (an in-process caller)
        o = ms.create(who, ROOT_INO, who.client or b"local", 0o644, os.O_WRONLY)
        ms.unlink(who, ROOT_INO, who.client or b"local")  # removed while open: GC must wait for the session
        held[who.client] = o
    lease = 60 * 10**9
    now[0] += lease // 2
    assert ms.renew_client(alive) == 60
    assert ms.expire_clients() == 0 and ms.gc_once() == 0
    now[0] += lease // 2 + 1  # the crashed client is silent for over a lease, the live one renewed half-way
    assert ms.expire_clients() == 1
    assert ms.gc_once() == 1 and remover.removed == [held[crashed.client].attr.ino]
    fails(errno.EBADF, ms.report_length, crashed, held[crashed.client].attr.ino, held[crashed.client].session, 1)
    ms.report_length(alive, held[alive.client].attr.ino, held[alive.client].session, 1)  # still open
    assert ms.expire_clients() == 0  # the crashed client's record went with its sessions
    now[0] += 10 * lease
    assert ms.expire_clients() == 1  # the live one stopped renewing too; the lease-less session stays
    for who in (alive, ALICE):
        ms.close(who, held[who.client].attr.ino, held[who.client].session)  # a late close is harmless
    assert ms.gc_once() == 2
    assert check(db) == []


def test_expiring_a_client_goes_on_where_a_full_batch_stopped(db, remover):
    now = [10**18]
    ms = MetaStore(db, chunk_remover=remover, clock=lambda: now[0], client_lease=1)
    ms.format(mode=0o777)
    crashed = Caller(1000, 1000, client=b"C" * 12)
    for i in range(3):
        ms.create(crashed, ROOT_INO, b"f%d" % i, 0o644, os.O_WRONLY)
    now[0] += 2 * 10**9
    assert [ms.expire_clients(limit=2) for _ in range(3)] == [2, 1, 0]
    assert check(db) == []


def test_gc_needs_remover(db):
    m = MetaStore(db)
    m.format()
    fails(errno.ENOSYS, m.gc_once)


# ----------------------------------------------------------------------------- layouts ---------
def test_layout_inheritance(ms):
    assert ms.get_layout(ROOT, ROOT_INO) == Layout(chain_table=1, chunk_size=4 << 20, stripe=1, seed=0)
    d = ms.mkdir(ALICE, ROOT_INO, b"d", 0o755)
    wide = Layout(chain_table=2, chunk_size=4 << 20, stripe=8)
    fails(errno.EPERM, ms.set_layout, BOB, d.ino, wide)
    ms.set_layout(ALICE, d.ino, wide)
    sub = ms.mkdir(ALICE, d.ino, b"sub", 0o755)
    assert ms.get_layout(ALICE, sub.ino) == wide
    f1 = ms.mknod(ALICE, sub.ino, b"f1", 0o644)
    f2 = ms.mknod(ALICE, sub.ino, b"f2", 0o644)
    l1, l2 = ms.get_layout(ALICE, f1.ino), ms.get_layout(ALICE, f2.ino)
    assert (l1.chain_table, l1.chunk_size, l1.stripe) == (2, 4 << 20, 8) and l1.seed != l2.seed
    assert f1.blksize == 4 << 20
    fails(errno.ENOTDIR, ms.set_layout, ALICE, f1.ino, wide)
    for bad in (Layout(chunk_size=3 << 20), Layout(chunk_size=32 << 10), Layout(chunk_size=128 << 20), Layout(stripe=0)):
        fails(errno.EINVAL, ms.set_layout, ALICE, d.ino, bad)


def test_placement_golden_values():
    # These values define where existing data lives: they must never change.
    assert splitmix64(0) == (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF)
    assert permutation(1, 1) == (0,)
    assert permutation(42, 8) == GOLDEN_PERM_42_8
    layout = Layout(chain_table=1, chunk_size=1 << 20, stripe=4, seed=0x1234567)
    assert [chunk_chain(layout, 1234, i, 10) for i in range(8)] == GOLDEN_CHAINS
    assert sorted(permutation(7, 100)) == list(range(100))
    wide = Layout(stripe=16, seed=99)
    assert sorted({chunk_chain(wide, 5, i, 16) for i in range(16)}) == list(range(16))


GOLDEN_PERM_42_8 = (3, 1, 6, 2, 4, 0, 7, 5)
GOLDEN_CHAINS = [9, 2, 1, 0, 9, 2, 1, 0]


# ----------------------------------------------------------------------------- inode ids -------
def test_inode_ids_unique_across_instances_and_never_reused(ms, db):
    other = MetaStore(db)
    ids = [ms.mknod(ALICE, ROOT_INO, b"a%d" % i, 0o644).ino for i in range(5)]
    ids += [other.mknod(ALICE, ROOT_INO, b"b%d" % i, 0o644).ino for i in range(5)]
    assert len(set(ids)) == 10 and ROOT_INO not in ids
    ms.unlink(ALICE, ROOT_INO, b"a0")
    assert ms.mknod(ALICE, ROOT_INO, b"a0", 0o644).ino not in ids


def test_fsck_reports_damage(ms, db):
    f = ms.mknod(ALICE, ROOT_INO, b"f", 0o644)
    ms.link(ALICE, f.ino, ROOT_INO, b"g")
    db.run(lambda tr: tr.clear(pack("meta", "d", ROOT_INO, b"g")))
    assert check(db) == [f"inode {f.ino} nlink 2 != 1"]
    db.run(lambda tr: tr.clear(pack("meta", "i", f.ino)))
    assert len(check(db)) == 2  # dangling entry, wrong inode count
    db.run(lambda tr: tr.clear(pack("meta", "d", ROOT_INO, b"f")))
    db.run(lambda tr: tr.add(pack("meta", "n", "inodes"), -1))


def test_results_cross_the_wire(ms):
    import msgspec

    from kvfs.meta.types import DirPage, Opened, StatFs

    o = ms.create(CAROL, ROOT_INO, b"\xfe", 0o644)
    page = ms.readdir(CAROL, ROOT_INO)
    for value, kind in ((o, Opened), (page, DirPage), (ms.statfs(CAROL), StatFs), (CAROL, Caller)):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=kind) == value


def test_recorded_answers_expire(tmp_path, monkeypatch):
    """Answers kept for retries go after ANSWER_MINUTES; until then a retry gets the first answer."""
    import time as _time

    from kvfs.meta import schema, store as store_module
    from kvfs.kv import open_database
    from kvfs.kv.keys import pack

    s = store_module.MetaStore(open_database(f"sqlite:///{tmp_path / 'm.db'}"))
    s.format()
    encode, decode = (lambda v: pack(v.ino)), (lambda raw: raw)
    with s.answering_once(b"op", encode, decode, retry=False):  # a first try only records
        attr = s.mkdir(ROOT, 1, b"d", 0o755)
    with s.answering_once(b"op", encode, decode):
        assert s.mkdir(ROOT, 1, b"d", 0o755) == pack(attr.ino)  # the recorded answer, no EEXIST

    def answers() -> int:
        return s.db.run(lambda tr: len(list(tr.get_range(*schema.answers_before(1 << 40)))))

    s.expire_answers()
    assert answers() == 1
    now = _time.time()
    monkeypatch.setattr(store_module.time, "time", lambda: now + 60 * (store_module.ANSWER_MINUTES + 1))
    s.expire_answers()
    assert answers() == 0


def test_close_sessions_ends_many_in_one_call_and_a_retry_changes_nothing(ms, remover):
    a = ms.create(ROOT, 1, "a", 0o644)
    b = ms.create(ROOT, 1, "b", 0o644)
    gone = ms.create(ROOT, 1, "gone", 0o644)
    ms.close(ROOT, gone.attr.ino, gone.session)
    ms.unlink(ROOT, 1, "gone")
    assert ms.gc_once() == 1  # its inode no longer exists
    batch = [(a.attr.ino, a.session, 10), (b.attr.ino, b.session, 20), (gone.attr.ino, gone.session, 5)]
    assert ms.close_sessions(ROOT, batch) == 2
    assert ms.getattr(ROOT, a.attr.ino).size == 10 and ms.getattr(ROOT, b.attr.ino).size == 20
    ms.setattr(ROOT, a.attr.ino, size=3)
    assert ms.close_sessions(ROOT, batch) == 0  # a retry: sessions already ended, nothing changes
    assert ms.getattr(ROOT, a.attr.ino).size == 3
    ms.unlink(ROOT, 1, "a")
    assert ms.gc_once() == 1  # no session holds it any more


def test_layout_xattr_shows_and_sets_a_directory_layout(ms):
    d = ms.mkdir(ALICE, ROOT_INO, b"db", 0o755).ino
    assert ms.getxattr(BOB, d, LAYOUT_XATTR) == b"chain_table=1 chunk_size=4194304 stripe=1"
    ms.setxattr(ALICE, d, "kvfs.layout", b"chunk_size=256K")
    ms.setxattr(ALICE, d, LAYOUT_XATTR, b"stripe=4")  # other fields keep their values
    assert ms.get_layout(ALICE, d) == Layout(chain_table=1, chunk_size=256 * 1024, stripe=4)
    f = ms.create(ALICE, d, b"f", 0o644, os.O_WRONLY).attr.ino
    shown = ms.getxattr(ALICE, f, LAYOUT_XATTR)
    assert shown.startswith(b"chain_table=1 chunk_size=262144 stripe=4 seed=") and not shown.endswith(b"seed=0")
    assert LAYOUT_XATTR not in ms.listxattr(ALICE, d)
    for bad in (b"chunk_size=3M", b"chunk_size=32K", b"chunk_size=128M", b"stripe=0", b"seed=5", b"chain_table=2",
                b"chunk_size", b"chunk_size=lots", b"", b"\xff"):
        fails(errno.EINVAL, ms.setxattr, ALICE, d, LAYOUT_XATTR, bad)
    fails(errno.EPERM, ms.setxattr, BOB, d, LAYOUT_XATTR, b"stripe=2")  # owner or root only
    fails(errno.ENOTDIR, ms.setxattr, ALICE, f, LAYOUT_XATTR, b"stripe=2")  # a file's chunks are placed already
    fails(errno.EINVAL, ms.removexattr, ALICE, d, LAYOUT_XATTR)
    assert ms.get_layout(ALICE, d) == Layout(chain_table=1, chunk_size=256 * 1024, stripe=4)


def test_only_files_that_were_ever_opened_for_writing_wait_for_the_collector(ms, remover):
    never = ms.create(ALICE, ROOT_INO, b"never", 0o644, os.O_RDONLY)
    later = ms.mknod(ALICE, ROOT_INO, b"later", 0o644)
    opened = ms.open(ALICE, later.ino, os.O_WRONLY)  # may write chunks from now on
    ms.close(ALICE, later.ino, opened.session)
    written = ms.create(ALICE, ROOT_INO, b"written", 0o644, os.O_WRONLY)
    ms.close(ALICE, written.attr.ino, written.session)
    for name in (b"never", b"later", b"written"):
        ms.unlink(ALICE, ROOT_INO, name)
    fails(errno.ENOENT, ms.getattr, ROOT, never.attr.ino)  # no chunks anywhere: gone with its last name
    assert ms.gc_once() == 2
    assert sorted(remover.removed) == sorted([later.ino, written.attr.ino])
    assert ms.gc_once() == 0


def test_the_store_implements_every_operation_of_the_api_with_its_signature() -> None:
    """meta.rpc derives the wire surface from MetaApi, the store serves it: a parameter added to one and not
    the other would be dropped on the wire or refused by the store."""
    names = [n for n, v in vars(MetaApi).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert len(names) > 20
    for name in names:
        api, store = inspect.signature(getattr(MetaApi, name)), inspect.signature(getattr(MetaStore, name))
        assert api == store, f"{name}: MetaApi{api} but MetaStore{store}"
