"""Behaviour of the chunk engine of one storage target (chunkserver/engine.py)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import tempfile
import sqlite3
import threading
import time
from pathlib import Path

import prometheus_client
import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfs.chunkserver import engine as engine_mod
from kvfs.chunkserver import rows as rows_mod
from kvfs.chunkserver import slots as slots_mod
from kvfs.chunkserver.engine import BLOCK, ChunkEngine, ChunkId, StaleVersion, fold_crc
from kvfs.config import ChunkServerSection
from kvfs.errors import ChecksumMismatch, KvfsError
from kvfs.pool import BufferPool, page_aligned
from page_cache import resident
from tmpfs import tmpfs

CS = 1 << 20
C = ChunkId(7, 0)


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def eng(tmp_path: Path, request: pytest.FixtureRequest):
    """An engine with direct I/O (the default) and one without: loans are direct reads in one, mappings in the
    other."""
    with ChunkEngine(tmp_path / "t", fsync=False, direct_io=request.param) as e:
        yield e


def put(e: ChunkEngine, cid: ChunkId, version: int, offset: int, data: bytes, **kw) -> None:
    e.write_pending(cid, version, offset, data, crc32c(data), chunk_size=CS, **kw)
    e.commit(cid, version)


def content(e: ChunkEngine, cid: ChunkId, **kw) -> bytes:
    return bytes(e.read(cid, 0, CS, **kw)[0])


def test_round_trip_partial_reads_and_readinto(eng: ChunkEngine) -> None:
    data = os.urandom(3 * BLOCK + 123)
    put(eng, C, 1, 0, data, full_replace=True)
    m = eng.meta(C)
    assert (m.version, m.length, m.crc, m.pending_version) == (1, len(data), crc32c(data), None)
    for off, n in [(0, len(data)), (5, 10), (BLOCK - 3, 7), (BLOCK, BLOCK), (len(data) - 5, 100), (len(data), 9)]:
        buf = bytearray(n)
        count, _ = eng.read(C, off, n, into=memoryview(buf))
        assert bytes(buf[:count]) == data[off : off + n]
        assert bytes(eng.read(C, off, n)[0]) == data[off : off + n]


def test_copy_on_write_pending_invisible_until_commit(eng: ChunkEngine) -> None:
    put(eng, C, 1, 0, b"a" * 200_000)
    m = eng.write_pending(C, 2, 100_000, b"b" * 150_000, crc32c(b"b" * 150_000), chunk_size=CS)
    new = b"a" * 100_000 + b"b" * 150_000
    assert (m.version, m.length, m.crc, m.committed_version, m.pending_version) == (2, 250_000, crc32c(new), 1, 2)
    assert content(eng, C) == b"a" * 200_000
    assert content(eng, C, version=2) == new
    assert eng.meta(C).pending_version == 2
    eng.commit(C, 2)
    assert content(eng, C) == new
    assert eng.meta(C).version == 2 and eng.meta(C).pending_version is None
    eng.write_pending(C, 3, 0, b"c", crc32c(b"c"), chunk_size=CS)
    eng.abort(C, 3)
    assert content(eng, C) == new and eng.meta(C).pending_version is None


def test_write_past_end_zero_fills_and_stale_version_refused(eng: ChunkEngine) -> None:
    put(eng, C, 1, 0, b"x" * 10)
    put(eng, C, 2, 2 * BLOCK + 5, b"y")
    assert content(eng, C) == b"x" * 10 + bytes(2 * BLOCK - 5) + b"y"
    with pytest.raises(StaleVersion):
        eng.write_pending(C, 2, 0, b"z", crc32c(b"z"), chunk_size=CS)
    with pytest.raises(KvfsError) as ei:
        eng.write_pending(C, 3, CS - 1, b"zz", crc32c(b"zz"), chunk_size=CS)
    assert ei.value.errno == errno.EINVAL


def test_retransmit_is_idempotent(eng: ChunkEngine) -> None:
    d = os.urandom(5000)
    m1 = eng.write_pending(C, 1, 0, d, crc32c(d), chunk_size=CS)
    used = eng.space()[1]
    assert eng.write_pending(C, 1, 0, d, crc32c(d), chunk_size=CS) == m1
    assert eng.space()[1] == used
    eng.commit(C, 1)
    assert eng.commit(C, 1).version == 1
    assert eng.write_pending(C, 1, 0, d, crc32c(d), chunk_size=CS).version == 1
    assert content(eng, C) == d


def test_crc_mismatch_refused_and_old_data_kept(eng: ChunkEngine) -> None:
    put(eng, C, 1, 0, b"old")
    with pytest.raises(ChecksumMismatch) as ei:
        eng.write_pending(C, 2, 0, b"new", crc32c(b"new") ^ 1, chunk_size=CS)
    assert ei.value.errno == errno.EBADMSG
    assert content(eng, C) == b"old" and eng.meta(C).pending_version is None


def test_enospc_leaves_old_data(tmp_path: Path) -> None:
    with ChunkEngine(tmp_path, fsync=False, capacity_bytes=3 * BLOCK) as e:
        put(e, C, 1, 0, b"1" * BLOCK)
        put(e, ChunkId(7, 1), 1, 0, b"2" * BLOCK)
        with pytest.raises(KvfsError) as ei:
            e.write_pending(C, 2, 0, b"3" * 2 * BLOCK, crc32c(b"3" * 2 * BLOCK), chunk_size=CS)
        assert ei.value.errno == errno.ENOSPC
        assert content(e, C) == b"1" * BLOCK and e.meta(C).pending_version is None
        put(e, C, 2, 0, b"4")  # one 64 KiB slot is still free for the copy-on-write
        assert content(e, C) == b"4" + b"1" * (BLOCK - 1)
        assert e.space() == (3 * BLOCK, 2 * BLOCK, BLOCK)


def corrupt_third_block(e: ChunkEngine) -> bytes:
    """Commit four blocks of random data as C v1, then flip a byte of the third on disk; returns the data."""
    data = os.urandom(4 * BLOCK)
    put(e, C, 1, 0, data)
    path, off, _, _ = e.local_location(C)
    with open(path, "r+b") as f:
        f.seek(off + 2 * BLOCK + 17)
        f.write(bytes([data[2 * BLOCK + 17] ^ 0xFF]))
    return data


def test_corruption_detected_then_repaired(eng: ChunkEngine) -> None:
    data = corrupt_third_block(eng)
    assert bytes(eng.read(C, 0, BLOCK)[0]) == data[:BLOCK]  # untouched blocks stay readable
    with pytest.raises(ChecksumMismatch):
        eng.read(C, 2 * BLOCK + 100, 10)
    with pytest.raises(ChecksumMismatch):  # a partial overwrite must not launder the bad block
        eng.write_pending(C, 2, 2 * BLOCK, b"z", crc32c(b"z"), chunk_size=CS)
    eng.replace_full(C, 1, data, crc32c(data))  # repair keeps the version
    assert content(eng, C) == data and eng.meta(C).version == 1
    assert eng.space()[1] == 4 * BLOCK  # the corrupt copy's slot was freed


def test_list_remove_truncate(eng: ChunkEngine) -> None:
    for i in range(3):
        put(eng, ChunkId(1, i), 1, 0, b"a" * (i + 1))
    put(eng, ChunkId(2, 0), 1, 0, b"b")
    assert [(m.chunk_id, m.length) for m in eng.list_chunks(1)] == [(ChunkId(1, i), i + 1) for i in range(3)]
    assert len(list(eng.list_chunks())) == 4
    assert eng.remove_from(1, 2) == [ChunkId(1, 2)] and eng.remove_from(1, 2) == []
    assert eng.meta(ChunkId(1, 2)) is None and eng.local_location(ChunkId(1, 2)) is None
    with pytest.raises(KvfsError) as ei:
        eng.read(ChunkId(1, 2), 0, 1)
    assert ei.value.errno == errno.ENOENT
    assert eng.remove_files([1, 7]) == [ChunkId(1, 0), ChunkId(1, 1)] and list(eng.list_chunks(1)) == []
    put(eng, C, 1, 0, os.urandom(3 * BLOCK))
    before = content(eng, C)
    m = eng.truncate(C, BLOCK + 10, 2)
    assert content(eng, C) == before[: BLOCK + 10] and m.crc == crc32c(before[: BLOCK + 10])
    eng.truncate(C, 2 * BLOCK, 3)
    assert content(eng, C) == before[: BLOCK + 10] + bytes(BLOCK - 10)
    assert eng.space()[1] == 2 * BLOCK + BLOCK  # C now in a 128 KiB slot, ChunkId(2, 0) in 64 KiB


def test_reopen_keeps_committed_and_pending(tmp_path: Path) -> None:
    with ChunkEngine(tmp_path) as e:
        put(e, C, 1, 0, b"committed")
        e.write_pending(C, 2, 0, b"PENDING", crc32c(b"PENDING"), chunk_size=CS)
        with pytest.raises(KvfsError) as ei:
            ChunkEngine(tmp_path)
        assert ei.value.errno == errno.EBUSY
        used = e.space()[1]
    with ChunkEngine(tmp_path) as e:
        assert content(e, C) == b"committed"
        assert e.meta(C).pending_version == 2 and content(e, C, version=2) == b"PENDINGed"
        assert e.space()[1] == used
        e.commit(C, 2)
        assert content(e, C) == b"PENDINGed"


def test_removed_tail_stays_removed_after_reopen(tmp_path: Path) -> None:
    """remove_from deletes the rows and frees the slots of every chunk it drops, beyond batch boundaries."""
    count = rows_mod.SQL_BATCH + 3
    with ChunkEngine(tmp_path) as e:
        for i in range(count):
            put(e, ChunkId(4, i), 1, 0, b"x")
        used_one = e.space()[1] // count
        assert e.remove_from(4, 1) == [ChunkId(4, i) for i in range(1, count)]
        used = e.space()[1]
        assert used == used_one
    with ChunkEngine(tmp_path) as e:
        assert [m.chunk_id.index for m in e.list_chunks(4)] == [0] and e.space()[1] == used


def test_the_row_store_checkpoints_from_a_thread_of_its_own(tmp_path: Path) -> None:
    """Its commits run under the engine's row lock, so none may checkpoint (SQLite's autocheckpoint would: an
    fsync of the WAL and of the file, with every writer waiting): the store's own thread copies the WAL into
    chunks.sqlite while it runs, and stops with close."""
    threads = set(threading.enumerate())
    store = rows_mod.RowStore(tmp_path, fsync=True)
    db = tmp_path / rows_mod.DB_NAME
    before = db.stat().st_size
    for i in range(1200):  # ~5 MiB of rows, over the thread's 1,000-page threshold
        store.execute(rows_mod.put_pending((7, i), 1, 0, 0, os.urandom(4096), 0, i, b"", b""), durable=False)
    deadline = time.monotonic() + 30
    while db.stat().st_size < before + (2 << 20):
        assert time.monotonic() < deadline, "nothing was checkpointed into chunks.sqlite"
        time.sleep(0.05)
    store.close()
    assert set(threading.enumerate()) == threads


def test_lazy_commit_keeps_the_replaced_slot_until_a_durable_transaction(tmp_path: Path) -> None:
    """A commit without an fsync may be undone by a power loss, and then its chunk's old committed row names the
    old slot again: that slot is not written until a durable transaction has made the commit durable too."""
    d, f = ChunkId(8, 0), ChunkId(9, 0)
    with ChunkEngine(tmp_path / "t") as e:
        put(e, C, 1, 0, b"a" * 100)
        first = e.local_location(C)[1]
        e.write_pending(C, 2, 0, b"b" * 100, crc32c(b"b" * 100), chunk_size=CS)
        e.commit(C, 2, durable=False)
        assert content(e, C) == b"b" * 100
        put(e, d, 1, 0, b"c" * 100)  # its data goes to a slot before its own (durable) transaction runs
        assert e.local_location(d)[1] != first
        put(e, f, 1, 0, b"d" * 100)  # that transaction made the commit durable: the slot is free again
        assert e.local_location(f)[1] == first
    with ChunkEngine(tmp_path / "t") as e:
        assert [content(e, x) for x in (C, d, f)] == [b"b" * 100, b"c" * 100, b"d" * 100]


@pytest.mark.parametrize("together", [False, True])
def test_pinned_location_keeps_its_slot_until_released(tmp_path: Path, together: bool) -> None:
    """A short-circuit reader reads the slot file while the server holds the pin: a newer version's commit must not
    let another chunk reuse the slot before ``release()`` (or, ``together``, ``release_pins`` of every pin of the
    version); afterwards it may."""
    d = ChunkId(8, 0)
    data = os.urandom(3 * BLOCK + 5)
    with ChunkEngine(tmp_path / "t", fsync=False) as e:
        put(e, C, 1, 0, data)
        loc = e.pin_location(C, 1, BLOCK + 3, BLOCK)
        again = e.pin_location(C, 1, 0, 10) if together else None
        assert (loc.version, loc.length, loc.first_block) == (1, len(data), 1)
        assert loc.block_crcs == [crc32c(data[BLOCK : 2 * BLOCK]), crc32c(data[2 * BLOCK : 3 * BLOCK])]
        put(e, C, 2, 0, b"x" * 100, full_replace=True)  # replaces v1: its slot is retired, but pinned
        put(e, d, 1, 0, os.urandom(len(data)))
        assert e.local_location(d)[1] != loc.offset
        with open(loc.path, "rb") as f:
            assert os.pread(f.fileno(), len(data), loc.offset) == data
        if again is not None:
            e.release_pins([loc.pin])
            put(e, ChunkId(10, 0), 1, 0, os.urandom(len(data)))  # the other pin still holds the slot
            assert e.local_location(ChunkId(10, 0))[1] != loc.offset
            e.release_pins([again.pin])
        else:
            loc.release()
        put(e, ChunkId(9, 0), 1, 0, b"y" * len(data))
        assert e.local_location(ChunkId(9, 0))[1] == loc.offset
        with pytest.raises(KvfsError) as err:
            e.pin_location(C, 1, 0, 10)
        assert err.value.errno == errno.ENOENT


def unsynced(root: Path) -> list[tuple[int, int, int]]:
    """(inode, index, version) of the versions a power loss could still tear, read as another process would."""
    db = sqlite3.connect(root / "chunks.sqlite")
    try:
        return db.execute("SELECT inode, idx, version FROM unsynced ORDER BY seq").fetchall()
    finally:
        db.close()


def test_write_back_keeps_the_synced_version_until_the_next_sync(tmp_path: Path) -> None:
    """Write-back acknowledges from the page cache: each version staged since the last sync is listed for a check
    after a crash, and the last synced committed version keeps its slot as the fallback; a sync ends both."""
    root = tmp_path / "t"
    with ChunkEngine(root, write_through=False) as e:
        put(e, C, 1, 0, b"a" * 100)
        e.flush()
        assert unsynced(root) == [] and e.space()[1] == 1 << 16
        put(e, C, 2, 0, b"b" * 100)
        put(e, C, 3, 0, b"c" * 100)
        assert unsynced(root) == [(C.inode, C.index, 2), (C.inode, C.index, 3)]
        assert e.space()[1] == 2 << 16  # v1 (the fallback) and v3: v2, never synced, gave its slot back at once
        e.flush()
        assert unsynced(root) == [] and e.space()[1] == 1 << 16 and content(e, C) == b"c" * 100
        put(e, C, 4, 0, b"d" * 100)
    assert unsynced(root) == []  # close syncs
    with ChunkEngine(root, write_through=False) as e:
        assert content(e, C) == b"d" * 100 and e.space()[1] == 1 << 16


def test_write_back_falls_back_to_the_synced_version_when_a_crash_tore_a_newer_one(tmp_path: Path) -> None:
    root = tmp_path / "t"
    e = ChunkEngine(root, write_through=False)
    put(e, C, 1, 0, b"a" * 100)
    put(e, ChunkId(8, 0), 1, 0, b"x" * 100)
    e.flush()
    put(e, C, 2, 0, b"b" * 100)
    e.write_pending(C, 3, 0, b"c" * 100, crc32c(b"c" * 100), chunk_size=CS)
    path, offset, _, _ = e.local_location(C)
    e._close_files()  # a crash: nothing synced
    with open(path, "r+b") as f:  # a power loss kept v2's row but not its data
        f.seek(offset)
        f.write(b"\0")
    with ChunkEngine(root, write_through=False) as e:
        assert e.meta(C).version == 1 and e.meta(C).pending_version is None and content(e, C) == b"a" * 100
        assert content(e, ChunkId(8, 0)) == b"x" * 100 and e.space()[1] == 2 << 16
        assert unsynced(root) == []


def test_write_back_reuses_an_unsynced_version_s_slot_at_once_and_a_power_loss_undoing_that_falls_back(
        tmp_path: Path) -> None:
    """A commit drops the committed version it replaces; when no sync covered that one, its slot is written again
    before the commit is durable. A power loss that undoes the commit brings the row back over someone else's
    bytes: recovery finds it torn and falls back to the synced version, as for any version a sync never covered."""
    root, d = tmp_path / "t", ChunkId(8, 0)
    e = ChunkEngine(root, write_through=False)
    put(e, C, 1, 0, b"a" * 100)
    e.flush()
    put(e, C, 2, 0, b"b" * 100)
    slot_of_v2 = e.local_location(C)[1]
    db_files = {p.name: p.read_bytes() for p in root.glob("chunks.sqlite*")}  # what a power loss could leave
    put(e, C, 3, 0, b"c" * 100)  # drops v2 without an fsync
    put(e, d, 1, 0, b"x" * 100)
    assert e.local_location(d)[1] == slot_of_v2  # no WAL fsync first
    e._close_files()  # the power loss: the slot files keep what was written, SQLite loses the lazy transactions
    for p in root.glob("chunks.sqlite*"):
        p.unlink()
    for name, data in db_files.items():
        (root / name).write_bytes(data)
    with ChunkEngine(root, write_through=False) as e:
        assert e.meta(C).version == 1 and content(e, C) == b"a" * 100 and e.meta(d) is None
        assert unsynced(root) == []


def test_write_back_frees_an_aborted_unsynced_version_s_slot_at_once_and_keeps_the_synced_fallback_s(
        tmp_path: Path) -> None:
    with ChunkEngine(tmp_path / "t", write_through=False) as e:
        put(e, C, 1, 0, b"a" * 100)
        e.flush()
        e.write_pending(C, 2, 0, b"b" * 100, crc32c(b"b" * 100), chunk_size=CS)
        assert e.space()[1] == 2 << 16
        e.abort(C, 2)  # v2 was never synced: its slot is free before any durable transaction
        assert e.space()[1] == 1 << 16
        put(e, C, 3, 0, b"c" * 100)  # keeps synced v1 as the fallback
        put(e, C, 4, 0, b"d" * 100)  # drops v3 (unsynced, freed at once)
        assert e.space()[1] == 2 << 16
        e.remove_files([C.inode])  # v4 goes at once; v1, which a sync covered, waits for a durable transaction
        assert e.space()[1] == 1 << 16
        e.flush()
        assert e.space()[1] == 0


def test_write_back_sync_frees_space_instead_of_failing(tmp_path: Path) -> None:
    """Superseded versions and not yet durable frees hold slots until a sync: a full target syncs, not ENOSPC."""
    with ChunkEngine(tmp_path / "t", write_through=False, capacity_bytes=3 << 16) as e:
        for v in range(1, 20):
            put(e, C, v, 0, bytes([v]) * 100)
        assert content(e, C) == bytes([19]) * 100


def held(fate: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value("kvfs_chunk_held_bytes_total", {"fate": fate}) or 0.0


def test_held_writes_reach_the_disk_once_and_superseded_ones_never(tmp_path: Path) -> None:
    """With write-back, whole-version writes wait in memory for a sync: a chunk rewritten meanwhile reaches the
    disk once, as its newest version. Reads and loans are served from the held bytes; syncs, partial writes and
    a pinned location (without nowait) write a held version out first."""
    chunk = 4 * BLOCK
    written, dropped = held("written"), held("dropped")
    root = tmp_path / "t"
    with ChunkEngine(root, write_through=False, hold_bytes=8 * chunk) as e:
        for v in range(1, 6):
            put(e, C, v, 0, bytes([v]) * chunk)
        assert (held("written") - written, held("dropped") - dropped) == (0, 4 * chunk)
        assert e.read(C, 0, CS, nowait=True)[0] == bytes([5]) * chunk  # from memory, even for an event loop
        lent = e.lend(C, 3, chunk, 5)
        assert bytes(lent.data) == bytes([5]) * (chunk - 3)
        lent.release()
        with pytest.raises(BlockingIOError):  # a locate names a slot, whose bytes are not there yet
            e.pin_location(C, 5, 0, chunk, nowait=True)
        assert held("written") - written == 0 and not e._pins
        e.pin_location(C, 5, 0, chunk).release()  # without nowait, it writes the version out
        assert content(e, C) == bytes([5]) * chunk and held("written") - written == chunk
        put(e, C, 6, 0, bytes([6]) * chunk)
        e.flush()
        assert held("written") - written == 2 * chunk and unsynced(root) == []
        put(e, ChunkId(8, 0), 1, 0, bytes(chunk))
        put(e, ChunkId(8, 0), 2, 0, b"partial")  # a partial write reads the held version it changes
        assert content(e, ChunkId(8, 0)) == b"partial" + bytes(chunk - 7)
    with ChunkEngine(root, write_through=False) as e:  # close wrote out what was held
        assert content(e, C) == bytes([6]) * chunk
        assert content(e, ChunkId(8, 0)) == b"partial" + bytes(chunk - 7)


def test_a_crash_loses_held_writes_back_to_the_synced_version(tmp_path: Path) -> None:
    """A kill -9 takes held versions with it, as a power loss takes unflushed ones: the engine finds them torn
    and falls back to the synced version (the chain then resyncs the replica from its peers)."""
    root = tmp_path / "t"
    chunk = 2 * BLOCK
    e = ChunkEngine(root, write_through=False, hold_bytes=4 * chunk)
    put(e, C, 1, 0, b"a" * chunk)
    e.flush()
    put(e, C, 2, 0, b"b" * chunk)
    put(e, C, 3, 0, b"c" * chunk)
    put(e, ChunkId(8, 0), 1, 0, b"x" * chunk)  # a new chunk, never synced
    e._close_files()  # the process dies: nothing held reaches the disk
    with ChunkEngine(root, write_through=False) as e:
        assert e.meta(C).version == 1 and content(e, C) == b"a" * chunk
        assert e.meta(ChunkId(8, 0)) is None and e.space()[1] == 1 << 17


def test_held_writes_stay_within_hold_bytes_and_changeable_buffers_are_not_held(tmp_path: Path) -> None:
    """Past half of hold_bytes the write-behind thread writes out the oldest versions, past all of it the writer
    does; either way what is held never exceeds the limit and every version reads back."""
    chunk = 2 * BLOCK
    written = held("written")
    with ChunkEngine(tmp_path / "t", write_through=False, hold_bytes=4 * chunk) as e:
        for i in range(9):
            put(e, ChunkId(9, i), 1, 0, bytes([i + 1]) * chunk)
            assert e._held.bytes <= 4 * chunk
        deadline = time.monotonic() + 10
        while (e._held.bytes > 2 * chunk or held("written") - written < 7 * chunk) and time.monotonic() < deadline:
            # the thread catches up (its last write-out is counted once it has landed)
            time.sleep(0.01)
        assert e._held.bytes == 2 * chunk
        assert held("written") - written == 7 * chunk and len(list(e._held.slots())) == 2
        put(e, ChunkId(9, 9), 1, 0, bytearray(chunk))  # its owner could change it after the call: written now
        assert e._held.bytes == 2 * chunk and held("written") - written == 7 * chunk  # and not held at all
        assert [content(e, ChunkId(9, i)) for i in range(9)] == [bytes([i + 1]) * chunk for i in range(9)]


def test_hold_bytes_defaults_to_a_share_of_memory_and_only_applies_to_write_back() -> None:
    assert 0 < ChunkServerSection().resolved_hold_bytes() <= 384 << 20
    assert ChunkServerSection(hold_bytes=1 << 20).resolved_hold_bytes() == 1 << 20
    assert ChunkServerSection(write_through=True).resolved_hold_bytes() == 0
    assert ChunkServerSection(fsync=False, hold_bytes=1 << 20).resolved_hold_bytes() == 0
    with pytest.raises(KvfsError, match="hold_bytes"):
        ChunkServerSection(hold_bytes=-1).resolved_hold_bytes()


def test_reader_pins_slot_against_reuse(eng: ChunkEngine) -> None:
    """A read racing with commits must never see a freed slot reused by a newer version."""
    put(eng, C, 1, 0, bytes([1]) * 8 * BLOCK)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                data = bytes(eng.read(C, 0, CS)[0])
                assert data == bytes([data[0]]) * len(data)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    for v in range(2, 60):
        put(eng, C, v, 0, bytes([v]) * 8 * BLOCK, full_replace=True)
    stop.set()
    t.join()
    assert not errors


def test_lend_serves_the_version_without_a_copy_and_holds_its_slot(eng: ChunkEngine) -> None:
    data = os.urandom(5 * BLOCK + 77)
    put(eng, C, 1, 0, data, full_replace=True)
    for off, n in [(0, len(data)), (BLOCK + 3, 2 * BLOCK), (len(data) - 5, 100), (len(data), 9),
                   (len(data) + 3 * BLOCK, 10)]:
        lent = eng.lend(C, off, n, 1)
        assert bytes(lent.data) == data[off : off + n]
        lent.release()
    lent = eng.lend(C, 0, len(data), 1)
    for v in range(2, 6):  # newer versions come and go; none may reuse the lent slot
        put(eng, C, v, 0, bytes([v]) * len(data), full_replace=True)
    assert bytes(lent.data) == data
    lent.release()
    assert eng.space()[1] == 8 * BLOCK  # released: only the newest version's slot (512 KiB) is in use
    with pytest.raises(KvfsError) as err:
        eng.lend(C, 0, 10, 1)
    assert err.value.errno == errno.ENOENT


def test_lend_checks_the_blocks_it_lends(eng: ChunkEngine) -> None:
    data = corrupt_third_block(eng)
    lent = eng.lend(C, 0, 2 * BLOCK, 1)  # the blocks before the bad one are fine
    assert bytes(lent.data) == data[: 2 * BLOCK]
    lent.release()
    with pytest.raises(ChecksumMismatch):
        eng.lend(C, BLOCK, 2 * BLOCK, 1)
    eng.replace_full(C, 1, data, crc32c(data))  # the failed loan left no pin behind: the bad slot is freed
    assert eng.space()[1] == 4 * BLOCK


def test_lend_covers_slots_added_after_the_first_mapping(eng: ChunkEngine) -> None:
    chunks = [ChunkId(9, i) for i in range(40)]
    first = os.urandom(BLOCK)
    put(eng, chunks[0], 1, 0, first)
    held = eng.lend(chunks[0], 0, BLOCK, 1)  # maps the slot file as it is now
    for cid in chunks[1:]:
        put(eng, cid, 1, 0, bytes([cid.index]) * BLOCK)
    for cid in chunks[1:]:
        lent = eng.lend(cid, 0, BLOCK, 1)
        assert bytes(lent.data) == bytes([cid.index]) * BLOCK
        lent.release()
    assert bytes(held.data) == first  # the old mapping lives on while it is viewed
    held.release()


def test_nowait_reads_only_from_the_page_cache(tmp_path: Path) -> None:
    with ChunkEngine(tmp_path / "t", fsync=True) as e:  # fsync: written pages are clean, so they can be dropped
        data = os.urandom(4 * BLOCK)
        put(e, C, 1, 0, data)
        assert content(e, C, nowait=True) == data  # just written: cached
        for _ in range(100):  # the journal may hold freshly flushed pages a moment longer on a busy machine
            for slot_file in (tmp_path / "t" / "data").glob("*.dat"):
                fd = os.open(slot_file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            if _uncached(e, C, BLOCK, 10):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the page cache kept the chunk's pages after every POSIX_FADV_DONTNEED")
        assert bytes(e.read(C, BLOCK, 10)[0]) == data[BLOCK : BLOCK + 10]  # waits for the disk
        assert bytes(e.read(C, BLOCK, 10, nowait=True)[0]) == data[BLOCK : BLOCK + 10]  # and now it is cached


@given(st.binary(max_size=3 * BLOCK + 7), st.binary(max_size=BLOCK + 3))
@settings(max_examples=50, deadline=None)
def test_fold_crc_equals_whole_crc(a: bytes, b: bytes) -> None:
    data = a + b
    blocks = [crc32c(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)]
    assert fold_crc(blocks, len(data)) == crc32c(data)


@given(st.lists(st.tuples(st.sampled_from(["write", "full", "trunc", "abort"]),
                          st.integers(0, 4 * BLOCK), st.integers(0, 2 * BLOCK + 5)), max_size=12))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_matches_bytearray_model(tmp_path: Path, ops: list[tuple[str, int, int]]) -> None:
    """Random writes, replaces, truncates and aborts behave like edits of a bytearray."""
    root = tmp_path / os.urandom(4).hex()
    model = bytearray()
    with ChunkEngine(root, fsync=False) as e:
        for version, (op, off, n) in enumerate(ops, start=1):
            data = bytes([version]) * n
            if op == "trunc":
                e.truncate(C, off, version)
                model = model[:off] + bytes(max(0, off - len(model)))
                continue
            m = e.write_pending(C, version, 0 if op == "full" else off, data, crc32c(data),
                                full_replace=op == "full", chunk_size=CS)
            if op == "abort":
                e.abort(C, version)
                continue
            e.commit(C, version)
            if op == "full":
                model = bytearray(data)
            else:
                model.extend(bytes(max(0, off + n - len(model))))
                model[off : off + n] = data
            assert m.crc == crc32c(model) and m.length == len(model)
        if ops and e.meta(C) is not None:
            assert content(e, C) == bytes(model)
            lent = e.lend(C, BLOCK // 2, 3 * BLOCK, e.meta(C).version)  # spans partial blocks at both ends
            assert bytes(lent.data) == bytes(model[BLOCK // 2 : BLOCK // 2 + 3 * BLOCK])
            lent.release()


def scattered(n: int, seed: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    """Sorted, apart ``(offset, length)`` runs inside the first ``n`` bytes (some tiny, some spanning blocks)."""
    cuts = st.lists(st.integers(0, n), min_size=2, max_size=2 * seed, unique=True).map(sorted)
    return cuts.map(lambda c: [(c[k], c[k + 1] - c[k]) for k in range(0, len(c) - 1, 2)])


@given(st.lists(st.tuples(st.booleans(), scattered(4 * BLOCK + 9, 8)), min_size=1, max_size=8))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_write_of_several_runs_is_one_version_that_matches_the_model(
        tmp_path: Path, writes: list[tuple[bool, list[tuple[int, int]]]]) -> None:
    """Gathered scattered writes (runs) become one version each: the old bytes between them stay, every block's
    CRC is right, a retransmit is recognised, and the version's CRC is the model's."""
    root = tmp_path / os.urandom(4).hex()
    model = bytearray()
    with ChunkEngine(root, fsync=False) as e:
        for version, (aborted, runs) in enumerate(writes, start=1):
            data = b"".join(os.urandom(n) for _, n in runs)
            m = e.write_pending(C, version, runs[0][0], data, crc32c(data), chunk_size=CS, extents=runs)
            again = e.write_pending(C, version, runs[0][0], data, crc32c(data), chunk_size=CS, extents=runs)
            assert again == m
            if aborted:
                e.abort(C, version)
                continue
            e.commit(C, version)
            at = 0
            for offset, n in runs:
                model.extend(bytes(max(0, offset + n - len(model))))
                model[offset:offset + n] = data[at:at + n]
                at += n
            assert m.crc == crc32c(model) and m.length == len(model)
        if e.meta(C) is not None:
            assert content(e, C) == bytes(model)  # reads check every block's CRC


@pytest.mark.parametrize("runs", [[(0, 10), (5, 10)], [(20, 5), (0, 5)], [(0, 5), (10, 5)], [(CS - 2, 4)], []],
                         ids=["overlapping", "out-of-order", "short-of-data", "past-the-chunk", "none"])
def test_runs_that_do_not_fit_are_refused_and_change_nothing(eng: ChunkEngine, runs: list[tuple[int, int]]) -> None:
    put(eng, C, 1, 0, b"old" * 100)
    data = bytes(sum(n for _, n in runs) + (1 if runs == [(0, 5), (10, 5)] else 0))
    with pytest.raises(KvfsError) as info:
        eng.write_pending(C, 2, runs[0][0] if runs else 0, data, crc32c(data), chunk_size=CS, extents=runs)
    assert info.value.errno == errno.EINVAL
    assert content(eng, C) == b"old" * 100 and eng.meta(C).pending_version is None


def test_full_disk_and_oversized_chunk_refused(eng: ChunkEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    put(eng, C, 1, 0, b"old")

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    used = eng.space()[1]
    with pytest.raises(KvfsError) as ei:  # needs a fresh 128 KiB slot, so the file must grow
        eng.write_pending(C, 2, 0, b"n" * 2 * BLOCK, crc32c(b"n" * 2 * BLOCK), chunk_size=CS)
    assert ei.value.errno == errno.ENOSPC
    assert content(eng, C) == b"old" and eng.space()[1] == used
    with pytest.raises(KvfsError) as ei:
        eng.write_pending(C, 2, 64 << 20, b"x", crc32c(b"x"), chunk_size=128 << 20)
    assert ei.value.errno == errno.EINVAL


def test_slot_files_grow_in_steps_and_a_full_disk_still_gets_one_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fallocate holds the engine's lock while it waits for the journal: a file grows by as many slots as it
    has (up to 64 MiB) at once, and the slots of a step it does not use yet are free, also after a reopen."""
    calls: list[int] = []
    real = os.posix_fallocate

    def counting(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", counting)
    with ChunkEngine(tmp_path, fsync=False) as e:
        for i in range(100):
            put(e, ChunkId(9, i), 1, 0, b"%d" % i * 1000 + bytes(CS - 1000 * len(b"%d" % i)))
        assert [n // CS for n in calls] == [1, 1, 2, 4, 8, 16, 32, 64]  # 128 slots for 100 chunks, 8 calls
        assert e.space()[1] == 100 * CS
    calls.clear()
    with ChunkEngine(tmp_path, fsync=False) as e:
        for i in range(100, 128):  # the step's spare slots, found free again after the reopen
            put(e, ChunkId(9, i), 1, 0, bytes(CS))
        assert calls == [] and content(e, ChunkId(9, 42)) == b"42" * 1000 + bytes(CS - 2000)

        def room_for_one_slot(fd: int, offset: int, length: int) -> None:
            if length > CS:
                raise OSError(errno.ENOSPC, "No space left on device")
            counting(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", room_for_one_slot)
        put(e, ChunkId(9, 128), 1, 0, b"last" + bytes(CS - 4))  # the next step, 64 slots, does not fit
        assert calls == [CS] and content(e, ChunkId(9, 128))[:4] == b"last"


def test_concurrent_writers_on_distinct_chunks(eng: ChunkEngine) -> None:
    def worker(i: int) -> None:
        for v in range(1, 20):
            put(eng, ChunkId(9, i), v, (v * 4099) % (3 * BLOCK), bytes([v]) * 5000)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expect = bytearray()
    for v in range(1, 20):
        off = (v * 4099) % (3 * BLOCK)
        expect.extend(bytes(max(0, off + 5000 - len(expect))))
        expect[off : off + 5000] = bytes([v]) * 5000
    for i in range(4):
        assert content(eng, ChunkId(9, i)) == expect and eng.meta(ChunkId(9, i)).crc == crc32c(expect)


def _aligned(data: bytes) -> memoryview:
    """``data`` in page-aligned memory, as a chunk server receives it (kvfs.pool.page_aligned)."""
    buf = page_aligned(len(data))
    buf[:] = data
    return memoryview(buf)


def _resident(e: ChunkEngine, cid: ChunkId, offset: int, n: int) -> list[bool]:
    """Whether each page of the chunk's bytes ``[offset, offset + n)`` is in the page cache."""
    path, base, _, _ = e.local_location(cid)
    return resident(path, base + offset, n)


def _cached(e: ChunkEngine, cid: ChunkId, offset: int, n: int) -> bool:
    """Every page of the bytes is in the page cache."""
    return all(_resident(e, cid, offset, n))


def _uncached(e: ChunkEngine, cid: ChunkId, offset: int, n: int) -> bool:
    """No page of the bytes is in the page cache."""
    return not any(_resident(e, cid, offset, n))


@pytest.mark.parametrize("direct_io", [True, False])
def test_aligned_writes_go_around_the_page_cache(tmp_path: Path, direct_io: bool) -> None:
    """With direct I/O the page-aligned part of a write from page-aligned memory leaves nothing in the page cache
    (a read that must not wait for the disk cannot find it), the unaligned rest goes through it, and every byte
    reads back, also after a reopen."""
    data = os.urandom(4 * BLOCK + 100)
    with ChunkEngine(tmp_path / "t", fsync=True, direct_io=direct_io) as e:
        e.write_pending(C, 1, 0, _aligned(data), crc32c(data), chunk_size=CS)
        e.commit(C, 1)
        assert (_uncached if direct_io else _cached)(e, C, 0, 4 * BLOCK)
        assert _cached(e, C, 4 * BLOCK, 100)  # the 100-byte tail: through the page cache either way
        e.write_pending(C, 2, BLOCK, _aligned(data[:BLOCK]), crc32c(data[:BLOCK]), chunk_size=CS)
        e.commit(C, 2)  # a block-aligned overwrite: old blocks copied, new ones direct
        assert content(e, C) == data[:BLOCK] * 2 + data[2 * BLOCK :]
        put(e, ChunkId(7, 1), 1, 0, data)  # read-only bytes have no address to check: through the page cache
        assert _cached(e, ChunkId(7, 1), 0, len(data))
    with ChunkEngine(tmp_path / "t", fsync=True, direct_io=direct_io) as e:
        assert content(e, C) == data[:BLOCK] * 2 + data[2 * BLOCK :] and content(e, ChunkId(7, 1)) == data


@pytest.mark.parametrize("hold", [True, False], ids=["held", "written-at-once"])
def test_whole_versions_go_through_the_page_cache_where_readers_on_this_host_read_back(tmp_path: Path, hold: bool,
                                                                                      monkeypatch) -> None:
    """Around the page cache while no reader that reads back what is put has located anything here (a mount's
    locate, without ``reads_back``, changes nothing but the held version it writes out); through it once one has
    (for READ_BACK_FOR seconds), where its next reads find what was just put."""
    chunk = 4 * BLOCK
    data = os.urandom(chunk)
    cids = [ChunkId(7, i) for i in range(4)]
    with ChunkEngine(tmp_path / "t", write_through=False, hold_bytes=8 * chunk if hold else 0) as e:
        def write(cid: ChunkId) -> None:
            e.write_pending(cid, 1, 0, _aligned(data), crc32c(data), chunk_size=CS)
            e.commit(cid, 1, durable=False)
            e.flush()

        write(cids[0])
        e.pin_location(cids[0], 1, 0, chunk).release()  # a mount's small read
        e.write_pending(cids[1], 1, 0, _aligned(data), crc32c(data), chunk_size=CS)
        e.commit(cids[1], 1, durable=False)
        write(cids[2])
        assert _uncached(e, cids[0], 0, chunk) and _uncached(e, cids[2], 0, chunk)
        if hold:  # held until the flush above wrote it out, around the cache: written out for a reader, through it
            assert _uncached(e, cids[1], 0, chunk)
            e.write_pending(cids[1], 2, 0, _aligned(data), crc32c(data), chunk_size=CS)
            e.commit(cids[1], 2, durable=False)
            e.pin_location(cids[1], 2, 0, chunk).release()
            assert _cached(e, cids[1], 0, chunk)
        e.pin_location(cids[0], 1, 0, chunk, reads_back=True).release()  # a kvclient's get
        write(cids[3])
        assert _cached(e, cids[3], 0, chunk)
        monkeypatch.setattr(engine_mod, "READ_BACK_FOR", 0.0)  # the reader went away
        cids.append(ChunkId(7, 4))
        write(cids[4])
        assert _uncached(e, cids[4], 0, chunk)
        assert all(content(e, cid) == data for cid in cids)


def test_held_versions_are_written_out_soon_where_readers_on_this_host_read_back(tmp_path: Path) -> None:
    """Held until a flush (or half the limit) otherwise; once a reader that reads back what is put has located
    here, the write-behind thread writes each held version out through the page cache without waiting, so the
    reader's locate right after the put finds it there instead of writing it out itself."""
    chunk = 4 * BLOCK
    data = os.urandom(chunk)
    a, b = ChunkId(7, 0), ChunkId(7, 1)
    gauge = lambda: prometheus_client.REGISTRY.get_sample_value("kvfs_chunk_held_bytes_now")  # noqa: E731
    before = gauge()  # the process's gauge: what engines of earlier tests left held counts too
    held = lambda: gauge() - before  # noqa: E731
    with ChunkEngine(tmp_path / "t", write_through=False, hold_bytes=8 * chunk) as e:
        e.write_pending(a, 1, 0, _aligned(data), crc32c(data), chunk_size=CS)
        e.commit(a, 1, durable=False)
        time.sleep(0.2)
        assert held() == chunk  # a quarter of the limit: held for the flush
        e.pin_location(a, 1, 0, chunk, reads_back=True).release()  # a kvclient's get writes it out
        assert held() == 0
        e.write_pending(b, 1, 0, _aligned(data), crc32c(data), chunk_size=CS)
        e.commit(b, 1, durable=False)
        deadline = time.monotonic() + 10
        while held() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held() == 0 and _cached(e, b, 0, chunk) and content(e, b) == data


def test_direct_length_takes_whole_pages_of_aligned_memory_only() -> None:
    page = mmap.PAGESIZE
    view = _aligned(bytes(3 * page))
    assert slots_mod._direct_length(view, 0) == 3 * page
    assert slots_mod._direct_length(view[: 2 * page + 5], page) == 2 * page  # the tail goes through the cache
    assert slots_mod._direct_length(view, 512) == 0  # unaligned file offset
    assert slots_mod._direct_length(view[16:], 0) == 0  # unaligned memory
    assert slots_mod._direct_length(view[: page - 1], 0) == 0  # less than a page
    assert slots_mod._direct_length(memoryview(bytes(3 * page)), 0) == 0  # read-only


def test_a_file_system_that_refuses_o_direct_gets_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused at open (EINVAL, as older tmpfs does) or at a write: the engine logs it once and writes through the
    page cache, losing nothing. (Every file system here takes O_DIRECT, so the refusals are injected.)"""
    real_open, real_pwrite = os.open, os.pwrite
    data = os.urandom(2 * BLOCK)

    def no_direct_open(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct_open)
    with ChunkEngine(tmp_path / "a", fsync=False) as e:
        e.write_pending(C, 1, 0, _aligned(data), crc32c(data), chunk_size=CS)
        e.commit(C, 1)
        assert _cached(e, C, 0, len(data)) and content(e, C) == data
    assert "refuses O_DIRECT" in caplog.text
    monkeypatch.setattr(os, "open", real_open)

    refused: list[int] = []

    def no_direct_pwrite(fd: int, buf: object, offset: int) -> int:
        if os.get_blocking(fd) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", no_direct_pwrite)
    with ChunkEngine(tmp_path / "b", fsync=False) as e:
        for v in (1, 2):
            e.write_pending(C, v, 0, _aligned(data), crc32c(data), chunk_size=CS)
            e.commit(C, v)
        assert content(e, C) == data and len(refused) == 1  # the second write did not try again
    assert "refuses direct I/O" in caplog.text


def test_a_direct_loan_reads_around_the_page_cache_and_holds_no_slot(tmp_path: Path) -> None:
    data = os.urandom(4 * BLOCK + 100)
    with ChunkEngine(tmp_path / "t", fsync=False) as e:
        e.write_pending(C, 1, 0, _aligned(data), crc32c(data), chunk_size=CS)
        e.commit(C, 1)
        lent = e.lend(C, BLOCK + 5, 3 * BLOCK, 1)
        assert bytes(lent.data) == data[BLOCK + 5 : 4 * BLOCK + 5]
        assert _uncached(e, C, 0, 4 * BLOCK)  # the read left nothing in the page cache
        put(e, C, 2, 0, bytes(10), full_replace=True)  # the loan holds no pin: v1's slot is free at once
        assert e.space()[1] == BLOCK and bytes(lent.data) == data[BLOCK + 5 : 4 * BLOCK + 5]
        lent.release()


def test_a_direct_loan_needs_no_room_in_the_buffer_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full pool hands out bytearrays, which are not page-aligned: the loan reads into fresh aligned memory
    instead, and direct I/O stays on (a misaligned read would have made the engine give it up)."""
    data = os.urandom(8 * BLOCK)
    with ChunkEngine(tmp_path / "t", fsync=False) as e:
        e.write_pending(C, 1, 0, _aligned(data), crc32c(data), chunk_size=CS)
        e.commit(C, 1)
        monkeypatch.setattr(slots_mod, "RECEIVED", BufferPool(capacity=0, allocate=page_aligned))
        for off, n in [(0, len(data)), (5, BLOCK), (len(data) - 3, 3)]:
            lent = e.lend(C, off, n, 1)
            assert bytes(lent.data) == data[off : off + n]
        assert e.lend(C, len(data), 10, 1).data.nbytes == 0
        assert all(f.direct >= 0 for f in e._slots.files.values()) and _uncached(e, C, 0, len(data))


def test_small_reads_work_on_tmpfs_where_the_page_cache_flag_is_refused(tmp_path: Path) -> None:
    """tmpfs refuses ``RWF_NOWAIT`` (EOPNOTSUPP): a ``nowait`` read must say "would block" so the service reads in a
    thread, and the plain read must work, never EIO (issue 28, item 3)."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize < 64 << 20:
        pytest.skip("needs /dev/shm (tmpfs) with 64 MiB free")
    base = Path(tempfile.mkdtemp(dir=shm))
    try:
        with ChunkEngine(base / "t", fsync=False) as e:
            data = os.urandom(3 * BLOCK)
            put(e, C, 1, 0, data)
            try:
                got = bytes(e.read(C, 4096, 4096, nowait=True)[0])
            except BlockingIOError:
                got = bytes(e.read(C, 4096, 4096)[0])
            assert got == data[4096:8192]
            assert bytes(e.read(C, 0, 3 * BLOCK)[0]) == data
    finally:
        shutil.rmtree(base)


def test_reserve_refuses_growth_and_freed_slots_of_any_size_count_as_room() -> None:
    """Slot files stop growing where the file system would keep less than the reserve free: a write then fails
    with ENOSPC and leaves what was stored intact, and once chunks are removed their slots take new versions,
    smaller ones included (issue 28, item 2)."""
    with tmpfs("64M") as fs:
        with ChunkEngine(fs / "t", fsync=False, reserve_bytes=16 << 20) as e:
            big = os.urandom(4 << 20)
            stored = 0
            with pytest.raises(KvfsError) as ei:
                for i in range(64):
                    e.write_pending(ChunkId(1, i), 1, 0, big, crc32c(big), chunk_size=4 << 20)
                    e.commit(ChunkId(1, i), 1)
                    stored += 1
            assert ei.value.errno == errno.ENOSPC and "leaves 16 MiB" in ei.value.message
            st = os.statvfs(fs)
            assert st.f_bavail * st.f_frsize >= 16 << 20  # the reserve stayed free
            assert stored >= 8 and e.space()[2] < 4 << 20
            assert bytes(e.read(ChunkId(1, 0), 0, 4 << 20)[0]) == big
            small = b"s" * 1000
            with pytest.raises(KvfsError) as ei:  # the last MiBs above the reserve go to small versions
                for i in range(64):
                    put(e, ChunkId(4, i), 1, 0, small)
            assert ei.value.errno == errno.ENOSPC
            e.remove_files([1])
            assert e.space()[2] >= stored * (4 << 20)
            put(e, ChunkId(2, 0), 1, 0, small)  # into a freed 4 MiB slot
            e.write_pending(ChunkId(3, 0), 1, 0, big, crc32c(big), chunk_size=4 << 20)
            e.commit(ChunkId(3, 0), 1)
        with ChunkEngine(fs / "t", fsync=False, reserve_bytes=16 << 20) as e:  # rows keep the slot's class
            assert content(e, ChunkId(2, 0)) == small
            assert bytes(e.read(ChunkId(3, 0), 0, 4 << 20)[0]) == big
