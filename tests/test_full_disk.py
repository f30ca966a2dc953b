"""A full data disk on a real ``kvfs up`` cluster and mount (issue 28, items 2 and 3): chunk data stops at the
reserve, writers get ENOSPC, and metadata, reads and deletes go on; targets on tmpfs serve 4 KiB reads."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import sqlite3
import subprocess
from pathlib import Path

from cluster_fixtures import NEEDS_FUSE, KVFS, REPO, KvfsCluster, wait_until
from tmpfs import tmpfs

MIB = 1 << 20
pytestmark = NEEDS_FUSE


def write_file(path: Path, data: bytes) -> None:
    """Write, fsync and close ``data`` as a new file; any OSError from write, fsync or close propagates."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for at in range(0, len(data), MIB):
            os.write(fd, data[at : at + MIB])
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_full_data_disk_refuses_writes_with_enospc_and_stays_manageable():
    """Everything on one 256 MiB tmpfs (KV store, logs, chunk data), as the issue found it: fill it through the
    mount until a write, fsync or close says ENOSPC; then stat, ls, read and rm work, the KV store is healthy, and
    once the removed files' chunks are collected a new file can be written."""
    with tmpfs("256M") as fs:
        fs.joinpath("c").mkdir()
        cluster = KvfsCluster(fs / "c")
        try:
            cluster.up()
            kept: dict[Path, str] = {}
            failure = None
            for i in range(200):
                path = cluster.mount / f"f{i:03d}"
                data = os.urandom(4 * MIB)
                try:
                    write_file(path, data)
                except OSError as e:
                    failure = e
                    break
                kept[path] = hashlib.sha256(data).hexdigest()
            assert failure is not None, "256 MiB of tmpfs took 800 MiB of files"
            assert failure.errno == errno.ENOSPC, f"the writer got {failure!r}, not ENOSPC\n{cluster.log_tails()}"
            assert len(kept) >= 5
            # small files take the last MiBs a 4 MiB chunk no longer fits in: without the reserve they took the
            # last bytes, and mgmtd's lease renewal, and every metadata call with it, failed
            small = os.urandom(4096)
            for i in range(2000):
                try:
                    write_file(cluster.mount / f"small{i:04d}", small)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, f"a small write got {e!r}, not ENOSPC\n{cluster.log_tails()}"
                    os.unlink(cluster.mount / f"small{i:04d}")
                    break
                kept[cluster.mount / f"small{i:04d}"] = hashlib.sha256(small).hexdigest()
            else:
                raise AssertionError("2,000 small files did not fill the disk")
            st = os.statvfs(fs)
            assert st.f_bavail * st.f_frsize >= 16 * MIB, "chunk data ate the reserve"

            # metadata, reads and deletes go on
            names = set(os.listdir(cluster.mount))
            assert {p.name for p in kept} <= names
            assert all(os.stat(p).st_size in (4 * MIB, len(small)) for p in kept)
            (cluster.mount / "dir").mkdir()
            (cluster.mount / "dir" / "empty").touch()
            os.rename(cluster.mount / "dir" / "empty", cluster.mount / "dir" / "renamed")
            for p, digest in list(kept.items())[:3]:
                assert hashlib.sha256(p.read_bytes()).hexdigest() == digest
            removed = [p for p in kept if p.name.startswith("f")][: len(kept) // 2]
            for p in removed:
                os.unlink(p)
                del kept[p]
            for failed in cluster.mount.glob("f*"):
                if failed not in kept and failed not in removed:
                    os.unlink(failed)  # the file whose write failed

            # the collector frees the removed files' chunks; their slots take the next file
            data = os.urandom(8 * MIB)

            def written() -> bool:
                try:
                    write_file(cluster.mount / "after-rm", data)
                    return True
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    os.unlink(cluster.mount / "after-rm")
                    return False

            wait_until(written, 60, "a write to succeed once removed files' chunks were collected", interval=1)
            assert (cluster.mount / "after-rm").read_bytes() == data
            for p, digest in kept.items():
                assert hashlib.sha256(p.read_bytes()).hexdigest() == digest

            # the KV store never ran out of room: mgmtd kept its lease, the database checks clean
            status = cluster.status()
            assert all(p["alive"] for p in status["processes"]), status
            assert all(t["state"] == "serving" for t in status["targets"]), status
            conn = sqlite3.connect(f"file:{cluster.data / 'kv.db'}?mode=ro", uri=True)
            try:
                assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
            finally:
                conn.close()
            logs = "".join(p.read_text(errors="replace") for p in (cluster.data / "logs").glob("*.log"))
            assert "disk is full" not in logs and "database or disk" not in logs
        finally:
            cluster.close()


def test_targets_on_tmpfs_serve_4k_reads_and_kv_dir_keeps_the_kv_store_apart(tmp_path):
    """Chunk data on tmpfs (which refuses ``RWF_NOWAIT``), the KV store elsewhere with ``--kv-dir``: 4 KiB random
    reads through the mount return the right bytes, and a restart that names another ``--kv-dir`` is refused."""
    kv_dir = tmp_path / "kv"
    with tmpfs("256M") as fs:
        fs.joinpath("c").mkdir()
        cluster = KvfsCluster(fs / "c")
        try:
            cluster.up("--kv-dir", str(kv_dir))
            assert (kv_dir / "kv.db").exists() and not (cluster.data / "kv.db").exists()
            data = os.urandom(16 * MIB)
            write_file(cluster.mount / "f", data)  # write-only open: nothing of it in the kernel's page cache
            fd = os.open(cluster.mount / "f", os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: the mount sees small reads
                for at in random.Random(1).sample(range(0, len(data), 4096), 200):
                    assert os.pread(fd, 4096, at) == data[at : at + 4096], at
            finally:
                os.close(fd)
            r = subprocess.run([*KVFS, "up", "--data", str(cluster.data), "--mount", str(cluster.mount),
                                "--kv-dir", str(tmp_path / "elsewhere")], capture_output=True, text=True, cwd=REPO,
                               timeout=60)
            assert r.returncode != 0 and "keeps its KV store at" in r.stderr, r
            logs = "".join(p.read_text(errors="replace") for p in (cluster.data / "logs").glob("cs*.log"))
            assert "Traceback" not in logs and "EIO" not in logs
        finally:
            cluster.close()
