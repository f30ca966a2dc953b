"""The short-circuit reader's checks against a real chunk engine's slot files: any range of a pinned version reads
back exactly, a read that outlasts the pin's deadline or meets a corrupt block is refused (the caller then reads
over the network)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfs.chunkserver.engine import BLOCK, ChunkEngine
from kvfs.chunkserver.protocol import ChunkLocation
from kvfs.craq.messages import ChunkId
from kvfs.kvclient.gpu import GpuSupport
from kvfs.kvclient.local import ChunkReader, LocalReadFailed

C = ChunkId(7, 0)
LEASE_NS = 5 * 10**9


def _reader() -> ChunkReader:
    def no_gpu():
        raise AssertionError("host reads need no GPU")

    return ChunkReader(None, short_circuit=True, gpu_support=GpuSupport, gpu=no_gpu)  # type: ignore[arg-type]


def _located(engine: ChunkEngine, offset: int, length: int, deadline_ns: int | None = None) -> ChunkLocation:
    """What chunk.locate answers: the pinned version's place (released here at once: nothing writes meanwhile)."""
    loc = engine.pin_location(C, None, offset, length)
    loc.release()
    deadline = time.monotonic_ns() + LEASE_NS if deadline_ns is None else deadline_ns
    return ChunkLocation(loc.version, str(loc.path), loc.offset, loc.length, loc.first_block, loc.block_crcs, deadline)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    data = os.urandom(5 * BLOCK + 1234)
    engine = ChunkEngine(Path(tmp_path_factory.mktemp("t")), fsync=False)
    engine.write_pending(C, 1, 0, data, crc32c(data), chunk_size=1 << 20)
    engine.commit(C, 1)
    reader = _reader()
    yield engine, data, reader
    reader.close()
    engine.close()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(within=st.integers(0, 6 * BLOCK), n=st.integers(0, 3 * BLOCK))
def test_any_range_reads_back_exactly_and_zeros_past_the_end(stored, within: int, n: int) -> None:
    engine, data, reader = stored
    within = min(within, len(data))
    out = memoryview(bytearray(b"\xAA" * n))
    reader.files.read_checked(_located(engine, within, n), within, out)
    expected = data[within : within + n]
    assert bytes(out) == expected + bytes(n - len(expected))


def test_a_read_past_the_pins_deadline_is_refused(stored) -> None:
    engine, data, reader = stored
    with pytest.raises(LocalReadFailed) as e:
        reader.files.read_checked(_located(engine, 0, BLOCK, deadline_ns=time.monotonic_ns() - 1), 0,
                                  memoryview(bytearray(BLOCK)))
    assert e.value.reason == "lease"


def test_a_corrupt_block_is_refused(tmp_path) -> None:
    data = os.urandom(3 * BLOCK)
    with ChunkEngine(tmp_path / "t", fsync=False) as engine:
        engine.write_pending(C, 1, 0, data, crc32c(data), chunk_size=1 << 20)
        engine.commit(C, 1)
        loc = _located(engine, 0, len(data))
        with open(loc.path, "r+b") as f:
            f.seek(loc.file_offset + BLOCK + 100)
            f.write(bytes([data[BLOCK + 100] ^ 1]))
        reader = _reader()
        try:
            reader.files.read_checked(loc, 0, memoryview(bytearray(BLOCK)))  # block 0 is intact
            with pytest.raises(LocalReadFailed) as e:
                reader.files.read_checked(loc, BLOCK + 10, memoryview(bytearray(50)))
            assert e.value.reason == "crc" and "block 1" in e.value.message
        finally:
            reader.close()


def test_reads_the_page_cache_cannot_answer_are_read_from_the_disk_after_the_cached_ones(tmp_path) -> None:
    """A batch's host reads: the cached ones first without waiting (``RWF_NOWAIT``), then the rest from the disk
    in several hops; every byte right either way. Where the file system cannot tell (tmpfs), the reads just wait."""
    import trio

    chunks = [ChunkId(20 + i, 0) for i in range(6)]
    values = [os.urandom(2 * BLOCK + 100 * i) for i in range(6)]
    with ChunkEngine(tmp_path / "t", fsync=False) as engine:
        locations = []
        for cid, data in zip(chunks, values):
            engine.write_pending(cid, 1, 0, data, crc32c(data), chunk_size=1 << 20)
            engine.commit(cid, 1)
            loc = engine.pin_location(cid, None, 0, len(data))
            loc.release()
            locations.append(ChunkLocation(loc.version, str(loc.path), loc.offset, loc.length, loc.first_block,
                                           loc.block_crcs, time.monotonic_ns() + LEASE_NS))
        def drop_some() -> None:
            fd = os.open(locations[0].path, os.O_RDONLY)
            try:
                os.fsync(fd)  # clean pages can be dropped
                for loc in locations[::2]:
                    os.posix_fadvise(fd, loc.file_offset, loc.length, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

        reader = _reader()
        try:
            drop_some()
            with pytest.raises(BlockingIOError):
                reader.files.read_checked(locations[0], 0, memoryview(bytearray(len(values[0]))), nowait=True)
            drop_some()  # that miss started readahead
            outs = [memoryview(bytearray(len(v))) for v in values]
            failures = trio.run(reader._read_local, [(loc, 0, out) for loc, out in zip(locations, outs)])
            assert failures == [None] * 6 and [bytes(o) for o in outs] == values
        finally:
            reader.close()
