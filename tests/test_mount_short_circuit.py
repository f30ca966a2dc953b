"""The mount's short-circuit reads (fuse/local.py): small reads of chunks with a replica on this host come from the
replica's file, and they see what this mount and other clients wrote exactly as network reads do.

The unit tests drive :class:`LocalReads` against a real slot file and a stand-in for the one storage call it makes
(``locate``), to reach the cases a healthy cluster never shows: a CRC mismatch, a pin about to lapse, a file this
process may not open. The mount tests use real ``kvfs up`` clusters."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import trio
from crc32c import crc32c

from cluster_fixtures import NEEDS_FUSE, second_mount
from kvfs.chunkserver.protocol import ChunkLocation
from kvfs.crc import BLOCK
from kvfs.fuse.local import MARGIN_NS, LocalReads
from kvfs.fuse.writes import InodeState
from kvfs.meta.types import Layout

pytest_plugins = ["cluster_fixtures"]

CHUNK = 4 * BLOCK
LEASE_NS = 5 * 10**9


class OneChunkStorage:
    """``locate`` of a chunk kept in one file: what a chunk server on this host answers, counted."""

    def __init__(self, path: Path, data: bytes, *, crcs: list[int] | None = None, lease_ns: int = LEASE_NS) -> None:
        self.path, self.data, self.lease_ns, self.located, self.refuse = path, data, lease_ns, 0, False
        self.crcs = crcs if crcs is not None else [crc32c(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)]
        path.write_bytes(data)

    async def locate(self, ino, layout, index, within, length, boot_id) -> ChunkLocation | None:
        self.located += 1
        if self.refuse:  # no serving replica here, or a version whose blocks lie in several slots
            return None
        return ChunkLocation(1, str(self.path), 0, len(self.data), 0, self.crcs, time.monotonic_ns() + self.lease_ns)


def _state(size: int) -> InodeState:
    st = InodeState(7, Layout(chunk_size=CHUNK), size)
    st.stamp = (1, size)
    return st


def _read(local: LocalReads, st: InodeState, offset: int, n: int) -> bytes | None:
    out = memoryview(bytearray(n))
    return bytes(out) if trio.run(local.read, st, offset, out) else None


def test_one_locate_serves_many_reads_until_the_file_changes(tmp_path: Path) -> None:
    data = os.urandom(CHUNK - 1000)
    storage = OneChunkStorage(tmp_path / "slot", data)
    local, st = LocalReads(storage), _state(len(data))  # type: ignore[arg-type]
    for offset in (0, BLOCK + 5, 3 * BLOCK, len(data) - 10):
        assert _read(local, st, offset, 4096) == (data[offset : offset + 4096] + bytes(4096))[:4096]
    assert storage.located == 1
    local.drop(st.ino)  # this mount wrote to the file
    assert _read(local, st, 0, 10) == data[:10] and storage.located == 2
    st.stamp = (2, len(data))  # opened again after another client changed it
    assert _read(local, st, 0, 10) == data[:10] and storage.located == 3


def test_a_chunk_not_located_here_is_read_over_the_network_without_asking_each_time(tmp_path: Path) -> None:
    data = os.urandom(BLOCK)
    storage = OneChunkStorage(tmp_path / "slot", data)
    storage.refuse = True
    local, st = LocalReads(storage), _state(len(data))  # type: ignore[arg-type]
    assert _read(local, st, 0, 100) is None and _read(local, st, 100, 100) is None and storage.located == 1
    storage.refuse = False
    local.drop(st.ino)  # a write here (or an open that finds the file changed) asks again
    assert _read(local, st, 0, 100) == data[:100] and storage.located == 2


def test_a_pin_about_to_lapse_is_located_again(tmp_path: Path) -> None:
    data = os.urandom(BLOCK)
    storage = OneChunkStorage(tmp_path / "slot", data, lease_ns=MARGIN_NS // 2)
    local, st = LocalReads(storage), _state(len(data))  # type: ignore[arg-type]
    assert _read(local, st, 0, 100) == data[:100]  # within the pin, though too short to keep
    assert _read(local, st, 0, 100) == data[:100] and storage.located == 2


def test_a_corrupt_block_falls_back_to_the_network_and_is_located_afresh(tmp_path: Path) -> None:
    data = os.urandom(2 * BLOCK)
    good = [crc32c(data[:BLOCK]), crc32c(data[BLOCK:])]
    storage = OneChunkStorage(tmp_path / "slot", data, crcs=[good[0], good[1] ^ 1])
    local, st = LocalReads(storage), _state(len(data))  # type: ignore[arg-type]
    assert _read(local, st, 0, 100) == data[:100]  # block 0 is intact
    assert _read(local, st, BLOCK + 1, 100) is None  # the caller reads it over the network
    storage.crcs = good  # repaired
    assert _read(local, st, BLOCK + 1, 100) == data[BLOCK + 1 : BLOCK + 101] and storage.located == 2
    assert local.enabled


def test_files_this_process_may_not_open_turn_short_circuit_reads_off(tmp_path: Path, monkeypatch) -> None:
    storage = OneChunkStorage(tmp_path / "slot", os.urandom(BLOCK))
    local, st = LocalReads(storage), _state(BLOCK)  # type: ignore[arg-type]
    real_open = os.open

    def refuse(path, *args, **kw):  # as for a user the target directory is closed to (root opens anything)
        if str(path) == str(storage.path):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", refuse)
    assert _read(local, st, 0, 100) is None and not local.enabled
    assert _read(local, st, 0, 100) is None and storage.located == 1  # not asked again


@NEEDS_FUSE
def test_small_reads_on_the_mount_see_every_write_while_coming_from_local_replicas(kvfs_cluster, tmp_path) -> None:
    """Reads through a second mount (so no cache of the writer's helps) of a file larger than a chunk: right
    bytes from the local replicas, then this mount's overwrite and another client's (seen at the next open)."""
    other = kvfs_cluster.mount
    name = f"sc-{os.getpid()}-{time.monotonic_ns()}"
    data = bytearray(os.urandom(5 << 20))  # more than one 4 MiB chunk
    (other / name).write_bytes(data)
    log = tmp_path / "mount.log"

    def read(path: Path, offset: int, n: int = 4096) -> bytes:
        fd = os.open(path, os.O_RDONLY)  # a new open: the mount keeps no page cache across opens
        try:
            return os.pread(fd, n, offset)
        finally:
            os.close(fd)

    with second_mount(kvfs_cluster, tmp_path / "m", "--log-level", "INFO", log=log) as m:
        offsets = [0, 4096 * 3, (4 << 20) - 2048, (4 << 20) + 12345, len(data) - 4096]
        for offset in offsets:
            assert read(m / name, offset) == data[offset : offset + 4096]
        fd = os.open(m / name, os.O_WRONLY)  # this mount overwrites bytes it has just read
        try:
            os.pwrite(fd, b"x" * 100, offsets[1] + 10)
        finally:
            os.close(fd)
        data[offsets[1] + 10 : offsets[1] + 110] = b"x" * 100
        assert read(m / name, offsets[1]) == data[offsets[1] : offsets[1] + 4096]
        with open(other / name, "r+b") as f:  # another client's write, closed before the next open here
            f.seek(offsets[3])
            f.write(b"y" * 300)
        data[offsets[3] : offsets[3] + 300] = b"y" * 300
        for offset in offsets:
            assert read(m / name, offset) == data[offset : offset + 4096]
    assert "short-circuit reads: small reads of chunks with a replica on this host" in log.read_text()
    (other / name).unlink()
