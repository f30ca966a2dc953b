"""The mount's listings with attributes (fuse/coherence.py) on real mounts: a second mount answers lookups and stats
of a directory it read from memory, and still sees every change another mount makes there and its own at once; and
a mount that only removes names in a directory asks for no delegation of it (fuse/dirops.py, ``want``).

What the second mount asks meta is counted from its own ``/metrics`` (``kvfs mount --http``,
``kvfs_meta_client_calls_total``), so no service is ever stopped: a test that stopped meta could block for good in a
FUSE request nothing answers. Every wait has a deadline, and the module's timeout bounds each test.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.register_assert_rewrite("cluster_fixtures")
from cluster_fixtures import NEEDS_FUSE, second_mount, started, wait_until  # noqa: E402

pytest_plugins = ["cluster_fixtures"]
pytestmark = [NEEDS_FUSE, pytest.mark.timeout(240)]

#: The observing mount's kernel keeps entries for 1 ms and no negative ones, so every stat reaches the daemon as a
#: lookup and whatever it answers from its own listings shows. Attributes it keeps (the feed drops them when another
#: client changes them): with none kept, each path walk also asked for the directory's attributes, to check the
#: caller may search it, and a listing holds those of the directory's names, not the directory's own.
NO_KERNEL_ENTRIES = ("--entry-timeout", "0", "--negative-timeout", "0", "--attr-timeout", "60",
                     "--coherent-timeout", "0.001")
METRICS = re.compile(r"metrics on (http://\S+/metrics)")
CALL = re.compile(r'^kvfs_meta_client_calls_total\{method="meta\.(\w+)"\} (\S+)$', re.MULTILINE)
#: How long a listing may take to be read: another client's change in a directory holds its read back for
#: LISTING_QUIET (1 s), and a read that such a change voids waits for more lookups.
LISTED_WITHIN = 20.0


class Observer:
    """A second mount of the cluster and what it asks meta."""

    def __init__(self, path: Path, log: Path) -> None:
        self.path = path
        self.log = log
        found = wait_until(lambda: METRICS.search(log.read_text()), 15, "the second mount's metrics address")
        self.url = found.group(1)

    def calls(self) -> dict[str, float]:
        """Calls the mount made to meta so far, by operation."""
        with urllib.request.urlopen(self.url, timeout=5) as reply:
            text = reply.read().decode()
        return {method: float(count) for method, count in CALL.findall(text)}

    def lookups(self) -> float:
        calls = self.calls()
        return calls.get("lookup", 0) + calls.get("getattr", 0)

    def answered_here(self, directory: int, names: list[str]) -> list[os.stat_result]:
        """Stat ``names`` in the directory open as ``directory`` until a round of them asks meta nothing (the
        mount has read the listing since the last change there), and return that round's answers. Without a
        listing every round costs a lookup per name: the kernel keeps no entries here."""
        deadline = time.monotonic() + LISTED_WITHIN
        while True:
            before = self.lookups()
            answers = [os.stat(name, dir_fd=directory) for name in names]
            if self.lookups() == before:
                return answers
            if time.monotonic() > deadline:
                tail = self.log.read_text()[-3000:]
                raise AssertionError(f"stats in the directory still ask meta after {LISTED_WITHIN:g}s:\n{tail}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster():
    with started("kvfs-listing-") as c:
        yield c


@contextlib.contextmanager
def observer(cluster, tmp_path: Path, *options: str) -> Iterator[Observer]:
    log = tmp_path / "second.log"
    with second_mount(cluster, tmp_path / "second", *options, "--http", "127.0.0.1:0", "--log-level", "DEBUG",
                      log=log) as path:
        yield Observer(path, log)


@contextlib.contextmanager
def opened_directory(path: Path) -> Iterator[int]:
    """A descriptor of ``path``: names are looked up in it, so the directory itself needs no lookup each time."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def _filled(cluster, directory: str, files: int) -> tuple[Path, list[str]]:
    """A directory the cluster's own mount makes with ``files`` files, the i-th of i bytes; and their names."""
    path = cluster.mount / directory
    path.mkdir()
    names = [f"f{i:02d}" for i in range(files)]
    for i, name in enumerate(names):
        (path / name).write_bytes(b"x" * i)
    return path, names


def _soon(predicate, what: str) -> None:
    wait_until(predicate, 0.5, what, interval=0.01)


def _stat(name: str, directory: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=directory)
    except FileNotFoundError:
        return None


def _mode(name: str, directory: int) -> int:
    return stat.S_IMODE(os.stat(name, dir_fd=directory).st_mode)


def _size(name: str, directory: int) -> int:
    return os.stat(name, dir_fd=directory).st_size


def test_stats_of_listed_names_ask_meta_nothing_and_another_mounts_changes_show_within_half_a_second(
        cluster, tmp_path):
    """The second mount reads the directory's listing with attributes after lookups there reach meta; 40 stats then
    cost no meta call. Another mount's create, unlink, rename, chmod, append and truncate there show within half a
    second all the same (the feed drops what changed); each starts from a listing read after the change before."""
    first, names = _filled(cluster, "listed", 40)
    with observer(cluster, tmp_path, *NO_KERNEL_ENTRIES) as second, opened_directory(second.path / "listed") as there:
        assert [s.st_size for s in second.answered_here(there, names)] == list(range(40))

        (first / "new").write_bytes(b"new")
        _soon(lambda: (s := _stat("new", there)) is not None and s.st_size == 3, "another mount's create")
        names.append("new")
        second.answered_here(there, names)
        os.unlink(first / "f00")
        _soon(lambda: _stat("f00", there) is None, "another mount's unlink")
        names.remove("f00")
        second.answered_here(there, names)
        os.rename(first / "f01", first / "renamed")
        _soon(lambda: _stat("f01", there) is None and _stat("renamed", there) is not None, "its rename")
        names[names.index("f01")] = "renamed"
        second.answered_here(there, names)
        os.chmod(first / "f02", 0o600)
        _soon(lambda: _mode("f02", there) == 0o600, "its chmod")
        second.answered_here(there, names)
        with open(first / "f03", "ab") as f:
            f.write(b"grown")
        _soon(lambda: _size("f03", there) == 3 + 5, "its append")
        second.answered_here(there, names)
        os.truncate(first / "f04", 1)
        _soon(lambda: _size("f04", there) == 1, "its truncate")
        assert sorted(os.listdir(first)) == sorted(os.listdir(second.path / "listed"))


def test_a_mounts_own_changes_show_in_its_listing_at_once(cluster, tmp_path):
    """Its own changes do not come back through the feed: the mount drops what they touch itself."""
    first, names = _filled(cluster, "own", 12)
    with observer(cluster, tmp_path, *NO_KERNEL_ENTRIES) as second, opened_directory(second.path / "own") as there:
        second.answered_here(there, names)
        os.chmod("f05", 0o640, dir_fd=there)
        assert _mode("f05", there) == 0o640
        second.answered_here(there, names)
        with open(os.open("f06", os.O_WRONLY | os.O_APPEND, dir_fd=there), "ab") as f:
            f.write(b"mine")
        assert _size("f06", there) == 6 + 4
        second.answered_here(there, names)
        os.rename("f07", "moved", src_dir_fd=there, dst_dir_fd=there)
        assert _stat("f07", there) is None and _size("moved", there) == 7
        names[names.index("f07")] = "moved"
        second.answered_here(there, names)
        os.link("f08", "linked", src_dir_fd=there, dst_dir_fd=there)
        assert os.stat("f08", dir_fd=there).st_nlink == 2
        second.answered_here(there, names)
        os.unlink("linked", dir_fd=there)
        assert os.stat("f08", dir_fd=there).st_nlink == 1 and _stat("linked", there) is None
        assert sorted(os.listdir(first)) == sorted(os.listdir(there))


def test_removing_another_name_of_a_listed_file_where_nothing_is_listed_shows_at_once(cluster, tmp_path):
    """A file listed in one directory loses a link when a name of it in a directory the mount has not listed goes
    (unlinked, or renamed over): its listed nlink must not be answered after that, whoever removed the name."""
    a, names = _filled(cluster, "links", 8)
    elsewhere = {}
    for i, purpose in enumerate(("unlinked", "renamed-over", "removed-by-another-mount")):
        elsewhere[purpose] = cluster.mount / purpose
        elsewhere[purpose].mkdir()
        os.link(a / names[i], elsewhere[purpose] / "other")
    (elsewhere["renamed-over"] / "new").write_bytes(b"new")
    with observer(cluster, tmp_path, *NO_KERNEL_ENTRIES) as second, opened_directory(second.path / "links") as there:
        assert [s.st_nlink for s in second.answered_here(there, names)[:3]] == [2, 2, 2]
        os.unlink(second.path / "unlinked" / "other")  # one lookup in that directory: it is not listed
        assert os.stat("f00", dir_fd=there).st_nlink == 1
        second.answered_here(there, names)
        os.rename(second.path / "renamed-over" / "new", second.path / "renamed-over" / "other")
        assert os.stat("f01", dir_fd=there).st_nlink == 1
        second.answered_here(there, names)
        os.unlink(elsewhere["removed-by-another-mount"] / "other")
        _soon(lambda: os.stat("f02", dir_fd=there).st_nlink == 1, "another mount's unlink of the other name")


def test_a_mount_that_only_removes_names_asks_once_and_the_other_sees_an_exact_listing(cluster, tmp_path):
    """``rm`` of a tree another mount made: after two removals the remover asks once for a grant for removals
    (meta/delegation.py, rule 5), not once per name; the mount that made the files lists the directory exactly
    afterwards, and its next create shows in the remover."""
    first = cluster.mount / "removed-elsewhere"
    first.mkdir()
    for i in range(20):
        (first / f"old{i:02d}").write_bytes(b"old")
    with observer(cluster, tmp_path) as remover:
        for i in range(20):
            os.unlink(remover.path / "removed-elsewhere" / f"old{i:02d}")
        assert remover.calls().get("delegate", 0) <= 1  # what a grant then answers: test_mount_delegation.py
        assert os.listdir(first) == []
        (first / "after").write_bytes(b"after")
        _soon(lambda: (remover.path / "removed-elsewhere" / "after").exists(), "the first mount's create")
