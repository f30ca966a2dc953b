"""Faults under a real mount (issue 4, §3): each test on a cluster of its own, started with ``kvfs up``.

* kill -9 of a chunk server while ``cp`` copies a 200 MiB file in: the copy completes and ``cmp`` matches; the
  server comes back with ``kvfs up``, resyncs, and then serves the whole file on its own.
* a chunk server killed after files were deleted and truncated comes back: its resync does not wait for chunks
  that are gone (the running replicas forget what the deletion removed).
* restarts of the meta service (SIGTERM, then SIGKILL) under a loop of 2,000 create/stat/rename/unlink: the loop
  completes without one error and leaves exactly the expected names and bytes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.register_assert_rewrite("cluster_fixtures")
from cluster_fixtures import NEEDS_FUSE, KvfsCluster, chunks_held, started, wait_until  # noqa: E402

pytestmark = NEEDS_FUSE
MIB = 1 << 20


def target_names(c: KvfsCluster) -> dict[int, str]:
    """target id -> chunk server name (cs<N>), from kvfs status."""
    report = c.status()
    by_address = {p["address"]: p["name"] for p in report["processes"] if p["role"] == "chunkserver"}
    return {t["target_id"]: by_address[t["host"]] for t in report["targets"]}


def chain_order(c: KvfsCluster) -> list[str]:
    """Chunk server names of the (single) chain, head first."""
    names = target_names(c)
    (chain,) = c.status()["chains"]
    return [names[t] for t in chain["targets"]]


def serving(c: KvfsCluster) -> dict[str, str]:
    names = target_names(c)
    return {names[t["target_id"]]: t["state"] for t in c.status()["targets"]}


@pytest.fixture
def big_local_file():
    fd, name = tempfile.mkstemp(prefix="kvfs-200m-", dir="/tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for _ in range(200):
                f.write(os.urandom(MIB))
        yield Path(name)
    finally:
        os.unlink(name)


def cmp(a: Path, b: Path) -> None:
    r = subprocess.run(["cmp", str(a), str(b)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"cmp {a} {b}: {r.stdout}{r.stderr}"


@pytest.mark.parametrize("position", [0, -1], ids=["head", "tail"])
def test_kill_a_chunk_server_while_copying_200_mib(big_local_file, position):
    with started("kvfs-fault-cs-") as c:
        # the head: every write of the copy enters the chain there; the tail: every write commits there first
        victim = chain_order(c)[position]
        dest = c.mount / "copy.bin"
        cp = subprocess.Popen(["cp", str(big_local_file), str(dest)], stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: cp.poll() is not None or (dest.exists() and os.stat(dest).st_size >= 50 * MIB), 120,
                       "the copy to pass 50 MiB")
            assert cp.poll() is None, "the copy finished before the fault: nothing was tested"
            c.kill(victim)
            _, err = cp.communicate(timeout=300)
        finally:
            if cp.poll() is None:
                cp.kill()
        assert cp.returncode == 0, f"cp failed after {victim} was killed: {err}\n{c.log_tails()}"
        assert os.stat(dest).st_size == 200 * MIB
        cmp(big_local_file, dest)
        assert serving(c)[victim] != "serving"

        # back with kvfs up: it restarts only the victim and waits until its target serves again (resynced)
        r = c.up()
        assert f"started {victim}" in r.stdout
        assert set(serving(c).values()) == {"serving"}
        cmp(big_local_file, dest)

        # the resynced replica alone holds the whole file: stop the two others and read it from the victim
        others = [n for n in chain_order(c) if n != victim]
        for name in others:
            c.kill(name)
        wait_until(lambda: all(serving(c)[n] != "serving" for n in others), 30, "the two others to be taken out")
        cmp(big_local_file, dest)


def test_a_chunk_server_resyncs_after_files_were_deleted_and_truncated():
    with started("kvfs-fault-rm-") as c:
        files = [c.mount / f"f{i}" for i in range(4)]
        for f in files:
            f.write_bytes(os.urandom(5 * MIB))  # two chunks each
        inodes = [os.stat(f).st_ino for f in files]
        for f in files[:3]:
            f.unlink()
        os.truncate(files[3], MIB)  # drops its second chunk
        wait_until(lambda: chunks_held(c.data, inodes[:3]) == 0, 60, "meta to collect the deleted files' chunks")
        victim = chain_order(c)[-1]
        c.kill(victim)
        r = c.up()  # restarts it and waits until its target serves again: the resync finished
        assert f"started {victim}" in r.stdout
        assert set(serving(c).values()) == {"serving"}


LOOP = r"""
import os, sys, time, traceback
d, n, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3]
i = op = None
try:
    for i in range(n):
        p, q = f"{d}/f{i}", f"{d}/g{i}"
        op = "create"
        with open(p, "wb") as f:
            f.write(b"%d" % i)
        op = "stat"
        assert os.stat(p).st_size == len(b"%d" % i)
        op = "rename"
        os.rename(p, q)
        op = "stat renamed"
        os.stat(q)
        if i % 2:
            op = "unlink"
            os.unlink(q)
        if i % 20 == 0:
            with open(progress + ".tmp", "w") as f:
                f.write(str(i))
            os.replace(progress + ".tmp", progress)
except BaseException as e:
    print(f"iteration {i}, {op}: {e!r} at {time.time():.3f}", flush=True)
    traceback.print_exc()
    sys.exit(1)
"""


def restart_meta(c: KvfsCluster, argv: list[bytes]) -> None:
    """Start meta again exactly as kvfs up does (same argv, log, pid file, own session), so kvfs down stops it.
    Not with kvfs up itself: test_up_restarts_meta_stopped_under_a_live_mount says why."""
    with open(c.data / "logs" / "meta.log", "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=c.data)
    (c.data / "run" / "meta.pid").write_text(str(proc.pid))
    address = json.loads((c.data / "local.json").read_text())["meta"]
    host, port = address.rsplit(":", 1)

    def listening() -> bool:
        assert proc.poll() is None, f"meta exited at start-up\n{c.log_tails()}"
        try:
            socket.create_connection((host, int(port)), timeout=0.3).close()
            return True
        except OSError:
            return False

    wait_until(listening, 30, "meta to listen again", interval=0.05)


def progress_of(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return -1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_meta_restarts_during_a_metadata_loop(sig):
    """Meta restarted at iterations 300 and 1,100: by SIGTERM (it drains running calls) or SIGKILL (they die; a
    call that ran but lost its answer is retried under its op id and meta answers it from the record)."""
    n = 2000
    with started("kvfs-fault-meta-") as c, tempfile.TemporaryDirectory(prefix="kvfs-progress-") as tmp:
        work = c.mount / "loop"
        work.mkdir()
        progress = Path(tmp) / "progress"
        loop = subprocess.Popen([sys.executable, "-c", LOOP, str(work), str(n), str(progress)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        restarts = []
        try:
            for at in (300, 1100):
                wait_until(lambda: loop.poll() is not None or progress_of(progress) >= at, 180,
                           f"the loop to pass iteration {at}")
                if loop.poll() is not None:
                    break
                argv = Path(f"/proc/{c.pid('meta')}/cmdline").read_bytes().split(b"\0")[:-1]
                old = c.kill("meta", sig)
                time.sleep(0.5)  # calls meet a dead service for a moment
                restart_meta(c, argv)
                restarts.append((old, c.pid("meta"), progress_of(progress), time.time()))
            out, _ = loop.communicate(timeout=300)
        finally:
            if loop.poll() is None:
                loop.kill()
        assert loop.returncode == 0, (f"the loop failed across meta restarts {restarts}:\n{out}\n"
                                      f"{c.log_tails(3000)}")
        assert len(restarts) == 2 and all(old != new for old, new, *_ in restarts)
        assert sorted(os.listdir(work)) == sorted(f"g{i}" for i in range(0, n, 2))
        for i in range(0, n, 50 * 2):
            assert (work / f"g{i}").read_bytes() == b"%d" % i



def test_up_restarts_meta_stopped_under_a_live_mount():
    with started("kvfs-fault-up-meta-") as c:
        (c.mount / "f").write_bytes(b"before")
        old = c.kill("meta", signal.SIGTERM)
        time.sleep(1.5)  # past the kernel's attribute cache of the mount root
        try:  # with every other service up, restarting meta takes a second or two
            r = c.kvfs("up", "--data", str(c.data), "--mount", str(c.mount), timeout=15, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail("kvfs up hung for 15 s")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "started meta" in r.stdout and c.pid("meta") not in (None, old)
        assert (c.mount / "f").read_bytes() == b"before"
