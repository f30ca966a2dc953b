"""Scattered small writes on a real cluster (``kvfs up``: three chunk servers, chains of three): the mount gathers
them per chunk (fuse/writes.py, DirtyRuns) and still keeps the README's promises: reads through this mount see
them, another mount sees them after close, fsync makes them survive a kill -9 of the mount, and the later of two
opens' writes to the same bytes wins."""

from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.register_assert_rewrite("cluster_fixtures")
from cluster_fixtures import NEEDS_FUSE, second_mount, wait_until  # noqa: E402

pytest_plugins = ["cluster_fixtures"]
pytestmark = NEEDS_FUSE

PAGE = 4096
SIZE = 12 << 20  # three 4 MiB chunks of the default layout


def scatter(fds: list[int], model: bytearray, writes: int, seed: int) -> None:
    """``writes`` pwrites of 1 byte .. 3 pages at random places (some unaligned, some overlapping), each through
    a random one of ``fds``; ``model`` follows them."""
    rng = random.Random(seed)
    for i in range(writes):
        n = rng.choice((PAGE, PAGE, PAGE, 1, 100, 3 * PAGE))
        off = rng.randrange(0, SIZE - n) // (PAGE if rng.random() < 0.8 else 1) * (PAGE if rng.random() < 0.8 else 1)
        off = min(off, SIZE - n)
        data = rng.randbytes(n)
        os.pwrite(rng.choice(fds), data, off)
        model[off:off + n] = data


def test_random_writes_read_back_here_and_through_a_second_mount_after_close(kvfs_cluster, mnt_dir, tmp_path):
    path = mnt_dir / "random"
    model = bytearray(SIZE)
    fd = os.open(path, os.O_CREAT | os.O_RDWR)
    try:
        os.ftruncate(fd, SIZE)
        scatter([fd], model, 3000, seed=1)
        assert os.pread(fd, SIZE, 0) == model  # reads through this mount see the gathered writes
        scatter([fd], model, 500, seed=2)
    finally:
        os.close(fd)
    with second_mount(kvfs_cluster, tmp_path / "second") as second:
        assert (second / mnt_dir.name / "random").read_bytes() == model  # close-to-open


def test_interleaved_opens_leave_the_later_write_of_each_byte(mnt_dir):
    path = mnt_dir / "interleaved"
    model = bytearray(SIZE)
    path.write_bytes(model)
    fds = [os.open(path, os.O_RDWR), os.open(path, os.O_WRONLY), os.open(path, os.O_RDWR)]
    try:
        for seed in range(3):
            scatter(fds, model, 800, seed=10 + seed)
            assert os.pread(fds[0], SIZE, 0) == model
    finally:
        for fd in fds:
            os.close(fd)
    assert path.read_bytes() == model


def test_reads_side_by_side_all_wait_for_the_gathered_writes(mnt_dir):
    """Reads that arrive while the first of them writes the gathered runs out must wait for it, not read
    storage's older bytes (the kernel splits one large read into FUSE reads that run side by side)."""
    path = mnt_dir / "side-by-side"
    model = bytearray(SIZE)
    fd = os.open(path, os.O_CREAT | os.O_RDWR)
    try:
        os.ftruncate(fd, SIZE)
        for seed in range(3):
            scatter([fd], model, 1000, seed=20 + seed)
            slices = [(off, 1 << 20) for off in range(0, SIZE, 1 << 20)]
            with ThreadPoolExecutor(len(slices)) as pool:
                got = list(pool.map(lambda s: os.pread(fd, s[1], s[0]), slices))
            assert b"".join(got) == model
    finally:
        os.close(fd)


def test_reads_of_gathered_writes_are_answered_without_writing_them_out(kvfs_cluster, mnt_dir, tmp_path):
    """A page cache serves reads from dirty pages; the mount lays its gathered runs over what storage holds. So
    a database re-reading the pages it just wrote reads them back (small and large, unaligned, across the runs'
    edges, through the read cache and past it) while a fresh second mount, which reads storage only, still sees
    the bytes from before, until the close. (An open's first write starts its sequential buffer, which a read
    still writes out first: the reads keep clear of it.)"""
    path = mnt_dir / "read-over"
    before = random.Random(5).randbytes(SIZE)
    path.write_bytes(before)
    model = bytearray(before)
    clear = 1 << 16  # the first write's read-cache block
    rng = random.Random(6)

    def scatter_clear(fd: int, writes: int) -> None:
        for _ in range(writes):
            n = rng.choice((1, 100, PAGE, 3 * PAGE))
            off = rng.randrange(clear, SIZE - n)
            data = rng.randbytes(n)
            os.pwrite(fd, data, off)
            model[off:off + n] = data

    def read_back(fd: int) -> None:
        for _ in range(300):
            n = rng.choice((1, 100, PAGE, 3 * PAGE, 70_000, 300_000))
            off = rng.randrange(clear, SIZE - n)
            assert os.pread(fd, n, off) == model[off:off + n]

    # started first: starting a process closes its copies of open descriptors, a FUSE flush of the file each
    with second_mount(kvfs_cluster, tmp_path / "second") as second:
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, b"first", 0)
            model[0:5] = b"first"
            scatter_clear(fd, 200)
            read_back(fd)
            assert (second / mnt_dir.name / "read-over").read_bytes() == before  # none of it went out
            scatter_clear(fd, 50)
            read_back(fd)  # chunks located here while the writes wait
            assert os.pread(fd, SIZE, 0) == model  # reads the first write's block: all of it goes out first
            read_back(fd)  # no chunk is read where it was located before that
        finally:
            os.close(fd)
        assert (second / mnt_dir.name / "read-over").read_bytes() == model  # close-to-open
    assert path.read_bytes() == model


def _mount_daemon(path: Path) -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"mount" in argv and str(path).encode() in argv:
                return int(entry)
    raise AssertionError(f"no mount daemon serves {path}")


def test_fsynced_scattered_writes_survive_a_kill_9_of_the_mount(kvfs_cluster, mnt_dir, tmp_path):
    name = mnt_dir.name + "/fsynced"
    model = bytearray(SIZE)
    with second_mount(kvfs_cluster, tmp_path / "second") as second:
        fd = os.open(second / name, os.O_CREAT | os.O_RDWR)
        os.ftruncate(fd, SIZE)
        scatter([fd], model, 2000, seed=3)
        os.fsync(fd)
        daemon = _mount_daemon(second)
        os.kill(daemon, signal.SIGKILL)
        wait_until(lambda: not Path(f"/proc/{daemon}").exists() or b"Z" in _state(daemon), 10, "the daemon to die")
        try:
            os.close(fd)
        except OSError:
            pass  # the connection is gone
    assert (kvfs_cluster.mount / name).read_bytes() == model


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().split(b")")[-1][:3]
    except OSError:
        return b"Z"
