"""Short-circuit reads, the client side: a client on a chunk server's host reads a located version of a chunk
straight from the server's slot file and checks it, instead of asking the server for the bytes.

The server chose the version by the chain's rules and pinned it until ``deadline_ns`` on the host's monotonic clock
(``chunk.locate_many``, :class:`~kvfs.chunkserver.protocol.ChunkLocation`). A read is trusted only if it ended before
that deadline (so every byte came from the pinned version) and every 64 KiB block it touched has the CRC32C the
server stored; anything else raises :class:`LocalReadFailed` and the caller reads over the network instead
(chunkserver/README.md, "Short-circuit reads", has the argument). Shared by kvclient and the mount.
"""

from __future__ import annotations

import errno
import os
import time

from kvfs.chunkserver.protocol import ChunkLocation
from kvfs.crc import BLOCK, bad_block
from kvfs.errors import KvfsError


def enabled_by_environment() -> bool:
    """Whether a client reads short-circuit when not told: yes, unless ``KVFS_SHORT_CIRCUIT=0``."""
    return os.environ.get("KVFS_SHORT_CIRCUIT", "1") != "0"


class LocalReadFailed(KvfsError):
    """A short-circuit read that cannot be trusted or done; ``reason`` labels the fallback metric, and
    ``"permission"`` means no file of this host's targets will open for this process."""

    default_errno = errno.EIO

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ReplicaFiles:
    """The slot files of this host's chunk servers, each opened read-only once, and checked reads from them.
    Reads may run in worker threads; :meth:`close` only once none is running."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._no_nowait: set[str] = set()  # files whose file system refuses RWF_NOWAIT (tmpfs)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except PermissionError as exc:
                raise LocalReadFailed("permission", f"cannot open the chunk servers' files ({exc.strerror}: {path})"
                                      ) from None
            except OSError as exc:
                raise LocalReadFailed("open", f"cannot open {path}: {exc.strerror}") from None
            self._fds[path] = fd
        return fd

    @staticmethod
    def extent(loc: ChunkLocation, within: int, n: int) -> tuple[int, int, int]:
        """(bytes of the range the version holds, first block boundary, end of the last block touched)."""
        have = max(0, min(n, loc.length - within))
        lo = loc.first_block * BLOCK
        hi = min(-(-(within + have) // BLOCK) * BLOCK, loc.length)
        return have, lo, hi

    def pread(self, loc: ChunkLocation, lo: int, buffers: list[memoryview], expect: int, nowait: bool = False) -> None:
        """``nowait``: only from the page cache (``RWF_NOWAIT``), else BlockingIOError; a file whose file system
        cannot say (tmpfs refuses the flag) is read as without it, once it has refused."""
        buffers = [b for b in buffers if len(b)]
        if not buffers:
            got = 0
        elif nowait and loc.path not in self._no_nowait:
            fd = self.fd(loc.path)
            try:
                got = os.preadv(fd, buffers, loc.file_offset + lo, os.RWF_NOWAIT)
            except OSError as exc:
                if exc.errno == errno.EOPNOTSUPP:
                    self._no_nowait.add(loc.path)
                elif exc.errno != errno.EAGAIN:
                    raise
                raise BlockingIOError(errno.EAGAIN, "not all in the page cache") from None
            if got != expect:  # a part was cached
                raise BlockingIOError(errno.EAGAIN, "not all in the page cache")
        else:
            got = os.preadv(self.fd(loc.path), buffers, loc.file_offset + lo)
        if got != expect:
            raise LocalReadFailed("short", f"{loc.path}: short read ({got} of {expect} bytes)")

    @staticmethod
    def check(loc: ChunkLocation, segments: list[tuple[int, memoryview]], lo: int, hi: int) -> None:
        """After the read: the pin still held (the deadline is on the host's monotonic clock, which the server
        shares), then every block's CRC."""
        if time.monotonic_ns() >= loc.deadline_ns:
            raise LocalReadFailed("lease", f"{loc.path}: read outlasted the server's pin of v{loc.version}")
        bad = bad_block(segments, lo, hi, loc.block_crcs, loc.first_block)
        if bad is not None:
            raise LocalReadFailed("crc", f"{loc.path} slot at {loc.file_offset} block {bad}: CRC32C mismatch")

    def read_checked(self, loc: ChunkLocation, within: int, out: memoryview, nowait: bool = False) -> int:
        """``out`` <- bytes at ``within`` of the located version (zeros past its end), blocks checked; the middle
        lands straight in ``out``, the partial blocks around it in scratch. Returns the bytes read from the file.
        ``loc`` may name more blocks than the read touches (a whole chunk located once for many reads).
        ``nowait``: BlockingIOError where the bytes are not all in the page cache (see :meth:`pread`)."""
        have, lo, hi = self.extent(loc, within, len(out))
        out[have:] = bytes(len(out) - have)
        if not have:
            return 0
        lo = max(lo, within // BLOCK * BLOCK)
        head, tail = memoryview(bytearray(within - lo)), memoryview(bytearray(hi - within - have))
        self.pread(loc, lo, [head, out[:have], tail], hi - lo, nowait)
        self.check(loc, [(lo, head), (within, out[:have]), (within + have, tail)], lo, hi)
        return have
