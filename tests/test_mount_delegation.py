"""Directory delegations on real mounts (fuse/dirops.py, meta/delegation.py): one mount answers creates and
removals itself, and another client still sees every one of them the moment it looks."""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest

pytest.register_assert_rewrite("cluster_fixtures")
from cluster_fixtures import NEEDS_FUSE, process_alive, second_mount, started, wait_until
from fuse_harness import run_as

pytest_plugins = ["cluster_fixtures"]
pytestmark = NEEDS_FUSE

GRANTED = "is delegated to this mount"
UID = GID = 1000  # an unprivileged caller


@pytest.fixture(scope="module")
def cluster():
    with started("kvfs-deleg-") as c:
        yield c


def make_files(directory, names, data=b"") -> None:
    for name in names:
        with open(directory / name, "wb") as f:
            f.write(data + name.encode())


def test_another_client_sees_every_change_the_holder_answered(cluster, tmp_path):
    """The holder (a mount logging at DEBUG, so the grant shows) creates, writes and removes files in a directory it
    made; the cluster's own mount lists and reads them right after, in one go, with nothing missing or stale."""
    log = tmp_path / "holder.log"
    with second_mount(cluster, tmp_path / "holder", "--log-level", "DEBUG", log=log) as holder:
        work = holder / "burst"
        work.mkdir()
        names = [f"f{i:03d}" for i in range(300)]
        make_files(work, names, b"data of ")
        for name in names[::3]:
            os.unlink(work / name)
        kept = sorted(set(names) - set(names[::3]))
        assert GRANTED in log.read_text(), "the holder never got the directory's delegation"
        other = cluster.mount / "burst"
        started_at = time.monotonic()
        assert sorted(os.listdir(other)) == kept  # recalled: every change the holder answered is there
        assert time.monotonic() - started_at < 3, "the recall took as long as a lapse"
        assert (other / kept[-1]).read_bytes() == b"data of " + kept[-1].encode()
        # The holder gave the directory back; its next changes there (synchronous for a while) show at once.
        make_files(work, ["after"])
        os.unlink(work / kept[0])
        wait_until(lambda: "after" in os.listdir(other) and kept[0] not in os.listdir(other), 1,
                   "the holder's later changes on the other mount")
        assert "lost" not in log.read_text()


def test_lookups_and_stats_by_another_client_recall_the_directory(cluster, tmp_path):
    """Not only listings: a lookup of one new name, and a stat of the directory (its times follow the creates)."""
    log = tmp_path / "holder.log"
    with second_mount(cluster, tmp_path / "holder", "--log-level", "DEBUG", log=log) as holder:
        work = holder / "lookups"
        work.mkdir()
        make_files(work, [f"warm{i}" for i in range(5)])  # the grant comes after a couple of creates
        wait_until(lambda: GRANTED in log.read_text(), 5, "the grant")
        make_files(work, ["fresh"])
        before = os.stat(work).st_mtime_ns
        assert (cluster.mount / "lookups" / "fresh").read_bytes() == b"fresh"
        assert os.stat(cluster.mount / "lookups").st_mtime_ns >= before


def test_a_mount_removing_another_clients_files_answers_them_itself_and_the_other_sees_each(cluster):
    """``rm`` from a second mount of files the cluster's mount made: after a few synchronous removals the second
    mount holds a grant for removals (recalled from the creator) and answers the rest itself, with the errors a
    local disk gives (ENOENT, EISDIR, the sticky bit for an unprivileged caller); the creator sees each removal
    without listing (the feed), and its listing after the recall is exact; a file open there stays readable."""
    made = cluster.mount / "removals"
    made.mkdir()
    made.chmod(0o1777)
    names = [f"f{i:03d}" for i in range(120)]
    make_files(made, names, b"data of ")
    (made / "sub").mkdir()
    assert run_as(UID, GID, make_files, made, ["theirs", "kept"]) is None
    log = cluster.base / "remover.log"
    with second_mount(cluster, cluster.base / "remover", "--log-level", "DEBUG", log=log) as remover, \
            open(made / names[-1], "rb") as still_open:
        work = remover / "removals"
        for name in names[:10]:
            os.unlink(work / name)
        wait_until(lambda: "for removals" in log.read_text(), 10, "the grant for removals")
        for name in names[10:]:
            os.unlink(work / name)
        wait_until(lambda: not os.path.exists(made / names[60]), 1, "the removal on the creator's mount")
        for path, code in ((work / names[0], errno.ENOENT), (work / "absent", errno.ENOENT),
                           (work / "sub", errno.EISDIR)):
            try:
                os.unlink(path)
            except OSError as exc:
                assert exc.errno == code, path
            else:
                raise AssertionError(f"unlink of {path} succeeded")
        root_owned = work / "mine"
        root_owned.write_bytes(b"x")
        assert run_as(UID, GID, os.unlink, root_owned) == ("errno", errno.EPERM)  # sticky: not the caller's
        assert run_as(UID, GID, os.unlink, work / "theirs") is None
        assert still_open.read() == b"data of " + names[-1].encode()
        assert sorted(os.listdir(made)) == ["kept", "mine", "sub"]
        assert "lost" not in log.read_text()


def test_a_killed_holder_is_waited_out_and_what_it_sent_stays(cluster, tmp_path):
    """kill -9 of the holder in the middle of a burst: the other mount's listing waits at most for the grant to
    lapse, then shows a consistent directory (what the holder had sent), and the namespace stays usable."""
    log = tmp_path / "holder.log"
    with second_mount(cluster, tmp_path / "holder", "--log-level", "DEBUG", log=log) as holder:
        work = holder / "killed"
        work.mkdir()
        make_files(work, [f"a{i:03d}" for i in range(100)])
        wait_until(lambda: GRANTED in log.read_text(), 5, "the grant")
        daemon = _daemon_of(holder)
        make_files(work, [f"b{i:03d}" for i in range(20)])  # some of these may be unsent when it dies
        os.kill(daemon, signal.SIGKILL)
        wait_until(lambda: not process_alive(daemon), 10, "the holder to die")
        other = cluster.mount / "killed"
        started_at = time.monotonic()
        listed = set(os.listdir(other))
        assert time.monotonic() - started_at < 12, "waited longer than a lapsed grant"
        made = [f"a{i:03d}" for i in range(100)] + [f"b{i:03d}" for i in range(20)]  # in the order made
        applied = [name for name in made if name in listed]
        assert applied == made[:len(applied)], "changes were applied out of the order they were made in"
        assert len(applied) >= 2  # at least the synchronous creates before the grant
        (other / "new").write_bytes(b"x")  # the directory is usable again
        assert (other / "new").read_bytes() == b"x"


def _daemon_of(mountpoint) -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"mount" in cmd and str(mountpoint).encode() in cmd:
                return int(entry)
    raise AssertionError(f"no daemon serves {mountpoint}")
