"""Two OS processes, each with its own MetaStore, race namespace operations on one SQLite file."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import stat
import time

from kvfs.errors import KvfsError
from kvfs.meta.chunks import MemoryChunkRemover
from kvfs.meta.fsck import check
from kvfs.kv import SqliteDatabase
from kvfs.meta.posix import RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO
from kvfs.meta.store import MetaStore
from kvfs.meta.types import Caller

ME = Caller(1000, 1000)
NAMES = [b"n%d" % i for i in range(5)]
EXPECTED = {errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR, errno.EINVAL}


def _race(path: str, dir_ino: int, seconds: float, seed: int, out) -> None:
    ms = MetaStore(SqliteDatabase(path), chunk_remover=MemoryChunkRemover())
    rng = random.Random(seed)
    done = 0
    deadline = time.monotonic() + seconds
    ops = [
        lambda: ms.mknod(ME, dir_ino, rng.choice(NAMES), stat.S_IFREG | 0o644),
        lambda: ms.mkdir(ME, dir_ino, rng.choice(NAMES), 0o755),
        lambda: ms.close(ME, *_open_new(ms, dir_ino, rng.choice(NAMES))),
        lambda: ms.unlink(ME, dir_ino, rng.choice(NAMES)),
        lambda: ms.rmdir(ME, dir_ino, rng.choice(NAMES)),
        lambda: ms.link(ME, ms.lookup(ME, dir_ino, rng.choice(NAMES)).ino, dir_ino, rng.choice(NAMES)),
        lambda: ms.rename(ME, dir_ino, rng.choice(NAMES), dir_ino, rng.choice(NAMES),
                          rng.choice([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE])),
        lambda: ms.gc_once(),
    ]
    while time.monotonic() < deadline:
        try:
            rng.choice(ops)()
            done += 1
        except KvfsError as exc:
            if exc.errno not in EXPECTED and exc.errno != errno.EPERM:
                raise
    out.put(done)


def _open_new(ms: MetaStore, dir_ino: int, name: bytes) -> tuple[int, int | None]:
    opened = ms.create(ME, dir_ino, name, 0o644, os.O_WRONLY)
    return opened.attr.ino, opened.session


def test_processes_race_on_one_directory(tmp_path):
    path = str(tmp_path / "meta.db")
    ms = MetaStore(SqliteDatabase(path), chunk_remover=MemoryChunkRemover())
    ms.format(mode=0o777)
    d = ms.mkdir(ME, ROOT_INO, b"race", 0o755)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(path, d.ino, 2.0, seed, out)) for seed in (1, 2)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all(c > 20 for c in counts), counts
    assert check(ms.db) == []
    while ms.gc_once():
        pass
    assert check(ms.db) == []
    remaining = ms.readdir(ME, d.ino, limit=100).entries
    assert len({e.name for e in remaining}) == len(remaining) <= len(NAMES)
