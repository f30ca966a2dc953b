"""Real local clusters for the mount tests: ``kvfs up`` in a subprocess, exactly as a user runs it.

Nothing here stands in for a service: every cluster is mgmtd + meta + chunk servers + the FUSE daemon,
started by ``kvfs up --data DIR --mount MNT`` and stopped by ``kvfs down --data DIR``.

Use it from a test module with ``pytest_plugins = ["cluster_fixtures"]``: the fixtures are then registered
once for the whole session, so every module shares the one session cluster (``kvfs_cluster``) and its
per-test directories (``mnt_dir``).  Fault tests that kill things make their own with :func:`started`.

Teardown never trusts the cluster: ``kvfs down``, then ``fusermount3 -u -z`` if the mount is still there,
then SIGKILL for any process whose command line names this cluster's config, and only then the directory
is removed (never while mounted: removing through a live mount would delete cluster data, through a dead
one it would hang).  ``KVFS_KEEP_TEST_DATA=1`` keeps the directories for a post-mortem.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs.fuse.mount import is_mounted
from kvfs.localcluster import process_exists as process_alive

REPO = Path(__file__).resolve().parent.parent
KVFS = [sys.executable, "-m", "kvfs"]
NEEDS_FUSE = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
    reason="needs root, /dev/fuse and fusermount3 (Debian: fuse3)",
)
SERVICES = ("mgmtd", "cs1", "cs2", "cs3", "meta")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def chunks_held(data: Path, inodes: list[int], table: str = "versions") -> int:
    """Chunk versions the cluster's targets still hold of these inodes (read beside the running engines: WAL);
    ``table="unsynced"``: those acknowledged but not yet flushed to disk."""
    held = 0
    for db in data.glob("targets/**/chunks.sqlite"):
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            marks = ",".join("?" * len(inodes))
            held += conn.execute(f"SELECT count(*) FROM {table} WHERE inode IN ({marks})", inodes).fetchone()[0]
        finally:
            conn.close()
    return held


class KvfsCluster:
    """One ``kvfs up`` cluster in ``base`` (``base/data`` and ``base/mnt``); ``base`` is world-searchable so
    other uids can reach the mount."""

    def __init__(self, base: Path, chunkservers: int = 3, replicas: int = 3) -> None:
        self.base = base
        self.data = base / "data"
        self.mount = base / "mnt"
        self.config = self.data / "cluster.toml"
        self.chunkservers = chunkservers
        self.replicas = replicas
        base.chmod(0o755)

    # -------------------------------------------------------------------------------- commands
    def kvfs(self, *args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*KVFS, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                           stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise AssertionError(f"kvfs {' '.join(args)} exited {r.returncode}\nstdout:\n{r.stdout}\n"
                                 f"stderr:\n{r.stderr}\n{self.log_tails()}")
        return r

    def up(self, *options: str, **kw) -> subprocess.CompletedProcess[str]:
        return self.kvfs("up", "--data", str(self.data), "--mount", str(self.mount),
                         "--chunkservers", str(self.chunkservers), "--replicas", str(self.replicas), *options, **kw)

    def down(self, **kw) -> subprocess.CompletedProcess[str]:
        return self.kvfs("down", "--data", str(self.data), **kw)

    def status(self) -> dict:
        """``kvfs status --json`` (it exits 1 when something is down; the report is still printed)."""
        r = self.kvfs("status", "--data", str(self.data), "--json", check=False, timeout=60)
        try:
            return json.loads(r.stdout)
        except json.JSONDecodeError:
            raise AssertionError(f"kvfs status --json printed no JSON (rc {r.returncode}):\n{r.stdout}\n{r.stderr}")

    # ------------------------------------------------------------------------------- processes
    def pid(self, name: str) -> int | None:
        try:
            pid = int((self.data / "run" / f"{name}.pid").read_text())
        except (OSError, ValueError):
            return None
        return pid if process_alive(pid) and str(self.config).encode() in _cmdline(pid) else None

    def kill(self, name: str, sig: int = signal.SIGKILL, wait: float = 20) -> int:
        """Signal one process of the cluster (by its pid file) and wait until it is gone."""
        pid = self.pid(name)
        assert pid is not None, f"{name} is not running\n{self.log_tails()}"
        os.kill(pid, sig)
        wait_until(lambda: not process_alive(pid), wait, f"{name} (pid {pid}) to exit after signal {sig}")
        return pid

    def our_processes(self) -> list[int]:
        """Every live process whose command line names this cluster's config: all that kvfs up started."""
        key = str(self.config).encode()
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and key in _cmdline(int(entry)) and process_alive(int(entry)):
                found.append(int(entry))
        return found

    def log_tails(self, n: int = 1500) -> str:
        out = []
        for log in sorted((self.data / "logs").glob("*.log")) if (self.data / "logs").is_dir() else ():
            text = log.read_text(errors="replace")[-n:]
            if text.strip():
                out.append(f"--- {log.name} (tail) ---\n{text}")
        return "\n".join(out)

    # -------------------------------------------------------------------------------- teardown
    def close(self) -> None:
        """Stop everything, whatever state the cluster is in; remove the directory unless asked to keep it."""
        if self.data.joinpath("local.json").exists():
            with contextlib.suppress(Exception):
                self.down(check=False, timeout=90)
        if is_mounted(self.mount):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)
        for pid in self.our_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if is_mounted(self.mount):
            subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
        if not os.environ.get("KVFS_KEEP_TEST_DATA") and not is_mounted(self.mount):
            shutil.rmtree(self.base, ignore_errors=True)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@contextlib.contextmanager
def started(prefix: str = "kvfs-test-", **kw) -> Iterator[KvfsCluster]:
    """A fresh cluster (``kvfs up`` done) that is torn down on exit, even when the test failed."""
    cluster = KvfsCluster(Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp")), **kw)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.close()


@contextlib.contextmanager
def second_mount(cluster, path, *options: str, log=None):
    """Another client: ``kvfs mount`` of the same cluster at ``path`` with ``options``, removed afterwards; its
    log goes to the file ``log`` if given."""
    path.mkdir()
    err = open(log, "w") if log is not None else subprocess.PIPE
    daemon = subprocess.Popen([*KVFS, "mount", "--config", str(cluster.config), *options, str(path)], cwd=REPO,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, text=True)
    if log is not None:
        err.close()  # the daemon holds its own copy
    try:
        wait_until(lambda: is_mounted(path), 30, "the second mount")
        yield path
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()  # a daemon that will not stop: its mount is left answering ENOTCONN, cleared below
            daemon.wait(10)
        finally:
            if is_mounted(path):
                subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def kvfs_cluster() -> Iterator[KvfsCluster]:
    """The one shared cluster: three chunk servers, chains of three, mounted."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.skip("needs root, /dev/fuse and fusermount3 (Debian: fuse3)")
    with started("kvfs-session-") as cluster:
        yield cluster


_dirs = itertools.count()


@pytest.fixture
def mnt_dir(kvfs_cluster: KvfsCluster, request) -> Path:
    """A fresh, world-writable directory on the shared mount for one test."""
    name = "".join(c if c.isalnum() else "_" for c in request.node.name)[:80]
    path = kvfs_cluster.mount / f"{next(_dirs):04d}-{name}"
    os.mkdir(path)
    os.chmod(path, 0o777)
    return path
