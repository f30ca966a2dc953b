"""Data through the mount: large round trips, appends, truncation, holes, concurrent writers,
locks, and the daemon's lifecycle (SIGTERM unmounts cleanly, a killed daemon is cleared by
force_unmount)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import signal
import subprocess
import sys

import pytest

from fuse_harness import REPO, fresh_dir, is_mounted, running_mount, start_mount, stop_mount

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)

MIB = 1 << 20
CHUNK = 256 * 1024  # small chunks so modest files span many chunks (parallel chunk I/O)
@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    with running_mount(tmp_path_factory.mktemp("fuse_io"), "--chunk-size", str(CHUNK), "--write-buffer", str(2 * MIB)) as m:
        yield m


@pytest.fixture
def d(mount):
    return fresh_dir(mount)


def pattern(n: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * 2048  # 64 KiB
    return (block * (n // len(block) + 1))[:n]


def test_large_round_trip(d):
    p = d / "big"
    h = hashlib.sha256()
    size = 64 * MIB
    rnd = os.urandom(MIB)
    with open(p, "wb", buffering=0) as f:
        for i in range(size // MIB):
            block = rnd[i:] + rnd[:i]
            h.update(block)
            assert f.write(block) == MIB
    assert os.stat(p).st_size == size
    h2 = hashlib.sha256()
    with open(p, "rb", buffering=0) as f:
        while True:
            b = f.read(4 * MIB)
            if not b:
                break
            h2.update(b)
    assert h2.hexdigest() == h.hexdigest()
    # unaligned reads across chunk boundaries
    with open(p, "rb") as f:
        for off in (0, CHUNK - 7, 5 * CHUNK + 123, size - 100):
            f.seek(off)
            got = f.read(3 * CHUNK)
            i, r = divmod(off, MIB)
            expect = (rnd[i:] + rnd[:i])[r:]
            assert got[: len(expect)][:1000] == expect[:1000]


def test_overlapping_writes_land_in_order_while_flushes_overlap(tmp_path):
    """Several flushes of one file are in flight at once; one that overlaps an earlier one waits for it, so the
    last write of each byte wins although storage finishes writes out of order (each waits up to 20 ms)."""
    import random

    rng = random.Random(7)
    model, end = bytearray(9 * MIB), 0
    with running_mount(tmp_path, "--chunk-size", str(CHUNK), "--write-buffer", str(2 * MIB),
                       "--write-jitter", "0.02") as m:
        path = fresh_dir(m) / "f"
        with open(path, "wb", buffering=0) as f:
            writes = [(rng.randrange(0, 7 * MIB, 256 * 1024), rng.choice((1, 2))) for _ in range(60)]
            # Then each MiB rewritten at once, while the flush of its first write travels (gaps keep them apart).
            writes += [(k * MIB, 1) for start in (0, 1) for k in range(start, 8, 2) for _ in range(2)]
            for i, (off, mib) in enumerate(writes):
                data = bytes([i % 255 + 1]) * MIB
                for piece in range(mib):  # two 1 MiB writes in a row fill a whole buffer
                    f.seek(off + piece * MIB)
                    f.write(data)
                model[off : off + mib * MIB] = data * mib
                end = max(end, off + mib * MIB)
        assert path.read_bytes() == bytes(model[:end])


def test_gathered_small_writes_land_in_order_while_their_flushes_overlap(tmp_path):
    """Scattered small writes, gathered and flushed a write buffer's worth at a time in the background; a flush
    waits for the earlier ones that hold the same bytes, so the last write of each byte wins although storage
    finishes writes out of order (each waits up to 20 ms)."""
    import random

    rng = random.Random(11)
    model = bytearray(2 * MIB)
    with running_mount(tmp_path, "--chunk-size", str(CHUNK), "--write-buffer", str(256 * 1024),
                       "--write-jitter", "0.02") as m:
        path = fresh_dir(m) / "f"
        with open(path, "wb", buffering=0) as f:
            f.write(model)
            for i in range(3000):  # over a few hot pages, so flushes in flight keep holding the same bytes
                off = rng.choice((rng.randrange(0, 2 * MIB - 5000), rng.randrange(0, 8) * 4096))
                data = rng.randbytes(rng.choice((1, 512, 4096)))
                f.seek(off)
                f.write(data)
                model[off:off + len(data)] = data
        assert path.read_bytes() == bytes(model)


def test_unaligned_small_writes_and_overwrite(d):
    p = d / "f"
    data = bytearray(pattern(3 * CHUNK + 17, 1))
    with open(p, "wb") as f:
        for i in range(0, len(data), 1000):
            f.write(data[i:i + 1000])
    with open(p, "r+b") as f:
        f.seek(CHUNK - 3)
        f.write(b"X" * 10)
        data[CHUNK - 3:CHUNK + 7] = b"X" * 10
        f.seek(10)
        f.write(b"Y")
        data[10:11] = b"Y"
    assert p.read_bytes() == bytes(data)


def test_read_sees_buffered_write_before_close(d):
    p = d / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR)
    try:
        os.write(fd, b"abc" * 1000)
        fd2 = os.open(p, os.O_RDONLY)
        try:
            assert os.stat(p).st_size == 3000
            assert os.pread(fd2, 3000, 0) == b"abc" * 1000
        finally:
            os.close(fd2)
    finally:
        os.close(fd)


def _resident_pages(fd: int, length: int) -> int:
    """Pages of the file behind ``fd`` that the kernel's page cache holds in ``[0, length)`` (mincore of a
    private mapping, whose pages are the page cache's until written)."""
    libc = ctypes.CDLL(None, use_errno=True)
    mapping = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(mapping)
        try:
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(length), vec):
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del anchor
        return sum(v & 1 for v in vec)
    finally:
        mapping.close()


def test_write_only_opens_write_around_the_page_cache_and_readers_see_their_bytes(d):
    # A write-only open can neither read nor map the file, and the next open drops cached pages anyway
    # (keep_cache off), so its writes skip the page cache; pages a reader of this mount cached go stale
    # then, and are dropped before the write returns.
    p = d / "f"
    p.write_bytes(pattern(2 * MIB, 1))
    reader = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(reader, 2 * MIB, 0) == pattern(2 * MIB, 1)
        assert _resident_pages(reader, 2 * MIB) > 0  # the reader's open caches what it reads
        fd = os.open(p, os.O_WRONLY)
        try:
            os.pwrite(fd, pattern(2 * MIB, 2), 0)
            assert _resident_pages(reader, 2 * MIB) == 0
            assert os.pread(reader, 2 * MIB, 0) == pattern(2 * MIB, 2)  # before the writer even closes
        finally:
            os.close(fd)
    finally:
        os.close(reader)
    assert p.read_bytes() == pattern(2 * MIB, 2)


@pytest.mark.parametrize("second", [os.O_RDWR, os.O_WRONLY], ids=["read-write", "write-only"])
def test_the_later_of_two_opens_writes_to_the_same_bytes_wins(d, second):
    # Each open buffers its writes and flushes them on its own schedule; closing the later one first must not
    # let the earlier one's bytes land last.
    p = d / "f"
    p.write_bytes(b"0" * 100)
    first, later = os.open(p, os.O_RDWR), os.open(p, second)
    try:
        os.pwrite(first, b"X" * 10, 0)
        os.pwrite(later, b"Y" * 10, 5)
    finally:
        os.close(later)
        os.close(first)
    assert p.read_bytes() == b"X" * 5 + b"Y" * 10 + b"0" * 85


def test_a_write_only_write_lands_after_what_a_shared_mapping_stored_before_it(d):
    # Bytes stored through a shared mapping sit in dirty page-cache pages until written back; a write that goes
    # around the page cache must not be overwritten by that later write-back.
    p = d / "f"
    p.write_bytes(b"0" * 8192)
    fd = os.open(p, os.O_RDWR)
    try:
        with mmap.mmap(fd, 8192) as mapped:
            mapped[:8192] = b"M" * 8192  # dirty, not written back yet
            writer = os.open(p, os.O_WRONLY)
            try:
                os.pwrite(writer, b"W" * 100, 10)
            finally:
                os.close(writer)
            assert mapped[:10] == b"M" * 10 and mapped[10:110] == b"W" * 100 and mapped[110:200] == b"M" * 90
    finally:
        os.close(fd)
    assert p.read_bytes() == b"M" * 10 + b"W" * 100 + b"M" * (8192 - 110)


def test_a_reader_and_a_write_only_writer_of_one_file_at_once(d):
    # The writer drops the reader's pages while the reader's reads make the daemon flush the writer's buffer:
    # neither may wait for the other (a hang here times the subprocesses out).
    p = d / "f"
    p.write_bytes(bytes(4 * MIB))
    code = (
        "import os, sys, random\n"
        "path, role = sys.argv[1], sys.argv[2]\n"
        "if role == 'w':\n"
        "    fd = os.open(path, os.O_WRONLY)\n"
        "    for r in range(8):\n"
        "        for off in range(0, 4 << 20, 64 << 10): os.pwrite(fd, bytes([r + 1]) * (64 << 10), off)\n"
        "else:\n"
        "    fd = os.open(path, os.O_RDONLY)\n"
        "    for _ in range(400): os.pread(fd, 128 << 10, random.randrange(0, 4 << 20, 4096))\n"
        "os.close(fd)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(p), role]) for role in "wrr"]
    try:
        assert [q.wait(120) for q in procs] == [0, 0, 0]
    finally:
        for q in procs:
            q.kill()
    assert p.read_bytes() == bytes([8]) * (4 * MIB)


def test_append(d):
    p = d / "log"
    with open(p, "ab") as f:
        f.write(b"one\n")
    with open(p, "ab") as f:
        f.write(b"two\n")
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, b"three\n")  # O_APPEND ignores the position
    os.close(fd)
    assert p.read_bytes() == b"one\ntwo\nthree\n"


def test_reopened_appends_keep_every_byte(d):
    # close(2) returns before the kernel sends RELEASE, so a write session may end at meta after the next
    # open of the file has written more: ending it must not cut the file back to that session's length.
    p = d / "log"
    want = b""
    for i in range(200):
        line = b"line %d\n" % i
        with open(p, "ab") as f:
            f.write(line)
        want += line
    assert p.read_bytes() == want


def test_concurrent_appenders(d):
    p = d / "log"
    p.write_bytes(b"")
    code = (
        "import os,sys\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)\n"
        "for i in range(200): os.write(fd, (sys.argv[2] * 99 + '\\n').encode())\n"
        "os.close(fd)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(p), c]) for c in "abcd"]
    assert [q.wait(60) for q in procs] == [0] * 4
    lines = p.read_bytes().split(b"\n")[:-1]
    assert len(lines) == 800
    assert all(len(set(line)) == 1 and len(line) == 99 for line in lines)


def test_concurrent_writers_distinct_files_and_regions(d):
    code = (
        "import os,sys,hashlib\n"
        "path, seed, off = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
        "blk = hashlib.sha256(seed.encode()).digest() * 8192\n"
        "fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)\n"
        "for i in range(4): os.pwrite(fd, blk, off + i * len(blk))\n"
        "os.fsync(fd); os.close(fd)\n"
    )
    shared = d / "shared"
    region = 4 * 256 * 1024
    procs = [subprocess.Popen([sys.executable, "-c", code, str(shared), str(i), str(i * region)]) for i in range(3)]
    procs += [subprocess.Popen([sys.executable, "-c", code, str(d / f"own{i}"), str(i), "0"]) for i in range(3)]
    assert [q.wait(60) for q in procs] == [0] * 6
    data = shared.read_bytes()
    assert len(data) == 3 * region
    for i in range(3):
        blk = hashlib.sha256(str(i).encode()).digest() * 8192
        assert data[i * region:(i + 1) * region] == blk * 4
        assert (d / f"own{i}").read_bytes() == blk * 4


def test_truncate_down_up_and_o_trunc(d):
    p = d / "f"
    data = pattern(3 * CHUNK + 1000, 2)
    p.write_bytes(data)
    os.truncate(p, CHUNK + 5)
    assert os.stat(p).st_size == CHUNK + 5
    assert p.read_bytes() == data[:CHUNK + 5]
    os.truncate(p, 3 * CHUNK)  # grows with zeros, old bytes past the cut stay gone
    assert p.read_bytes() == data[:CHUNK + 5] + bytes(2 * CHUNK - 5)
    with open(p, "r+b") as f:
        f.truncate(10)
        f.seek(0, os.SEEK_END)
        f.write(b"Z")
    assert p.read_bytes() == data[:10] + b"Z"
    with open(p, "wb") as f:  # O_TRUNC
        f.write(b"new")
    assert p.read_bytes() == b"new"
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert os.stat(p).st_size == 0 and p.read_bytes() == b""
    # after truncation to zero, extending shows zeros, not the old data
    os.truncate(p, 100)
    assert p.read_bytes() == bytes(100)


def test_sparse_file(d):
    p = d / "sparse"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY)
    os.pwrite(fd, b"end", 10 * CHUNK + 5)
    os.pwrite(fd, b"mid", 4 * CHUNK - 1)  # straddles a chunk boundary
    os.close(fd)
    data = p.read_bytes()
    assert len(data) == 10 * CHUNK + 8
    expect = bytearray(10 * CHUNK + 8)
    expect[10 * CHUNK + 5:] = b"end"
    expect[4 * CHUNK - 1:4 * CHUNK + 2] = b"mid"
    assert data == bytes(expect)


def test_fsync_and_length_visible_to_new_opens(d):
    p = d / "f"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY)
    os.write(fd, b"x" * 12345)
    os.fsync(fd)
    assert os.stat(p).st_size == 12345
    os.write(fd, b"y" * 5)
    os.fdatasync(fd)
    os.close(fd)
    assert p.read_bytes() == b"x" * 12345 + b"y" * 5


def test_mtime_advances_on_write(d):
    p = d / "f"
    p.write_bytes(b"a")
    os.utime(p, ns=(10**9, 10**9))
    with open(p, "ab") as f:
        f.write(b"b")
    assert os.stat(p).st_mtime_ns > 10**9


def test_posix_locks_within_the_mount(d):
    p = d / "lock"
    p.write_bytes(b"")
    fd = os.open(p, os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    code = (
        "import fcntl,os,sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "try:\n fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('got')\n"
        "except OSError: print('busy')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "busy"
    fcntl.lockf(fd, fcntl.LOCK_UN)
    out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "got"
    fcntl.flock(fd, fcntl.LOCK_EX)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def test_fallocate_not_supported_or_emulated(d):
    p = d / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR)
    try:
        try:
            os.posix_fallocate(fd, 0, 3 * CHUNK)
        except OSError as e:
            assert e.errno in (errno.EOPNOTSUPP, errno.ENOSYS)
        else:  # glibc emulates it by writing, which works through the mount
            assert os.fstat(fd).st_size == 3 * CHUNK
    finally:
        os.close(fd)


def test_unlinked_open_file_stays_readable(d):
    """Removed, or replaced by a rename (as a deployment swaps a model file under running readers). That this
    outlasts meta's GC is shown on a real cluster (test_mount_posix)."""
    data = pattern(3 * CHUNK + 5, seed=7)
    (d / "f").write_bytes(data)
    (d / "g").write_bytes(b"old")
    (d / "new").write_bytes(b"new")
    with open(d / "f", "rb") as f, open(d / "g", "rb") as g:
        assert f.read(10) == data[:10]
        os.unlink(d / "f")
        os.rename(d / "new", d / "g")
        assert f.read() == data[10:] and g.read() == b"old"
        assert os.fstat(f.fileno()).st_size == len(data) and os.fstat(f.fileno()).st_nlink == 0
    assert (d / "g").read_bytes() == b"new" and not (d / "f").exists()


def test_storage_errors_reach_the_writer(tmp_path):
    """A storage failure during a (background) buffer flush comes back from write, fsync or close."""
    m = start_mount(tmp_path, "--fail-writes-from", str(MIB), "--write-buffer", str(256 * 1024))
    try:
        p = m.path / "f"
        fd = os.open(p, os.O_CREAT | os.O_WRONLY)
        os.write(fd, b"a" * 1000)
        os.fsync(fd)  # below the limit: fine
        codes = set()
        try:
            for _ in range(16):
                os.write(fd, b"b" * (128 * 1024))  # crosses 1 MiB: a background flush fails
        except OSError as e:
            codes.add(e.errno)
        for op in (os.fsync, os.close):
            try:
                op(fd)
            except OSError as e:
                codes.add(e.errno)
        assert codes == {errno.ENOSPC}
        assert os.stat(p).st_size >= 1000
        with open(p, "rb") as f:
            assert f.read(1000) == b"a" * 1000
    finally:
        stop_mount(m)


def test_a_failed_flush_of_gathered_small_writes_reaches_the_writer(tmp_path):
    """Scattered small writes are gathered per chunk; when their flush fails, the writer hears it (once) at its
    next write, fsync or close, and the bytes below the failure are kept."""
    m = start_mount(tmp_path, "--chunk-size", str(CHUNK), "--fail-writes-from", str(MIB),
                    "--write-buffer", str(256 * 1024))
    try:
        p = m.path / "f"
        fd = os.open(p, os.O_CREAT | os.O_RDWR)
        os.pwrite(fd, b"s" * 4096, 0)
        for off in range(8192, MIB, 3 * 4096):  # below the limit: gathered, then flushed by fsync
            os.pwrite(fd, b"a" * 4096, off)
        os.fsync(fd)
        codes = []
        for op in (lambda: os.pwrite(fd, b"b" * 4096, MIB + 8192), lambda: os.pwrite(fd, b"c" * 4096, 40960),
                   lambda: os.fsync(fd), lambda: os.close(fd)):
            try:
                op()
            except OSError as e:
                codes.append(e.errno)
        assert codes == [errno.ENOSPC]
        with open(p, "rb") as f:
            assert f.read(4096) == b"s" * 4096 and f.read(4096) == bytes(4096) and f.read(4096) == b"a" * 4096
    finally:
        stop_mount(m)


# ------------------------------------------------------------------ lifecycle
def test_sigterm_flushes_and_unmounts(tmp_path):
    m = start_mount(tmp_path)
    try:
        p = m.path / "f"
        fd = os.open(p, os.O_CREAT | os.O_WRONLY)
        os.write(fd, b"buffered")  # sits in the daemon's write buffer
        os.kill(m.proc.pid, signal.SIGTERM)
        # the open file keeps the mount busy: the daemon flushes, then unmounts (lazily if need be)
        assert m.proc.wait(20) == 0
        assert not is_mounted(m.path)
        try:
            os.close(fd)
        except OSError:
            pass  # the connection is gone
    finally:
        stop_mount(m)
    m2 = start_mount(tmp_path)  # same state dir: the buffered bytes were written and the length reported
    try:
        assert (m2.path / "f").read_bytes() == b"buffered"
    finally:
        stop_mount(m2)


def test_force_unmount_after_crash(tmp_path):
    m = start_mount(tmp_path)
    try:
        m.proc.kill()
        m.proc.wait(10)
        assert is_mounted(m.path)
        with pytest.raises(OSError) as info:
            os.listdir(m.path)
        assert info.value.errno == errno.ENOTCONN
        out = subprocess.run([sys.executable, "-c", f"from fuse.mount import force_unmount; "
                              f"print(force_unmount({str(m.path)!r}))"],
                             capture_output=True, text=True, cwd=REPO, check=True).stdout
        assert out.strip() == "True"
        assert not is_mounted(m.path)
    finally:
        stop_mount(m)
