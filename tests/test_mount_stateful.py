"""A stateful hypothesis test: random sequences of file and directory operations, applied to the real mount and
to a local directory side by side; every result, errno and byte must agree (issue 4, §3).

Each example works in a fresh subdirectory of the shared ``kvfs up`` mount (tests/cluster_fixtures.py) and of a
local temporary directory. Names come from a tiny alphabet so operations collide often (EEXIST, ENOTEMPTY, ENOTDIR,
EISDIR, ELOOP ...); offsets and sizes straddle the 1 MiB chunk boundaries. Up to four opens (read-write,
write-only or read-only) stay open across other steps, to write and read through. After every step the two trees must list
and lstat the same; at the end of an example every file's bytes are compared, then both trees are removed.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import random
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

pytest.register_assert_rewrite("cluster_fixtures")
from cluster_fixtures import NEEDS_FUSE  # noqa: E402

pytest_plugins = ["cluster_fixtures"]
pytestmark = NEEDS_FUSE

MIB = 1 << 20
EXAMPLES = int(os.environ.get("KVFS_STATEFUL_EXAMPLES", 30))  # e.g. 500 for a longer hunt than CI's
_libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
MAX_HELD = 4  # opens the machine keeps across other operations

names = st.sampled_from(["a", "b", "c"])
paths = st.one_of(names, names, st.lists(names, min_size=2, max_size=3).map("/".join))
offsets = st.one_of(st.sampled_from([0, 1, 4095, 4096, MIB - 3, MIB, MIB + 7, 2 * MIB - 1]), st.integers(0, 3 * MIB))
sizes = st.one_of(st.sampled_from([0, 1, 4096, 65537, MIB + 1]), st.integers(0, 300_000))
lengths = st.one_of(st.sampled_from([0, 1, MIB - 1, MIB, MIB + 1, 2 * MIB + 5]), st.integers(0, 3 * MIB))
modes = st.sampled_from([0o644, 0o600, 0o755, 0o444, 0o000, 0o1777])


def data_of(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except OSError as e:
        return ("err", errno.errorcode.get(e.errno, e.errno))


def renameat2(old, new, flags: int) -> None:
    if _libc.renameat2(-100, os.fsencode(old), -100, os.fsencode(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def describe(st_: os.stat_result) -> tuple:
    """What must agree between the filesystems (not times, inode numbers, a directory's byte size)."""
    kind = stat.S_IFMT(st_.st_mode)
    return (stat.filemode(st_.st_mode), st_.st_nlink, None if kind == stat.S_IFDIR else st_.st_size)


def tree(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st_ = os.lstat(p)
            out[str(p.relative_to(root))] = describe(st_) + (
                (os.readlink(p),) if stat.S_ISLNK(st_.st_mode) else ())
    return out


class Roots:
    mount: Path
    local: Path


_examples = itertools.count()


class FsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        n = next(_examples)
        self.roots = (Roots.local / f"ex{n}", Roots.mount / f"ex{n}")
        for r in self.roots:
            r.mkdir()
        self.held: list[tuple[int, int]] = []  # (local fd, kvfs fd) of opens kept across other operations

    def pick(self, data) -> str:
        """Mostly a path that exists (in the local tree), sometimes any: so operations mostly do something."""
        existing = sorted(tree(self.roots[0]))
        return data.draw(st.one_of(st.sampled_from(existing), paths) if existing else paths)

    def new(self, data) -> str:
        """A name in the top directory or under an existing entry (which may be a file: ENOTDIR)."""
        existing = sorted(tree(self.roots[0]))
        parent = data.draw(st.one_of(st.just(""), st.sampled_from(existing)) if existing else st.just(""))
        return f"{parent}/{data.draw(names)}" if parent else data.draw(names)

    def both(self, op, *rel_args, extra=()):
        """Run ``op(path..., *extra)`` on both trees and require the same outcome."""
        local, mounted = (outcome(op, *[root / a for a in rel_args], *extra) for root in self.roots)
        assert local == mounted, f"{op.__name__}{rel_args + tuple(extra)!r}: local {local!r}, kvfs {mounted!r}"
        return mounted

    @initialize(seed=st.integers(0, 2**16), size=sizes)
    def populate(self, seed, size):
        """Start from a small tree, so that early operations find something to work on."""
        for root in self.roots:
            (root / "a").write_bytes(data_of(seed, size))
            os.mkdir(root / "b")
            (root / "b" / "a").write_bytes(b"small")
            os.symlink("b", root / "c")

    # -------------------------------------------------------------------------------------- files
    @rule(data=st.data(), seed=st.integers(0, 2**16), size=sizes, excl=st.booleans())
    def create(self, data, seed, size, excl):
        def op(p, flags, data):
            fd = os.open(p, flags, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        flags = os.O_CREAT | os.O_WRONLY | (os.O_EXCL if excl else os.O_TRUNC)
        self.both(op, self.new(data), extra=(flags, data_of(seed, size)))

    @rule(data=st.data(), offset=offsets, seed=st.integers(0, 2**16), size=sizes)
    def write_at(self, data, offset, seed, size):
        def op(p, offset, data):
            fd = os.open(p, os.O_WRONLY)
            try:
                return os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
        self.both(op, self.pick(data), extra=(offset, data_of(seed, size)))

    @rule(data=st.data(), seed=st.integers(0, 2**16), size=sizes)
    def append(self, data, seed, size):
        def op(p, data):
            fd = os.open(p, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, data)
                return os.fstat(fd).st_size
            finally:
                os.close(fd)
        self.both(op, self.pick(data), extra=(data_of(seed, size),))

    @rule(data=st.data(), length=lengths)
    def truncate(self, data, length):
        self.both(os.truncate, self.pick(data), extra=(length,))

    @rule(data=st.data(), offset=offsets, size=st.integers(0, 2 * MIB))
    def read(self, data, offset, size):
        def op(p, offset, size):
            fd = os.open(p, os.O_RDONLY)
            try:
                return os.pread(fd, size, offset)
            finally:
                os.close(fd)
        self.both(op, self.pick(data), extra=(offset, size))

    # ------------------------------------------------------------------ opens held across operations
    # Several opens of one file at once: writes through two of them to the same bytes, reads through one while
    # another still buffers, and files renamed, truncated or removed while open all meet here.
    @rule(data=st.data(), mode=st.sampled_from([os.O_RDWR, os.O_WRONLY, os.O_RDONLY]))
    def open_held(self, data, mode):
        if len(self.held) >= MAX_HELD:
            return
        rel = self.pick(data)
        local, mounted = (outcome(os.open, root / rel, mode) for root in self.roots)
        if local[0] == mounted[0] == "ok":
            self.held.append((local[1], mounted[1]))
            return
        for kind, fd in (local, mounted):
            if kind == "ok":
                os.close(fd)
        assert local == mounted, f"open({rel!r}, {mode:#o}): local {local!r}, kvfs {mounted!r}"

    def held_pair(self, data) -> tuple[int, int] | None:
        return data.draw(st.sampled_from(self.held)) if self.held else None

    @rule(data=st.data(), offset=offsets, seed=st.integers(0, 2**16), size=sizes)
    def write_held(self, data, offset, seed, size):
        pair = self.held_pair(data)
        if pair is not None:
            buf = data_of(seed, size)
            local, mounted = (outcome(os.pwrite, fd, buf, offset) for fd in pair)
            assert local == mounted, f"pwrite(+{offset}, {size}): local {local!r}, kvfs {mounted!r}"

    @rule(data=st.data(), offset=offsets, size=st.integers(0, 2 * MIB))
    def read_held(self, data, offset, size):
        pair = self.held_pair(data)
        if pair is not None:
            local, mounted = (outcome(os.pread, fd, size, offset) for fd in pair)
            assert local == mounted, f"pread(+{offset}, {size}) through a held open differs"

    @rule(data=st.data())
    def close_held(self, data):
        pair = self.held_pair(data)
        if pair is not None:
            self.held.remove(pair)
            local, mounted = (outcome(os.close, fd) for fd in pair)
            assert local == mounted

    @rule(data=st.data())
    def stat_size(self, data):
        self.both(lambda p: describe(os.stat(p)), self.pick(data))

    @rule(data=st.data())
    def unlink(self, data):
        self.both(os.unlink, self.pick(data))

    # -------------------------------------------------------------------------------- directories
    @rule(data=st.data())
    def mkdir(self, data):
        self.both(os.mkdir, self.new(data))

    @rule(data=st.data())
    def rmdir(self, data):
        self.both(os.rmdir, self.pick(data))

    @rule(data=st.data())
    def listdir(self, data):
        path = data.draw(st.one_of(st.just("."), st.builds(self.pick, st.just(data))))
        self.both(lambda p: sorted(os.listdir(p)), path)

    # --------------------------------------------------------------------------------- namespace
    @rule(data=st.data(), flags=st.sampled_from([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]))
    def rename(self, data, flags):
        src = self.pick(data)
        dst = data.draw(st.one_of(st.builds(self.new, st.just(data)), st.builds(self.pick, st.just(data))))
        self.both(renameat2, src, dst, extra=(flags,))

    @rule(data=st.data(), dest=paths)
    def symlink(self, data, dest):
        self.both(lambda p, t: os.symlink(t, p), self.new(data), extra=(dest,))

    @rule(data=st.data())
    def readlink(self, data):
        self.both(os.readlink, self.pick(data))

    @rule(data=st.data())
    def link(self, data):
        self.both(lambda s, d: os.link(s, d, follow_symlinks=False), self.pick(data), self.new(data))

    @rule(data=st.data(), mode=modes)
    def chmod(self, data, mode):
        self.both(os.chmod, self.pick(data), extra=(mode,))

    # -------------------------------------------------------------------------------- invariants
    @invariant()
    def same_tree(self):
        local, mounted = (tree(r) for r in self.roots)
        assert local == mounted

    def teardown(self):
        for pair in self.held:
            for fd in pair:
                os.close(fd)
        try:
            for rel in tree(self.roots[0]):
                local, mounted = (r / rel for r in self.roots)
                if stat.S_ISREG(os.lstat(local).st_mode):
                    assert local.read_bytes() == mounted.read_bytes(), f"contents of {rel} differ"
        finally:
            for r in self.roots:
                shutil.rmtree(r)  # as root, modes do not stand in the way


def test_random_operations_agree_with_local_disk(kvfs_cluster, request):
    base = kvfs_cluster.mount / "stateful"
    base.mkdir(exist_ok=True)
    local = Path(tempfile.mkdtemp(prefix="kvfs-stateful-", dir="/tmp"))
    Roots.mount, Roots.local = base, local
    try:
        run_state_machine_as_test(FsMachine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=30, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        ))
    finally:
        shutil.rmtree(local, ignore_errors=True)
