"""Test harness for the FUSE mount: in-process stand-ins for the remote collaborators, and a server
entry point the tests start in a subprocess.

* ``kvfs.meta.client.LocalMeta`` turns the synchronous ``kvfs.meta.store.MetaStore`` into the async interface the mount
  codes against (the real ``kvfs.meta.client.RemoteMeta`` exposes the same method names over RPC).
* :class:`LocalFileStorage` implements ``kvfs.storage.FileStorage`` over one ``ChunkEngine`` directory:
  chunk ``i`` of a file covers bytes ``[i * chunk_size, (i + 1) * chunk_size)``, one replica, versions
  taken from ``engine.meta()``. The distributed StorageClient replaces it; the mount knows nothing of it.
* ``python -m tests.fuse_harness MOUNTPOINT STATE_DIR`` builds both on STATE_DIR and runs the mount
  until SIGTERM/SIGINT (it prints ``READY`` on stdout once the mount answers).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import random
import sys
import threading
from typing import Any
from collections.abc import Iterator
from pathlib import Path

import trio
from crc32c import crc32c

from kvfs.chunkserver.engine import ChunkEngine, ChunkId
from kvfs.fuse.mount import is_mounted
from kvfs.errors import KvfsError
from kvfs.meta.local import LocalMeta


class LocalFileStorage:
    """``kvfs.storage.FileStorage`` over a single local ChunkEngine (one replica, no chains)."""

    def __init__(self, engine: ChunkEngine, *, fail_writes_from: int | None = None, write_jitter: float = 0.0) -> None:
        self.engine = engine
        self.fail_writes_from = fail_writes_from  # tests: writes reaching this offset fail with ENOSPC
        self.write_jitter = write_jitter  # tests: each write waits up to this long first, so writes finish out of order
        self._locks: dict[ChunkId, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def _lock(self, cid: ChunkId) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(cid, threading.Lock())

    def _next_version(self, cid: ChunkId) -> int:
        m = self.engine.meta(cid)
        if m is None:
            return 1
        return max(m.committed_version, m.pending_version or 0) + 1

    @staticmethod
    def _pieces(chunk_size: int, offset: int, length: int):
        """(chunk index, offset in chunk, offset in buffer, length) for each chunk a range touches."""
        pos, end = offset, offset + length
        while pos < end:
            idx, off = divmod(pos, chunk_size)
            n = min(chunk_size - off, end - pos)
            yield idx, off, pos - offset, n
            pos += n

    # -- reads
    def _read_sync(self, ino: int, chunk_size: int, offset: int, into: memoryview) -> int:
        for idx, off, boff, n in self._pieces(chunk_size, offset, len(into)):
            dst = into[boff:boff + n]
            try:
                got, _ = self.engine.read(ChunkId(ino, idx), off, n, into=dst)
            except KvfsError as e:
                if e.errno != errno.ENOENT:
                    raise
                got = 0
            if got < n:
                dst[got:] = bytes(n - got)
        return len(into)

    async def read(self, ino, layout, offset, into):
        into = memoryview(into).cast("B")
        return await trio.to_thread.run_sync(self._read_sync, ino, layout.chunk_size, offset, into)

    # -- writes
    def _write_sync(self, ino: int, chunk_size: int, offset: int, data: memoryview) -> None:
        for idx, off, boff, n in self._pieces(chunk_size, offset, len(data)):
            self._write_version(ChunkId(ino, idx), chunk_size, off, data[boff:boff + n])

    def _write_version(self, cid: ChunkId, chunk_size: int, offset: int, data: memoryview | bytes,
                       extents: list[tuple[int, int]] | None = None) -> None:
        with self._lock(cid):
            version = self._next_version(cid)
            self.engine.write_pending(cid, version, offset, data, crc32c(data), chunk_size=chunk_size, extents=extents)
            self.engine.commit(cid, version)

    async def _faults(self, end: int) -> None:
        if self.fail_writes_from is not None and end > self.fail_writes_from:
            raise KvfsError("injected: no space", errno.ENOSPC)
        if self.write_jitter:
            await trio.sleep(random.uniform(0, self.write_jitter))

    async def write(self, ino, layout, offset, data):
        data = memoryview(data).cast("B")
        await self._faults(offset + len(data))
        await trio.to_thread.run_sync(self._write_sync, ino, layout.chunk_size, offset, data)

    async def write_runs(self, ino, layout, runs):
        """Runs of one file, sorted and apart, a chunk's in one version, as StorageClient.write_runs makes."""
        by_chunk: dict[int, list] = {}
        for offset, data in runs:
            by_chunk.setdefault(offset // layout.chunk_size, []).append((offset, data))
        for index, chunk_runs in by_chunk.items():
            await self._faults(chunk_runs[-1][0] + len(chunk_runs[-1][1]))
            base = index * layout.chunk_size
            extents = [(offset - base, len(data)) for offset, data in chunk_runs]
            await trio.to_thread.run_sync(self._write_version, ChunkId(ino, index), layout.chunk_size,
                                          chunk_runs[0][0] - base, b"".join(data for _, data in chunk_runs), extents)

    def _truncate_sync(self, ino: int, chunk_size: int, new_length: int) -> None:
        keep = -(-new_length // chunk_size)  # chunks [0, keep) may hold bytes below new_length
        self.engine.remove_from(ino, keep)
        for m in self.engine.list_chunks(ino):
            idx = m.chunk_id.index
            if idx == keep - 1:
                tail = new_length - idx * chunk_size
                with self._lock(m.chunk_id):
                    cur = self.engine.meta(m.chunk_id)
                    if cur is not None and cur.length > tail:
                        self.engine.truncate(m.chunk_id, tail, self._next_version(m.chunk_id))

    async def truncate(self, ino, layout, old_length, new_length):
        await trio.to_thread.run_sync(self._truncate_sync, ino, layout.chunk_size, new_length)

    async def flush(self, ino):
        await trio.to_thread.run_sync(self.engine.flush)

    async def remove_files(self, inodes):
        await trio.to_thread.run_sync(self.engine.remove_files, inodes)

    async def capacity(self):
        total, _used, free = await trio.to_thread.run_sync(self.engine.space)
        return total, free


class StorageChunkRemover:
    """meta's ChunkRemover (sync, called by its GC) over the same local engine."""

    def __init__(self, engine: ChunkEngine) -> None:
        self.engine = engine

    def remove_chunks(self, inodes) -> None:
        self.engine.remove_files(inodes)


# ---------------------------------------------------------------------------------- server
def build(state_dir: Path, *, chunk_size: int | None = None, **faults: Any):
    """(meta, storage, engine) over STATE_DIR: a MetaStore on SQLite, a ChunkEngine beside it; ``faults`` go to
    :class:`LocalFileStorage`."""
    from kvfs.kv import SqliteDatabase
    from kvfs.meta.store import MetaStore
    from kvfs.meta.types import Layout

    state_dir.mkdir(parents=True, exist_ok=True)
    engine = ChunkEngine(state_dir / "target", fsync=False)
    layout = Layout() if chunk_size is None else Layout(chunk_size=chunk_size)
    store = MetaStore(
        SqliteDatabase(str(state_dir / "meta.db")),
        chunk_remover=StorageChunkRemover(engine),
        space=lambda: engine.space()[::2],
        root_layout=layout,
    )
    store.format(mode=0o755)
    return LocalMeta(store), LocalFileStorage(engine, **faults), engine


async def serve(mountpoint: str, state_dir: str, chunk_size: int | None, write_buffer: int, faults: dict) -> None:
    from kvfs.fuse.mount import run_mount

    meta, storage, engine = build(Path(state_dir), chunk_size=chunk_size, **faults)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: run_mount(
                meta, storage, mountpoint, write_buffer=write_buffer, task_status=task_status))
            print("READY", flush=True)
    finally:
        engine.close()


def main(argv: list[str]) -> None:
    import argparse
    import logging

    p = argparse.ArgumentParser(description="kvfs test mount: MetaStore on SQLite + one local chunk engine")
    p.add_argument("mountpoint")
    p.add_argument("state_dir")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--write-buffer", type=int, default=8 << 20)
    p.add_argument("--fail-writes-from", type=int, default=None)
    p.add_argument("--write-jitter", type=float, default=0.0)
    p.add_argument("--link-max", type=int, default=None, help="tests: meta's limit on a file's hard links")
    p.add_argument("--debug", action="store_true")
    a = p.parse_args(argv)
    if a.link_max is not None:
        from kvfs.meta.ops import entries

        entries.LINK_MAX = a.link_max
    logging.basicConfig(level=logging.DEBUG if a.debug else logging.WARNING, stream=sys.stderr)
    trio.run(serve, a.mountpoint, a.state_dir, a.chunk_size, a.write_buffer,
             {"fail_writes_from": a.fail_writes_from, "write_jitter": a.write_jitter})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main(sys.argv[1:])


# ---------------------------------------------------------------------------------- test helpers
HARNESS = str(Path(__file__).resolve())
REPO = str(Path(__file__).resolve().parent.parent)


class Mount:
    def __init__(self, path: Path, proc, log: Path) -> None:
        self.path, self.proc, self.log = path, proc, log

    def log_text(self) -> str:
        try:
            return self.log.read_text()
        except OSError:
            return ""


@contextlib.contextmanager
def running_mount(base: Path, *extra: str, public: bool = False) -> Iterator[Mount]:
    """A harness mount for a test module; always stopped and unmounted afterwards."""
    m = start_mount(base, *extra, public=public)
    try:
        yield m
    finally:
        stop_mount(m)


_dirs = itertools.count()


def fresh_dir(m: Mount, mode: int | None = None) -> Path:
    """A new directory on the mount for one test (``mode`` given explicitly: mkdir is subject to the umask)."""
    path = m.path / f"t{next(_dirs)}"
    os.mkdir(path)
    if mode is not None:
        os.chmod(path, mode)
    return path


def start_mount(base: Path, *extra: str, timeout: float = 20.0, public: bool = False) -> Mount:
    """Start the harness server in a subprocess and wait until the mount answers.  ``public`` puts
    the mount point in a world-searchable directory (pytest's tmp dirs are 0700), for tests that
    act as other users."""
    import select
    import subprocess
    import tempfile
    import time

    state, log = base / "state", base / "server.log"
    if public:
        top = Path(tempfile.mkdtemp(prefix="kvfs-fuse-"))
        top.chmod(0o755)
        mnt = top / "mnt"
    else:
        mnt = base / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "w") as logf:
        proc = subprocess.Popen([sys.executable, HARNESS, str(mnt), str(state), *extra],
                                stdout=subprocess.PIPE, stderr=logf, env=env, cwd=REPO)
    m = Mount(mnt, proc, log)
    deadline = time.monotonic() + timeout
    line = b""
    while b"READY" not in line:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            stop_mount(m)
            raise RuntimeError(f"mount did not come up (rc={proc.poll()}): {m.log_text()}")
        if select.select([proc.stdout], [], [], left)[0]:
            line = proc.stdout.readline() or line
            if proc.poll() is not None and b"READY" not in line:
                continue
    if not is_mounted(mnt):
        stop_mount(m)
        raise RuntimeError(f"server ready but nothing mounted at {mnt}: {m.log_text()}")
    return m


def stop_mount(m: Mount, timeout: float = 15.0) -> int | None:
    """SIGTERM (the daemon flushes and unmounts), then SIGKILL; a mount left behind is lazily removed."""
    import subprocess

    from kvfs.fuse.mount import force_unmount

    rc = None
    if m.proc.poll() is None:
        m.proc.terminate()
        try:
            rc = m.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            m.proc.kill()
            rc = m.proc.wait(5)
    else:
        rc = m.proc.returncode
    if m.proc.stdout:
        m.proc.stdout.close()
    if is_mounted(m.path):
        force_unmount(str(m.path))
    if m.path.parent.name.startswith("kvfs-fuse-"):
        try:
            m.path.rmdir()
            m.path.parent.rmdir()
        except OSError:
            pass
    return rc


def run_as(uid: int, gid: int, fn, *args, groups: tuple[int, ...] = ()):
    """Run ``fn(*args)`` in a forked child with the given identity. Returns its result, or the
    errno of the OSError it raised as ``("errno", n)``."""
    import pickle

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            try:
                os.setgroups(list(groups))
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
                out = ("ok", fn(*args))
            except OSError as e:
                out = ("errno", e.errno)
            except BaseException as e:  # noqa: BLE001
                out = ("exc", repr(e))
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    os.waitpid(pid, 0)
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "exc":
        raise AssertionError(f"child raised {value}")
    return value if kind == "ok" else ("errno", value)


# ------------------------------------------------------------ comparing the mount with local disk
_libc = None
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def renameat2(old, new, flags: int) -> None:
    """renameat2(2), which Python's os module lacks."""
    import ctypes

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def outcome(fn, *args):
    """("ok", result) or ("err", "ENAME"): comparable across filesystems, readable in a diff."""
    try:
        return ("ok", fn(*args))
    except OSError as e:
        return ("err", errno.errorcode.get(e.errno, e.errno))


def compare(local: dict, mounted: dict) -> None:
    """Every case's outcome on the mount is the one on local disk."""
    diff = [f"  {k}: local {local[k]!r} / kvfs {mounted.get(k)!r}" for k in local if local[k] != mounted.get(k)]
    assert not diff, "kvfs differs from the local filesystem:\n" + "\n".join(diff)
