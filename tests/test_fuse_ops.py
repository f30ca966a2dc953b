"""The mount's namespace, attribute, xattr and permission operations, driven by real syscalls.

The daemon runs in a subprocess (tests/fuse_harness.py: MetaStore on SQLite + one local chunk
engine); one mount serves the module, each test works in its own directory.
"""

from __future__ import annotations

import errno
import os
import stat
import time

import pytest

from fuse_harness import RENAME_EXCHANGE, RENAME_NOREPLACE, fresh_dir, renameat2, run_as, running_mount

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)

@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    with running_mount(tmp_path_factory.mktemp("fuse_ops"), public=True) as m:
        yield m


@pytest.fixture
def d(mount):
    return fresh_dir(mount, 0o777)


def err(fn, *args, **kwargs) -> int:
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    return info.value.errno


def test_create_stat_read_unlink(d):
    p = d / "f"
    p.write_bytes(b"hello")
    st = os.stat(p)
    assert stat.S_ISREG(st.st_mode) and st.st_size == 5 and st.st_nlink == 1
    assert p.read_bytes() == b"hello"
    assert sorted(os.listdir(d)) == ["f"]
    os.unlink(p)
    assert err(os.stat, p) == errno.ENOENT
    assert err(os.unlink, p) == errno.ENOENT
    assert os.listdir(d) == []


def test_errnos(d):
    f = d / "file"
    f.write_bytes(b"x")
    os.mkdir(d / "sub")
    (d / "sub" / "inner").write_bytes(b"")
    assert err(os.open, f, os.O_CREAT | os.O_EXCL | os.O_WRONLY) == errno.EEXIST
    assert err(os.mkdir, d / "sub") == errno.EEXIST
    assert err(os.rmdir, d / "sub") == errno.ENOTEMPTY
    assert err(os.stat, f / "x") == errno.ENOTDIR
    assert err(os.mkdir, f / "x") == errno.ENOTDIR
    assert err(os.rmdir, f) == errno.ENOTDIR
    assert err(os.open, d / "sub", os.O_WRONLY) == errno.EISDIR
    assert err(os.unlink, d / "sub") == errno.EISDIR
    assert err(os.open, d / "missing", os.O_RDONLY) == errno.ENOENT
    assert err(os.mkdir, d / "missing" / "x") == errno.ENOENT
    long = "n" * 256
    assert err(os.open, d / long, os.O_CREAT | os.O_WRONLY) == errno.ENAMETOOLONG
    assert err(os.mkdir, d / long) == errno.ENAMETOOLONG
    assert err(os.stat, d / long) == errno.ENAMETOOLONG
    ok = "n" * 255
    (d / ok).write_bytes(b"")
    assert ok in os.listdir(d)
    assert err(os.rename, d, d / "sub" / "under") == errno.EINVAL  # a directory into itself


def test_mkdir_rmdir_nlink(d):
    os.mkdir(d / "a", 0o750)
    st = os.stat(d / "a")
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o750 & ~_umask()
    n = os.stat(d).st_nlink
    os.mkdir(d / "b")
    assert os.stat(d).st_nlink == n + 1
    os.rmdir(d / "b")
    os.rmdir(d / "a")
    assert os.stat(d).st_nlink == n - 1
    assert os.listdir(d) == []


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_symlink_readlink_and_hard_links(d):
    (d / "target").write_bytes(b"data")
    os.symlink("target", d / "ln")
    assert os.readlink(d / "ln") == "target"
    assert stat.S_ISLNK(os.lstat(d / "ln").st_mode)
    assert (d / "ln").read_bytes() == b"data"
    os.symlink("/nonexistent/" + "x" * 100, d / "dangling")
    assert os.readlink(d / "dangling").startswith("/nonexistent/")
    assert err(os.readlink, d / "target") == errno.EINVAL
    os.link(d / "target", d / "hard")
    assert os.stat(d / "target").st_nlink == 2
    assert os.stat(d / "hard").st_ino == os.stat(d / "target").st_ino
    os.unlink(d / "target")
    assert os.stat(d / "hard").st_nlink == 1
    assert (d / "hard").read_bytes() == b"data"
    assert err(os.link, d / "hard", d / "ln") == errno.EEXIST
    os.mkdir(d / "dir")
    assert err(os.link, d / "dir", d / "dirlink") == errno.EPERM


def test_rename_plain_and_flags(d):
    (d / "a").write_bytes(b"A")
    (d / "b").write_bytes(b"B")
    assert err(renameat2, d / "a", d / "b", RENAME_NOREPLACE) == errno.EEXIST
    renameat2(d / "a", d / "b", RENAME_EXCHANGE)
    assert (d / "a").read_bytes() == b"B" and (d / "b").read_bytes() == b"A"
    assert err(renameat2, d / "a", d / "nope", RENAME_EXCHANGE) == errno.ENOENT
    renameat2(d / "a", d / "c", RENAME_NOREPLACE)
    assert not (d / "a").exists() and (d / "c").read_bytes() == b"B"
    os.rename(d / "c", d / "b")  # replaces
    assert (d / "b").read_bytes() == b"B" and sorted(os.listdir(d)) == ["b"]
    os.mkdir(d / "x")
    os.mkdir(d / "y")
    (d / "y" / "f").write_bytes(b"")
    assert err(os.rename, d / "x", d / "y") == errno.ENOTEMPTY
    assert err(os.rename, d / "b", d / "x") == errno.EISDIR
    os.rename(d / "y", d / "x" / "y")  # move a directory into another one
    assert os.listdir(d / "x" / "y") == ["f"]
    assert err(os.rename, d / "nope", d / "z") == errno.ENOENT


def test_rename_out_of_the_mount_is_exdev(d, tmp_path):
    (d / "f").write_bytes(b"x")
    assert err(os.rename, d / "f", tmp_path / "f") == errno.EXDEV  # the kernel's answer, never ours


def test_setattr_chmod_chown_utime(d):
    p = d / "f"
    p.write_bytes(b"abc")
    os.chmod(p, 0o640)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.utime(p, ns=(1_000_000_000_123, 2_000_000_000_456))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000_123, 2_000_000_000_456)
    before = time.time_ns()
    os.utime(p)  # UTIME_NOW
    st = os.stat(p)
    assert st.st_mtime_ns >= before - 10**9 and st.st_atime_ns >= before - 10**9


def test_xattrs(d):
    p = d / "f"
    p.write_bytes(b"")
    os.setxattr(p, "user.a", b"1")
    os.setxattr(p, "user.b", b"two" * 100)
    assert os.getxattr(p, "user.a") == b"1"
    assert os.getxattr(p, "user.b") == b"two" * 100
    assert sorted(os.listxattr(p)) == ["user.a", "user.b"]
    assert err(os.setxattr, p, "user.a", b"x", os.XATTR_CREATE) == errno.EEXIST
    assert err(os.setxattr, p, "user.zz", b"x", os.XATTR_REPLACE) == errno.ENODATA
    os.setxattr(p, "user.a", b"3", os.XATTR_REPLACE)
    assert os.getxattr(p, "user.a") == b"3"
    os.removexattr(p, "user.a")
    assert err(os.getxattr, p, "user.a") == errno.ENODATA
    assert err(os.removexattr, p, "user.a") == errno.ENODATA
    assert os.listxattr(p) == ["user.b"]
    os.mkdir(d / "dir")
    os.setxattr(d / "dir", "user.d", b"dir")
    assert os.getxattr(d / "dir", "user.d") == b"dir"


def test_layout_xattr_sets_the_chunk_size_of_new_files(d):
    db = d / "db"
    os.mkdir(db)
    os.setxattr(db, "kvfs.layout", b"chunk_size=64K")
    assert os.getxattr(db, "kvfs.layout").split()[1] == b"chunk_size=65536"
    data = os.urandom(300 * 1024)  # five chunks of 64 KiB
    (db / "f").write_bytes(data)
    assert os.getxattr(db / "f", "kvfs.layout").split()[1] == b"chunk_size=65536"
    assert (db / "f").read_bytes() == data
    assert err(os.setxattr, db, "kvfs.layout", b"chunk_size=100000") == errno.EINVAL
    assert err(os.setxattr, db / "f", "kvfs.layout", b"stripe=2") == errno.ENOTDIR
    assert "kvfs.layout" not in os.listxattr(db)


def test_statfs(mount):
    st = os.statvfs(mount.path)
    assert st.f_bsize > 0 and st.f_blocks > 0 and 0 < st.f_bfree <= st.f_blocks
    assert st.f_files > 0 and st.f_namemax == 255


def test_readdir_many_entries(d):
    names = {f"entry-{i:05d}" for i in range(2000)}
    for n in names:
        os.close(os.open(d / n, os.O_CREAT | os.O_WRONLY, 0o644))
    assert set(os.listdir(d)) == names
    with os.scandir(d) as it:  # readdirplus: types come with the entries
        seen = {e.name: e.is_file() for e in it}
    assert len(seen) == 2000 and all(seen.values())
    raw = os.listdir(os.fsencode(d))
    assert len(raw) == 2000
    # a directory changing while it is listed: no entry twice, none that stayed lost
    it = os.scandir(d)
    first = [next(it).name for _ in range(10)]
    for n in sorted(names)[1000:1100]:
        os.unlink(d / n)
    rest = [e.name for e in it]
    it.close()
    listed = first + rest
    assert len(listed) == len(set(listed))
    assert set(sorted(names)[:1000]) | set(sorted(names)[1100:]) <= set(listed)


def test_dot_entries(d):
    os.mkdir(d / "sub")
    # ls -a style listing through libc: "." and ".." come first
    import subprocess
    out = subprocess.run(["ls", "-a", str(d / "sub")], capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == [".", ".."]
    assert os.stat(d / "sub" / "..").st_ino == os.stat(d).st_ino


def test_mknod_fifo(d):
    os.mkfifo(d / "fifo", 0o600)
    assert stat.S_ISFIFO(os.stat(d / "fifo").st_mode)


# ------------------------------------------------------------------ identity and permissions
USER, GROUP, OTHER = 4242, 4343, 4545


def test_caller_identity_reaches_meta(d):
    def create(path):
        with open(path, "wb") as f:
            f.write(b"mine")
        st = os.stat(path)
        return st.st_uid, st.st_gid

    assert run_as(USER, GROUP, create, d / "mine") == (USER, GROUP)
    os.mkdir(d / "private", 0o700)
    assert run_as(USER, GROUP, create, d / "private" / "x") == ("errno", errno.EACCES)
    assert run_as(USER, GROUP, os.listdir, d / "private") == ("errno", errno.EACCES)
    # owner-only file: another user may not read it, the owner may
    os.chmod(d / "mine", 0o600)
    assert run_as(OTHER, OTHER, lambda p: open(p, "rb").read(), d / "mine") == ("errno", errno.EACCES)
    assert run_as(USER, GROUP, lambda p: open(p, "rb").read(), d / "mine") == b"mine"
    # group permission through a supplementary group
    os.chmod(d / "mine", 0o640)
    read = lambda p: open(p, "rb").read()  # noqa: E731
    assert run_as(OTHER, OTHER, read, d / "mine") == ("errno", errno.EACCES)
    assert run_as(OTHER, OTHER, read, d / "mine", groups=(GROUP,)) == b"mine"
    # chmod by a non-owner, chown to someone else: EPERM
    assert run_as(OTHER, OTHER, os.chmod, d / "mine", 0o777) == ("errno", errno.EPERM)
    assert run_as(USER, GROUP, os.chown, d / "mine", OTHER, -1) == ("errno", errno.EPERM)
    # explicit times need ownership; "now" needs only write access
    os.chmod(d / "mine", 0o666)
    assert run_as(OTHER, OTHER, os.utime, d / "mine", (1, 1)) == ("errno", errno.EPERM)
    assert run_as(OTHER, OTHER, os.utime, d / "mine") is None
    # access(2) answers for the caller
    os.chmod(d / "mine", 0o600)
    assert run_as(OTHER, OTHER, os.access, d / "mine", os.R_OK) is False
    assert run_as(USER, GROUP, os.access, d / "mine", os.R_OK | os.W_OK) is True


def test_sticky_directory(d):
    os.chmod(d, 0o1777)
    run_as(USER, USER, lambda p: open(p, "wb").close(), d / "u")
    assert run_as(OTHER, OTHER, os.unlink, d / "u") == ("errno", errno.EPERM)
    assert run_as(USER, USER, os.unlink, d / "u") is None


def test_truncate_needs_write_permission(d):
    p = d / "ro"
    p.write_bytes(b"12345")
    os.chmod(p, 0o644)
    assert run_as(OTHER, OTHER, os.truncate, p, 0) == ("errno", errno.EACCES)
    assert os.stat(p).st_size == 5
