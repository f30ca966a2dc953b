"""``kvfs up`` / ``kvfs status`` / ``kvfs down`` on real processes (issue 4, §2 and §3.1).

One cluster serves the read-mostly checks of this module (fresh-directory state, status, idempotent up,
restart of killed processes); ``down`` gets a cluster of its own.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import stat
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

pytest.register_assert_rewrite("cluster_fixtures")
from cluster_fixtures import (
    KVFS, NEEDS_FUSE, REPO, SERVICES, KvfsCluster, chunks_held, is_mounted, process_alive, second_mount, started,
    wait_until,
)
from kvfs.fuse.mount import FUSECTL, fusectl_dir

pytest_plugins = ["cluster_fixtures"]
pytestmark = NEEDS_FUSE

# The kernel answers stat of a dead mount's root from its attribute cache (1 s) and only then with ENOTCONN;
# wait that out so the tests see what a daemon that died a while ago leaves behind, every time.
ATTR_CACHE_EXPIRY = 2.0
ALL = (*SERVICES, "mount")
ROLES = {"mgmtd": "mgmtd", "cs1": "chunkserver", "cs2": "chunkserver", "cs3": "chunkserver", "meta": "meta",
         "mount": "mount"}


@pytest.fixture(scope="module")
def cluster():
    with started("kvfs-up-") as c:
        yield c


def local_layout(c: KvfsCluster) -> dict:
    return json.loads((c.data / "local.json").read_text())


def pids(c: KvfsCluster) -> dict[str, int | None]:
    return {name: c.pid(name) for name in ALL}


def write_files(root) -> dict[str, str]:
    """A small tree: empty, small, multi-chunk (1 MiB chunks) and unaligned files; returns path -> sha256."""
    os.makedirs(root / "sub" / "deeper", exist_ok=True)
    files = {
        "empty": b"",
        "small": b"hello kvfs\n",
        "sub/three-chunks": os.urandom(3 * (1 << 20) + 12345),
        "sub/deeper/odd": os.urandom(70_001),
    }
    for rel, data in files.items():
        with open(root / rel, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}


def check_files(root, expected: dict[str, str]) -> None:
    for rel, digest in expected.items():
        assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digest, rel


# ------------------------------------------------------------------------------------------------ up
def test_up_on_a_fresh_directory_mounts_and_writes_its_state(cluster):
    c = cluster
    assert is_mounted(c.mount)
    st = os.statvfs(c.mount)
    assert st.f_namemax == 255 and st.f_blocks > 0
    (c.mount / "hello").write_bytes(b"world")
    assert (c.mount / "hello").read_bytes() == b"world"
    os.unlink(c.mount / "hello")

    # client.toml: what a client needs, and nothing a client could use to open the KV store itself
    cluster_cfg = tomllib.loads(c.config.read_text())
    client_path = c.data / "client.toml"
    client_cfg = tomllib.loads(client_path.read_text())
    assert client_cfg["token"] == cluster_cfg["token"] and len(client_cfg["token"]) >= 32
    layout = local_layout(c)
    assert client_cfg["mgmtd"] == [layout["mgmtd"]] == cluster_cfg["mgmtd"]
    assert client_cfg["meta"] == [layout["meta"]] == cluster_cfg["meta"]
    for path in (client_path, c.config):  # both hold the token
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, path
    assert sorted(layout["chunkservers"]) == ["1", "2", "3"] and layout["replicas"] == 3
    assert layout["mount"] == str(c.mount)

    # a pid file and a log per process, the pid alive and running that role
    for name in ALL:
        pid_file, log = c.data / "run" / f"{name}.pid", c.data / "logs" / f"{name}.log"
        assert pid_file.is_file() and log.is_file(), name
        pid = int(pid_file.read_text())
        assert process_alive(pid), name
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert b"kvfs" in argv and ROLES[name].encode() in argv and str(c.config).encode() in argv, (name, argv)
    for node in (1, 2, 3):
        assert (c.data / "targets" / f"cs{node}").is_dir()


def test_fsync_on_the_mount_flushes_the_files_writes_on_every_replica(cluster):
    """kvfs up's chunk servers are write-back: they acknowledge from the page cache, and a file's fsync flushes
    every replica of what it wrote (their own flush, every 5 s, may come first: then the write is redone)."""
    path = cluster.mount / "durable"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        ino = os.fstat(fd).st_ino
        for _ in range(5):
            os.pwrite(fd, os.urandom(3 << 20), 0)
            os.close(os.open(path, os.O_RDONLY))  # a close(2) sends the mount's buffers to the chunk servers
            unflushed = chunks_held(cluster.data, [ino], "unsynced")
            if unflushed:
                break
        assert unflushed >= 3  # a version of a chunk on each replica, at least
        os.fsync(fd)
        assert chunks_held(cluster.data, [ino], "unsynced") == 0
    finally:
        os.close(fd)
    os.unlink(path)


def test_chunk_writes_and_their_forwards_go_through_shared_memory_on_one_host(cluster):
    """Every process of ``kvfs up`` shares the host: the mount lends its write buffers to the head, and each
    member lends what it copied out to its successor (kvfs.transport.shm); the bytes come back intact."""
    data = os.urandom(9 << 20)
    path = cluster.mount / "lent"
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    os.unlink(path)
    accepted = {name: "through shared memory" in (cluster.data / "logs" / f"{name}.log").read_text()
                for name in ("cs1", "cs2", "cs3")}
    assert sum(accepted.values()) == 3, accepted  # head from the mount, the others from their predecessors


@pytest.mark.skipif(os.geteuid() != 0, reason="fusectl's files are root's: the mount can raise max_background as root only")
@pytest.mark.skipif(not os.path.isdir(FUSECTL), reason=f"no {FUSECTL}: this kernel has no fusectl")
def test_the_mount_lets_the_kernel_keep_64_readahead_requests_in_flight(cluster):
    """The kernel's default, 12 (congested at 9), stalls a sequential reader's readahead behind the chunk
    servers' disk reads; ``kvfs mount --max-background`` (64 by default) raises it once INIT is done."""
    path = Path(wait_until(lambda: fusectl_dir(str(cluster.mount.resolve())), 10, "the mount's fusectl directory"))
    wait_until(lambda: (path / "max_background").read_text().strip() == "64", 10, "max_background 64")
    assert (path / "congestion_threshold").read_text().strip() == "48"


def test_status_json_lists_processes_targets_and_chains(cluster):
    c = cluster
    r = c.kvfs("status", "--data", str(c.data), "--json")
    report = json.loads(r.stdout)
    layout = local_layout(c)
    addresses = {"mgmtd": layout["mgmtd"], "meta": layout["meta"], "mount": str(c.mount),
                 **{f"cs{n}": a for n, a in layout["chunkservers"].items()}}
    procs = {p["name"]: p for p in report["processes"]}
    assert set(procs) == set(ALL)
    for name, p in procs.items():
        assert p["role"] == ROLES[name]
        assert p["pid"] == c.pid(name) and p["pid"] is not None
        assert p["address"] == addresses[name]
        assert p["alive"] is True
    assert "error" not in report

    cs_addresses = set(layout["chunkservers"].values())
    targets = report["targets"]
    assert len(targets) == 3
    assert {t["host"] for t in targets} == cs_addresses  # one target per chunk server, each on its own
    assert all(t["state"] == "serving" for t in targets)
    assert len({t["target_id"] for t in targets}) == 3
    assert len(report["chains"]) == 1
    chain = report["chains"][0]
    assert sorted(chain["targets"]) == sorted(t["target_id"] for t in targets)
    assert all(t["chain_id"] == chain["chain_id"] for t in targets)
    assert chain["version"] >= 1

    human = c.kvfs("status", "--data", str(c.data)).stdout
    for word in ("processes", "targets", "chains", "serving", *ALL):
        assert word in human


def test_up_again_is_a_no_op_when_everything_runs(cluster):
    c = cluster
    (c.mount / "noop").write_bytes(b"kept")
    before = pids(c)
    r = c.up()
    assert "started" not in r.stdout and "mounted" not in r.stdout, r.stdout
    assert pids(c) == before
    assert (c.mount / "noop").read_bytes() == b"kept"


def test_up_restarts_only_a_killed_chunk_server_and_keeps_data(cluster):
    c = cluster
    root = c.mount / "restart-cs"
    expected = write_files(root)
    before = pids(c)

    c.kill("cs2")
    report = c.status()  # status sees it gone, and mgmtd soon takes its target out of service
    alive = {p["name"]: p["alive"] for p in report["processes"]}
    assert alive == {n: n != "cs2" for n in ALL}
    cs2 = local_layout(c)["chunkservers"]["2"]
    wait_until(lambda: {t["state"] for t in c.status()["targets"] if t["host"] == cs2} - {"serving"}, 20,
               "mgmtd to mark cs2's target not serving")
    assert c.kvfs("status", "--data", str(c.data), check=False).returncode != 0
    check_files(root, expected)  # two replicas still serve every chunk
    (root / "while-down").write_bytes(b"written with cs2 down")

    r = c.up()
    assert started_names(r.stdout) == {"cs2"}, r.stdout
    assert "mounted" not in r.stdout
    after = pids(c)
    assert after["cs2"] is not None and after["cs2"] != before["cs2"]
    assert {n: p for n, p in after.items() if n != "cs2"} == {n: p for n, p in before.items() if n != "cs2"}
    report = c.status()
    assert all(p["alive"] for p in report["processes"])
    assert all(t["state"] == "serving" for t in report["targets"])  # up waits for cs2 to sync back
    check_files(root, expected)
    assert (root / "while-down").read_bytes() == b"written with cs2 down"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_mount_daemon_flushes_unmounts_and_up_mounts_again(cluster, sig):
    c = cluster
    fd = os.open(c.mount / f"buffered-{sig}", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"still in the daemon's write buffer")
    pid = c.kill("mount", sig)  # the open file keeps the mount busy: the daemon must cope
    with contextlib.suppress(OSError):
        os.close(fd)
    assert not is_mounted(c.mount) and not process_alive(pid)
    r = c.up()
    assert "mounted kvfs" in r.stdout and started_names(r.stdout) == set()
    assert (c.mount / f"buffered-{sig}").read_bytes() == b"still in the daemon's write buffer"


def test_fusermount_clears_a_killed_daemons_mount_and_up_mounts_again(cluster):
    c = cluster
    (c.mount / "survivor").write_bytes(b"on the chunk servers")
    c.kill("mount")
    assert is_mounted(c.mount)
    subprocess.run(["fusermount3", "-u", str(c.mount)], check=True, capture_output=True)
    assert not is_mounted(c.mount)
    r = c.up()
    assert "mounted kvfs" in r.stdout and started_names(r.stdout) == set()
    assert (c.mount / "survivor").read_bytes() == b"on the chunk servers"


def started_names(stdout: str) -> set[str]:
    return {line.split()[1] for line in stdout.splitlines() if line.startswith("started ")}


def test_up_restarts_a_killed_chunk_server_and_mount_daemon_and_keeps_data():
    with started("kvfs-up-kill-") as c:
        root = c.mount / "restart"
        expected = write_files(root)
        before = pids(c)

        c.kill("cs2")
        c.kill("mount")
        time.sleep(ATTR_CACHE_EXPIRY)
        assert is_mounted(c.mount)  # a killed daemon leaves a dead mount behind ...
        with pytest.raises(OSError) as info:
            os.listdir(c.mount)
        assert info.value.errno == errno.ENOTCONN  # ... that answers ENOTCONN
        alive = {p["name"]: p["alive"] for p in c.status()["processes"]}
        assert alive == {n: n not in ("cs2", "mount") for n in ALL}

        r = c.up()
        assert started_names(r.stdout) == {"cs2"}, r.stdout
        assert "mounted kvfs" in r.stdout
        after = pids(c)
        for name in ALL:
            if name in ("cs2", "mount"):
                assert after[name] is not None and after[name] != before[name], name
            else:
                assert after[name] == before[name], name
        report = c.status()
        assert all(p["alive"] for p in report["processes"])
        assert all(t["state"] == "serving" for t in report["targets"])
        check_files(root, expected)
        (root / "after").write_bytes(b"new writes go through all three again")
        assert (root / "after").read_bytes() == b"new writes go through all three again"


def test_up_refuses_more_replicas_than_chunk_servers(tmp_path):
    c = KvfsCluster(tmp_path, chunkservers=2, replicas=3)
    try:
        r = c.up(check=False)
        assert r.returncode != 0 and "replicas" in (r.stdout + r.stderr)
        assert c.our_processes() == [] and not is_mounted(c.mount)
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------- down
def test_down_unmounts_and_stops_everything_and_up_brings_the_data_back():
    with started("kvfs-down-") as c:
        expected = write_files(c.mount / "tree")
        running = pids(c)
        assert all(running.values())
        c.down()
        assert not is_mounted(c.mount)
        assert c.our_processes() == []
        assert not any(process_alive(pid) for pid in running.values())
        assert list((c.data / "run").glob("*.pid")) == []
        c.down()  # down twice is harmless

        c.up()  # the same directory: same ports, same data
        check_files(c.mount / "tree", expected)
        c.down()
        assert not is_mounted(c.mount) and c.our_processes() == []


def test_down_clears_the_dead_mount_of_a_killed_daemon():
    with started("kvfs-down-dead-") as c:
        c.kill("mount")
        time.sleep(ATTR_CACHE_EXPIRY)
        assert is_mounted(c.mount)
        c.down()
        assert c.our_processes() == []
        assert not is_mounted(c.mount)


def test_status_reports_every_process_down_when_mgmtd_is_down():
    with started("kvfs-status-down-") as c:
        c.kill("mgmtd")
        report = c.status()
        alive = {p["name"]: p["alive"] for p in report["processes"]}
        assert alive == {n: n != "mgmtd" for n in ALL}
        assert "mgmtd unreachable" in report["error"]
        c.down()
        report = c.status()
        assert not any(p["alive"] or p["pid"] for p in report["processes"]) and "error" in report


def _soon(predicate, what: str, within: float = 0.5) -> None:
    wait_until(predicate, within, what, interval=0.01)


def _size(path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def test_a_second_mount_sees_other_clients_changes_at_once_through_the_change_feed(cluster, tmp_path):
    """With 60 s kernel timeouts on both sides of the feed (--entry/--attr-timeout apply only without it), another
    client's create, growth, rename and unlink still show within half a second: the feed invalidates the kernel's
    copies. A negative timeout is a usage error."""
    bad = cluster.kvfs("mount", "--config", str(cluster.config), "--attr-timeout", "-1", str(tmp_path), check=False)
    assert bad.returncode == 2 and "--attr-timeout" in bad.stderr
    with second_mount(cluster, tmp_path / "second", "--entry-timeout", "60", "--attr-timeout", "60") as second:
        time.sleep(0.5)  # the second mount starts following the feed
        first = cluster.mount
        assert _size(second / "shared") is None  # looked up and absent
        (first / "shared").write_bytes(b"x" * 10)
        _soon(lambda: _size(second / "shared") == 10, "the second mount to see the new file")
        with open(first / "shared", "ab") as f:
            f.write(b"y" * 5)
        _soon(lambda: _size(second / "shared") == 15, "the second mount to see the file grow")
        assert (second / "shared").read_bytes() == b"x" * 10 + b"y" * 5
        os.rename(first / "shared", first / "moved")
        _soon(lambda: _size(second / "shared") is None and _size(second / "moved") == 15, "the rename")
        (second / "moved").unlink()  # and the other way round
        _soon(lambda: _size(first / "moved") is None, "the first mount to see the unlink")


def test_a_mount_with_a_wrong_token_is_refused_with_one_clear_line(cluster, tmp_path):
    """A config whose token the cluster does not take must not mount (it would answer every call with EACCES):
    the command fails at once, says why in one line, and leaves nothing mounted."""
    config = tomllib.loads(cluster.config.read_text())
    config["token"] = "0" * 64
    config.pop("token_file", None)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(tomli_w.dumps(config))
    target = tmp_path / "mnt"
    target.mkdir()
    started_at = time.monotonic()
    result = cluster.kvfs("mount", "--config", str(wrong), str(target), check=False, timeout=60)
    assert result.returncode != 0
    assert time.monotonic() - started_at < 30
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "token" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not is_mounted(target)


def test_a_mount_whose_token_stops_working_says_so_once_and_answers_eacces():
    """The cluster is restarted with a new token under a running mount (a token rotation that forgot this client):
    every call that needs the cluster fails at once with EACCES instead of hanging, and over several seconds of
    such calls the mount's log says what is wrong a bounded number of times, not once per retry."""
    with started("kvfs-token-") as c:
        (c.mount / "before").write_bytes(b"x")
        log = c.data / "logs" / "mount.log"
        seen = log.stat().st_size
        for name in SERVICES:
            c.kill(name)
        config = tomllib.loads(c.config.read_text())
        config["token"] = "1" * 64
        c.config.write_text(tomli_w.dumps(config))
        c.up()  # restarts what is dead with the new token; the mount keeps running with the old one
        started_at = time.monotonic()
        failures = 0
        while time.monotonic() - started_at < 8:
            for argv in (["stat", str(c.mount / f"new-{failures}")], ["touch", str(c.mount / f"new-{failures}")],
                         ["ls", str(c.mount)]):
                t0 = time.monotonic()
                result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
                assert time.monotonic() - t0 < 10, f"{argv} took {time.monotonic() - t0:.1f}s"
                assert result.returncode != 0 and "Permission denied" in result.stderr, (argv, result)
                failures += 1
            time.sleep(0.2)
        assert c.pid("mount") is not None and is_mounted(c.mount)
        with open(log, errors="replace") as f:
            f.seek(seen)
            lines = [line for line in f.read().splitlines() if " WARNING " in line or " ERROR " in line]
        assert failures >= 30
        refused = [line for line in lines if "refused us: handshake proof does not match the cluster token" in line]
        assert 1 <= len(refused) <= 2, "\n".join(lines)  # once per loop that meets it: change feed, lease
        assert len(lines) <= 8, "\n".join(lines)  # with what the restart itself cost (connections lost)


def test_absent_names_are_kept_for_long_and_another_clients_new_names_still_show_at_once(cluster, tmp_path):
    """While the feed is followed, the kernel keeps negative entries for the long timeout (a probe for a missing
    file costs no round trip); a name another client then creates, makes by rename or links shows within half
    a second anyway, well after --negative-timeout would have let the kernel ask again."""
    with second_mount(cluster, tmp_path / "second", "--negative-timeout", "1") as second:
        time.sleep(0.5)
        first = cluster.mount
        (first / "src").write_bytes(b"abc")
        for name in ("made-dir", "renamed", "linked"):
            assert not (second / name).exists()  # now kept as absent
        time.sleep(1.5)  # past --negative-timeout: only the feed's invalidation can make the names show
        (first / "made-dir").mkdir()
        _soon(lambda: (second / "made-dir").is_dir(), "the second mount to see the new directory")
        os.rename(first / "src", first / "renamed")
        _soon(lambda: _size(second / "renamed") == 3, "the second mount to see the renamed file")
        os.link(first / "renamed", first / "linked")
        _soon(lambda: _size(second / "linked") == 3, "the second mount to see the new link")
        assert not (second / "src").exists()


def test_a_directory_made_elsewhere_is_listed_after_lookups_miss_and_another_clients_names_still_show(
        cluster, tmp_path):
    """A program making new files in a directory this mount did not create has each name looked up first; after a
    few misses the mount reads the directory's listing and answers absent names itself. Names that were there
    stay visible, and a name another client adds later shows within half a second (the feed drops the listing).
    Without delegations: with them the mount would soon hold the directory and answer absent names from the grant's
    listing instead (tests/test_mount_delegation.py)."""
    log = tmp_path / "second.log"
    shared = cluster.mount / "made-by-the-first"
    shared.mkdir()
    for i in range(3):
        (shared / f"pre{i}").write_bytes(b"pre")
    with second_mount(cluster, tmp_path / "second", "--log-level", "DEBUG", "--no-delegations", log=log) as second:
        time.sleep(0.5)
        there = second / "made-by-the-first"
        for i in range(6):
            (there / f"new{i}").write_bytes(b"new")
        _soon(lambda: "names listed, absent names are answered here" in log.read_text(), "the listing", 5)
        assert not (there / "absent").exists()
        assert all((there / f"pre{i}").read_bytes() == b"pre" for i in range(3))
        (shared / "theirs").write_bytes(b"theirs")
        _soon(lambda: (there / "theirs").exists(), "the second mount to see the other client's new name")
        assert sorted(os.listdir(there)) == sorted([f"pre{i}" for i in range(3)] + [f"new{i}" for i in range(6)]
                                                   + ["theirs"])


def _xattr(path, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name)
    except OSError as e:
        if e.errno != errno.ENODATA:
            raise
        return None


def test_kept_security_xattr_answers_follow_this_and_other_clients_changes(cluster, tmp_path):
    """The mount keeps security.* answers (the kernel asks for security.capability before every write) while it
    follows the feed: its own set and remove show at once, another client's within half a second."""
    with second_mount(cluster, tmp_path / "second") as second:
        time.sleep(0.5)
        f = cluster.mount / "labelled"
        f.write_bytes(b"data")
        assert _xattr(f, "security.kvfs-test") is None  # absent, and now kept as absent
        with open(f, "ab") as out:
            out.write(b"more")  # the write's capability probe is answered from what is kept
        os.setxattr(f, "security.kvfs-test", b"one")
        assert _xattr(f, "security.kvfs-test") == b"one"
        assert _xattr(second / "labelled", "security.kvfs-test") == b"one"  # kept on the second mount too
        os.setxattr(f, "security.kvfs-test", b"two")
        _soon(lambda: _xattr(second / "labelled", "security.kvfs-test") == b"two", "the second mount to see it")
        os.removexattr(second / "labelled", "security.kvfs-test")
        _soon(lambda: _xattr(f, "security.kvfs-test") is None, "the first mount to see the removal")
        assert (second / "labelled").read_bytes() == b"datamore"


def test_a_directory_this_mount_made_answers_absent_names_itself_but_another_clients_names_win(cluster, tmp_path):
    """The mount answers lookups of absent names in a directory it created from its own listing; once another
    client adds a name there, the feed drops that listing, and even a create that overtakes the feed opens (or,
    with O_EXCL, refuses) the other client's file as meta decides."""
    with second_mount(cluster, tmp_path / "second", "--entry-timeout", "60", "--attr-timeout", "60") as second:
        time.sleep(0.5)
        d = cluster.mount / "made-here"
        d.mkdir()
        for i in range(20):
            (d / f"f{i}").write_bytes(b"mine")
        assert not (d / "absent").exists()
        _soon(lambda: (second / "made-here" / "f0").exists(), "the second mount to see the new files")
        (second / "made-here" / "theirs").write_bytes(b"theirs")
        fd = os.open(d / "theirs", os.O_CREAT | os.O_WRONLY, 0o644)  # at once: the feed may not be here yet
        os.close(fd)
        assert (d / "theirs").read_bytes() == b"theirs"  # opened, not created over
        with pytest.raises(FileExistsError):
            os.open(d / "theirs", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        assert sorted(os.listdir(d)) == sorted([f"f{i}" for i in range(20)] + ["theirs"])


def test_a_mount_follows_the_feed_again_after_meta_was_killed_and_restarted(cluster, tmp_path):
    """kill -9 meta for longer than the feed's wait and grace: the second mount lapses (drops what it gave the
    kernel, short timeouts), and once ``kvfs up`` has restarted meta it follows the feed again, so another
    client's change shows at once although its short timeouts are 60 s."""
    with second_mount(cluster, tmp_path / "second", "--entry-timeout", "60", "--attr-timeout", "60") as second:
        time.sleep(0.5)
        (cluster.mount / "across").write_bytes(b"1")
        _soon(lambda: _size(second / "across") == 1, "the second mount to see the file")
        cluster.kill("meta")
        time.sleep(8)  # past 5 s wait + 2 s grace
        cluster.up()
        (cluster.mount / "across").write_bytes(b"22")
        _soon(lambda: _size(second / "across") == 2, "the second mount to follow the restarted feed", within=10)


def _small_read(path, offset: int, n: int = 4096) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def test_read_cache_is_close_to_open_coherent(cluster, tmp_path):
    """Small reads come from the mount's block cache; another client's write shows at the next open, and this
    mount's own writes and truncations at once."""
    data = bytearray(os.urandom(1 << 20))
    (cluster.mount / "cached").write_bytes(data)
    with second_mount(cluster, tmp_path / "second") as second:
        assert _small_read(second / "cached", 70_000) == data[70_000:74_096]  # fills the cache
        with open(cluster.mount / "cached", "r+b") as f:  # another client changes bytes in that block
            f.seek(70_000)
            f.write(b"NEW" * 10)
        data[70_000:70_030] = b"NEW" * 10
        assert _small_read(second / "cached", 69_000) == data[69_000:73_096]
        with open(second / "cached", "r+b") as f:  # this mount's own write, read back in the same open
            assert f.read(10) == data[:10]
            f.seek(5)
            f.write(b"own")
            f.flush()
            f.seek(0)
            assert f.read(10) == data[:5] + b"own" + data[8:10]
            f.truncate(100_000)
            f.seek(99_990)
            assert f.read(100) == data[99_990:100_000]
            f.truncate(200_000)  # extended again: zeros, not the old cached bytes
            f.seek(99_990)
            assert f.read(40) == data[99_990:100_000] + bytes(30)



def test_a_crashed_mounts_write_sessions_end_with_its_lease_and_its_removed_files_are_collected():
    """A file removed while open keeps its chunks while its writer lives; once the mount is killed and its
    lease lapses, meta ends its sessions and garbage collection frees the chunks."""
    with started("kvfs-lease-") as c:
        c.kill("meta")
        c.kill("mount", signal.SIGTERM)  # clients learn the lease from meta: this one learns the short one
        text = c.config.read_text()
        assert "gc_interval = 5.0" in text and "client_lease = 60.0" in text
        c.config.write_text(text.replace("gc_interval = 5.0", "gc_interval = 0.3").replace(
            "client_lease = 60.0", "client_lease = 4.0"))
        c.up()  # meta and the mount come back; the mount renews the 4 s lease every second
        path = c.mount / "held"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, os.urandom(1 << 20))
            os.fsync(fd)
            ino = os.fstat(fd).st_ino
            os.unlink(path)
            time.sleep(5)  # over a lease: the live mount renewed it, so the session and the chunks stay
            assert chunks_held(c.data, [ino]) == 3
            c.kill("mount")
            wait_until(lambda: chunks_held(c.data, [ino]) == 0, 20, "the crashed mount's removed file to go")
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        assert "ended 1 write sessions of clients whose lease lapsed" in (c.data / "logs" / "meta.log").read_text()