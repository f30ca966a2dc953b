"""Real programs on a real mount (issue 4, §3): git, tar + diff -r, SQLite, concurrent writers.

All on the shared ``kvfs up`` cluster (tests/cluster_fixtures.py), each test in its own directory.
Programs that are missing (git, tar, diff) make their test skip and say which Debian package brings them.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest

pytest.register_assert_rewrite("cluster_fixtures")
from cluster_fixtures import NEEDS_FUSE  # noqa: E402

pytest_plugins = ["cluster_fixtures"]
pytestmark = NEEDS_FUSE
MIB = 1 << 20


def need(program: str, package: str) -> str:
    path = shutil.which(program)
    if path is None:
        pytest.skip(f"{program} is not installed (Debian package: {package})")
    return path


def run(*cmd, cwd=None, env=None, timeout=180) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture
def local_dir():
    path = Path(tempfile.mkdtemp(prefix="kvfs-local-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------------- git
def test_git_init_add_commit_log(mnt_dir, local_dir):
    need("git", "git")
    repo = mnt_dir / "repo"
    repo.mkdir()
    env = {**os.environ, "HOME": str(local_dir), "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "kvfs",
           "GIT_AUTHOR_EMAIL": "kvfs@example.com", "GIT_COMMITTER_NAME": "kvfs",
           "GIT_COMMITTER_EMAIL": "kvfs@example.com", "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}

    def git(*args: str) -> str:
        return run("git", *args, cwd=repo, env=env)

    git("init", "-q", "-b", "main")
    rnd = random.Random(4)
    (repo / "src").mkdir()
    for i in range(40):
        (repo / "src" / f"m{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * rnd.randrange(1, 400))
    (repo / "blob.bin").write_bytes(rnd.randbytes(3 * MIB))  # a multi-chunk object
    (repo / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(repo / "run.sh", 0o755)
    git("add", "-A")
    git("commit", "-q", "-m", "first")

    (repo / "src" / "m0.py").write_text("changed\n")
    git("mv", "src/m1.py", "src/renamed.py")
    git("rm", "-q", "src/m2.py")
    git("add", "-A")
    git("commit", "-q", "-m", "second")

    log = git("log", "--format=%s").split()
    assert log == ["second", "first"]
    assert git("status", "--porcelain") == ""
    assert "src/renamed.py" in git("ls-files")
    assert git("show", "HEAD:src/m0.py") == "changed\n"
    stat_line = git("diff", "--stat", "HEAD~1", "HEAD").strip().splitlines()[-1]
    assert "3 files changed" in stat_line or "4 files changed" in stat_line, stat_line
    git("fsck", "--strict", "--no-progress")
    git("gc", "-q")  # packs objects: renames, mmap, fsync all through the mount
    git("fsck", "--strict", "--no-progress")
    assert git("log", "--format=%s") == "second\nfirst\n"

    # the same history built on local disk has the same commit ids (git content addressing)
    clone = local_dir / "clone"
    run("git", "clone", "-q", str(repo), str(clone), env=env)
    assert run("git", "rev-parse", "HEAD", cwd=clone, env=env) == git("rev-parse", "HEAD")
    assert (clone / "blob.bin").read_bytes() == (repo / "blob.bin").read_bytes()
    assert os.stat(clone / "run.sh").st_mode & 0o111


# ------------------------------------------------------------------------------------------ tar + diff -r
def make_tree(root: Path, seed: int = 7) -> None:
    """A few hundred files of random sizes in nested directories, plus the repository's own kvfs/ sources."""
    rnd = random.Random(seed)
    dirs = [root]
    for i in range(30):
        d = rnd.choice(dirs) / f"d{i}"
        d.mkdir()
        dirs.append(d)
    sizes = [0, 1, 100, 4095, 4096, 4097, 65536, MIB - 1, MIB, MIB + 1, 3 * MIB + 7]
    for i in range(300):
        size = sizes[i] if i < len(sizes) else int(rnd.paretovariate(1.2) * 200) % (512 * 1024)
        p = rnd.choice(dirs) / f"f{i}.dat"
        p.write_bytes(rnd.randbytes(size))
        os.chmod(p, rnd.choice([0o644, 0o600, 0o755, 0o444]))
    os.symlink("d0/../f20.dat", root / "link")
    os.symlink("/nonexistent/target", root / "dangling")
    os.mkdir(root / "empty-dir")
    shutil.copytree(Path(__file__).resolve().parent.parent / "kvfs", root / "kvfs-src",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # times well in the past: tar sets them back on unpack (see test_explicit_times_near_now_are_kept_exactly)
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in dirnames + filenames + ["."]:
            when = 1_600_000_000 + rnd.randrange(10**6)
            os.utime(Path(dirpath) / name, (when, when), follow_symlinks=False)


def tree_stats(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            entry = (stat.filemode(st.st_mode),)
            if not stat.S_ISREG(st.st_mode):  # regular files' mtimes: test_mtime_set_before_close_survives_close
                entry += (int(st.st_mtime),)
            if stat.S_ISLNK(st.st_mode):
                entry += (os.readlink(p),)
            elif stat.S_ISREG(st.st_mode):
                entry += (st.st_size,)
            out[str(p.relative_to(root))] = entry
    return out


def test_tarball_unpacked_on_the_mount_matches_local_disk(mnt_dir, local_dir):
    need("tar", "tar")
    need("diff", "diffutils")
    src = local_dir / "src"
    src.mkdir()
    make_tree(src)
    tarball = local_dir / "tree.tar.gz"
    run("tar", "czf", str(tarball), "-C", str(src), ".")
    (local_dir / "unpacked").mkdir()
    run("tar", "xzf", str(tarball), "-C", str(local_dir / "unpacked"))
    (mnt_dir / "unpacked").mkdir()
    run("tar", "xzf", str(tarball), "-C", str(mnt_dir / "unpacked"))

    run("diff", "-r", "--no-dereference", str(local_dir / "unpacked"), str(mnt_dir / "unpacked"))
    local, mounted = tree_stats(local_dir / "unpacked"), tree_stats(mnt_dir / "unpacked")
    assert len(local) > 300
    assert local == mounted  # modes, directory mtimes, sizes, symlink targets survive tar on the mount

    # and back: a tarball made on the mount unpacks to the same tree
    again = local_dir / "again"
    again.mkdir()
    run("tar", "cf", str(local_dir / "from-mount.tar"), "-C", str(mnt_dir / "unpacked"), ".")
    run("tar", "xf", str(local_dir / "from-mount.tar"), "-C", str(again))
    run("diff", "-r", "--no-dereference", str(local_dir / "unpacked"), str(again))


def test_mtime_set_before_close_survives_close(mnt_dir):
    p = mnt_dir / "f"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"x" * 200)  # still in the mount's write buffer
    os.utime(fd, ns=(10**12, 10**12))
    os.close(fd)
    time.sleep(1.5)  # past the kernel's 1 s attribute cache, which still holds the setattr reply
    assert os.stat(p).st_mtime_ns == 10**12


def test_explicit_times_near_now_are_kept_exactly(mnt_dir):
    p = mnt_dir / "f"
    p.write_bytes(b"x")
    when = (time.time_ns() // 10**9 - 1) * 10**9  # a whole second, one second ago
    os.utime(p, ns=(when, when))
    time.sleep(1.5)
    assert os.stat(p).st_mtime_ns == when


# ------------------------------------------------------------------------------------------------ SQLite
def fill_and_query(path: Path, journal_mode: str) -> dict:
    con = sqlite3.connect(path)
    try:
        assert con.execute(f"PRAGMA journal_mode={journal_mode}").fetchone()[0].lower() == journal_mode.lower()
        con.execute("CREATE TABLE kv (id INTEGER PRIMARY KEY, k TEXT NOT NULL, v BLOB, n INTEGER)")
        con.execute("CREATE INDEX kv_k ON kv (k)")
        rnd = random.Random(11)
        for batch in range(10):  # 10,000 rows in 10 transactions
            with con:
                con.executemany("INSERT INTO kv (k, v, n) VALUES (?, ?, ?)",
                                [(f"key-{batch}-{i}", rnd.randbytes(rnd.randrange(0, 300)), rnd.randrange(1000))
                                 for i in range(1000)])
        with con:
            con.execute("UPDATE kv SET n = n + 1 WHERE n % 7 = 0")
            con.execute("DELETE FROM kv WHERE n % 13 = 0")
        with pytest.raises(sqlite3.IntegrityError), con:  # a failed transaction rolls back
            con.execute("INSERT INTO kv (k, n) VALUES ('rolled back', 1)")
            con.execute("INSERT INTO kv (id, k) VALUES (1, 'duplicate id')")
        con.execute("VACUUM")
    finally:
        con.close()
    con = sqlite3.connect(path)  # reopen: everything came back from the filesystem
    try:
        return {
            "integrity": con.execute("PRAGMA integrity_check").fetchone()[0],
            "count": con.execute("SELECT count(*) FROM kv").fetchone()[0],
            "sum": con.execute("SELECT sum(n), sum(length(v)) FROM kv").fetchone(),
            "by index": con.execute("SELECT id, n FROM kv WHERE k BETWEEN 'key-3-' AND 'key-3-5' ORDER BY k").fetchall(),
            "digest": hashlib.sha256(repr(con.execute("SELECT * FROM kv ORDER BY id").fetchall()).encode()).hexdigest(),
            "rolled back": con.execute("SELECT count(*) FROM kv WHERE k = 'rolled back'").fetchone()[0],
        }
    finally:
        con.close()


@pytest.mark.parametrize("journal_mode", ["delete", "wal"])
def test_sqlite_database_created_filled_and_queried(mnt_dir, local_dir, journal_mode):
    local = fill_and_query(local_dir / "db.sqlite", journal_mode)
    mounted = fill_and_query(mnt_dir / "db.sqlite", journal_mode)
    assert mounted == local
    assert mounted["integrity"] == "ok" and mounted["rolled back"] == 0 and 9000 < mounted["count"] < 10000


# ------------------------------------------------------------------------------------ concurrent writers
WRITER = r"""
import hashlib, os, random, struct, sys, zlib
own, shared, wid = sys.argv[1], sys.argv[2], int(sys.argv[3])
rnd = random.Random(wid)
h = hashlib.sha256()
fd = os.open(own, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
log = os.open(shared, os.O_WRONLY | os.O_APPEND)
for seq in range(150):
    block = rnd.randbytes(rnd.choice([1, 4096, 65536, 300_000, 1 << 20]) if seq % 10 == 0 else rnd.randrange(1, 20000))
    os.write(fd, block)
    h.update(block)
    payload = rnd.randbytes(rnd.randrange(0, 3000))
    body = struct.pack("<III", wid, seq, zlib.crc32(payload)) + payload
    assert os.write(log, struct.pack("<I", len(body)) + body) == 4 + len(body)
    if seq % 50 == 49:
        os.fsync(fd)
os.close(fd)
os.close(log)
print(h.hexdigest())
"""


def test_concurrent_writers_own_files_and_one_shared_append_log(mnt_dir):
    import struct

    shared = mnt_dir / "shared.log"
    shared.write_bytes(b"")
    n = 5
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(mnt_dir / f"own{w}"), str(shared), str(w)],
                              stdout=subprocess.PIPE, text=True) for w in range(n)]
    digests = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0
        digests.append(out.strip())
    for w in range(n):
        assert hashlib.sha256((mnt_dir / f"own{w}").read_bytes()).hexdigest() == digests[w], f"own{w}"

    data = (mnt_dir / "shared.log").read_bytes()
    seen: dict[int, list[int]] = {w: [] for w in range(n)}
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        wid, seq, crc = struct.unpack_from("<III", data, pos + 4)
        payload = data[pos + 16:pos + 4 + length]
        assert zlib.crc32(payload) == crc, f"record {wid}/{seq} at {pos} is torn or overwritten"
        seen[wid].append(seq)
        pos += 4 + length
    assert pos == len(data)
    assert all(seqs == list(range(150)) for seqs in seen.values()), {w: len(s) for w, s in seen.items()}
