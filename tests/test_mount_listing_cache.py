"""The mount's listings with attributes (fuse/coherence.py) on real mounts: a second mount answers lookups and stats
of a directory it read from memory, and still sees every change another mount makes there; and a mount that only
removes names in a directory asks for no delegation of it (fuse/dirops.py, ``want``)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

pytest.register_assert_rewrite("cluster_fixtures")
from cluster_fixtures import NEEDS_FUSE, second_mount, started, wait_until  # noqa: E402

pytest_plugins = ["cluster_fixtures"]
pytestmark = NEEDS_FUSE

LISTED = "names listed, absent names are answered here"
GRANTED = "is delegated to this mount"
#: The second mount's kernel keeps nothing (entries and attributes for 1 ms, no negative entries), so every stat
#: reaches the daemon and whatever it answers from its own listings shows.
NO_KERNEL_CACHE = ("--entry-timeout", "0", "--attr-timeout", "0", "--negative-timeout", "0",
                   "--coherent-timeout", "0.001", "--log-level", "DEBUG")


@pytest.fixture(scope="module")
def cluster():
    with started("kvfs-listing-") as c:
        yield c


def _soon(predicate, what: str) -> None:
    wait_until(predicate, 0.5, what, interval=0.01)


def _stat(path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _stats_while_meta_is_stopped(cluster, directory, names: list[str]) -> list[int]:
    """Sizes of ``names`` in ``directory`` taken by a child process while meta is stopped (SIGSTOP): only a mount
    that answers from memory can give them; one that asks meta hangs until the child's timeout. The child looks the
    names up in a descriptor of the directory, so no lookup of the directory itself (in a parent the mount has not
    listed) is needed."""
    meta = cluster.pid("meta")
    assert meta is not None
    script = "import os, sys; print([os.stat(n, dir_fd=int(sys.argv[1])).st_size for n in sys.argv[2:]])"
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    os.kill(meta, signal.SIGSTOP)
    try:
        result = subprocess.run([sys.executable, "-c", script, str(fd), *names], capture_output=True, text=True,
                                timeout=3, pass_fds=(fd,))
    except subprocess.TimeoutExpired:
        pytest.fail("a stat waited for meta: the listing did not answer it")
    finally:
        os.kill(meta, signal.SIGCONT)
        os.close(fd)
    assert result.returncode == 0, result.stderr
    return eval(result.stdout)  # noqa: S307 - a list of ints this test printed


def test_a_second_mount_answers_stats_from_its_listing_and_sees_another_mounts_changes(cluster, tmp_path):
    """The second mount reads the directory's listing with attributes after a couple of lookups reach meta, then
    answers stats without meta (it is stopped meanwhile). Another mount's create, unlink, rename, chmod and growth
    of a file there show within half a second all the same: the feed drops what changed."""
    first = cluster.mount / "listed"
    first.mkdir()
    for i in range(40):
        (first / f"f{i:02d}").write_bytes(b"x" * i)
    log = tmp_path / "second.log"
    with second_mount(cluster, tmp_path / "second", *NO_KERNEL_CACHE, log=log) as second:
        time.sleep(0.5)  # following the feed
        there = second / "listed"
        time.sleep(1.0)  # the first mount's creates are older than LISTING_QUIET
        assert [os.stat(there / f"f{i:02d}").st_size for i in range(40)] == list(range(40))
        wait_until(lambda: LISTED in log.read_text(), 5, "the listing")
        names = [f"f{i:02d}" for i in range(40)]
        assert _stats_while_meta_is_stopped(cluster, there, names) == list(range(40))

        (first / "new").write_bytes(b"new")
        _soon(lambda: (s := _stat(there / "new")) is not None and s.st_size == 3, "another mount's create")
        os.unlink(first / "f00")
        _soon(lambda: _stat(there / "f00") is None, "another mount's unlink")
        os.rename(first / "f01", first / "renamed")
        _soon(lambda: _stat(there / "f01") is None and _stat(there / "renamed") is not None, "its rename")
        os.chmod(first / "f02", 0o600)
        _soon(lambda: stat.S_IMODE(os.stat(there / "f02").st_mode) == 0o600, "its chmod")
        with open(first / "f03", "ab") as f:
            f.write(b"grown")
        _soon(lambda: os.stat(there / "f03").st_size == 3 + 5, "its write")
        os.truncate(first / "f04", 1)
        _soon(lambda: os.stat(there / "f04").st_size == 1, "its truncate")

        # and the second mount's own changes show in its own answers at once
        os.chmod(there / "f05", 0o640)
        assert stat.S_IMODE(os.stat(there / "f05").st_mode) == 0o640
        with open(there / "f06", "ab") as f:
            f.write(b"mine")
        assert os.stat(there / "f06").st_size == 6 + 4
        os.rename(there / "f07", there / "moved")
        assert _stat(there / "f07") is None and os.stat(there / "moved").st_size == 7
        os.link(there / "f08", there / "linked")
        assert os.stat(there / "f08").st_nlink == 2
        os.unlink(there / "linked")
        assert os.stat(there / "f08").st_nlink == 1
        assert sorted(os.listdir(first)) == sorted(os.listdir(there))


def test_a_mount_that_only_removes_names_does_not_ask_for_the_directory(cluster, tmp_path):
    """Under a delegation a mount answers only removals of files it made there, so removing files another mount
    made (``rm`` of a tree it did not create) asks for no grant: none to pay for (a transaction that reads every
    name), and none for the other mount's next look into the directory to recall."""
    first = cluster.mount / "removed-elsewhere"
    first.mkdir()
    for i in range(20):
        (first / f"old{i:02d}").write_bytes(b"old")
    log = tmp_path / "remover.log"
    with second_mount(cluster, tmp_path / "remover", "--log-level", "DEBUG", log=log) as remover:
        time.sleep(0.5)
        for i in range(20):
            os.unlink(remover / "removed-elsewhere" / f"old{i:02d}")
        assert GRANTED not in log.read_text()
        assert os.listdir(first) == []
        (first / "after").write_bytes(b"after")
        _soon(lambda: (remover / "removed-elsewhere" / "after").exists(), "the first mount's create")
