"""The mount's short-circuit reads: a small read of a chunk with a replica on this host comes from the replica's
slot file, with no round trip to a chunk server.

A cold 4 KiB read over the network costs a request and an answer through two Python processes (~0.4 ms of CPU
over the mount and the chunk server, benchmarks/RESULTS.md "Cold paths, hop by hop"); the disk read itself takes
~0.1 ms. So the mount asks a chunk server on this host where the readable version of a whole chunk lies
(``chunk.locate_many`` of one chunk: one round trip, and the server pins that version for a few seconds), keeps the answer, and
reads every block it then misses in that chunk straight from the file, checking the pin's deadline and each
block's CRC32C (:mod:`kvfs.chunkserver.shortcircuit`). A location is dropped when the pin is about to end, when
this mount writes or truncates the file, or when the file's (mtime, size) at an open differs from the one it was
found under: the same close-to-open coherence as the mount's block cache (fuse/cache.py), whose misses it serves.

The read runs on the event loop's own thread while the disk answers quickly (a thread hand-off costs about what
an SSD read does), and in worker threads once recent reads took longer than :data:`SLOW_READ`, so a slow disk
does not stall the mount. Any failure (no local replica, a refused or lapsed pin, a CRC mismatch, a file this
process may not open) falls back to the network read, and a permission failure turns short-circuit reads off.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter

from kvfs.aio import Workers
from kvfs.chunkserver.client import StorageClient
from kvfs.chunkserver.protocol import ChunkLocation
from kvfs.chunkserver.shortcircuit import LocalReadFailed, ReplicaFiles
from kvfs.transport import shm

from .cache import Stamp
from .writes import InodeState

log = logging.getLogger("kvfs.fuse")

LOCAL_BYTES = Counter("kvfs_mount_short_circuit_bytes", "bytes the mount read from replicas' files on this host")
FALLBACKS = Counter("kvfs_mount_short_circuit_fallbacks",
                    "reads located on this host but made over the network instead", ["reason"])

#: A location is not used within this long of its pin's deadline: a read must end before the pin does.
MARGIN_NS = 500_000_000
#: Reads slower than this (a moving average) go to worker threads instead of blocking the event loop.
SLOW_READ = 0.0005
#: A chunk no local replica would locate (none serves here, or its version's blocks are not in one slot: a version
#: with block overrides) is read over the network without asking again for this long.
UNLOCATED_NS = 2_000_000_000
#: Past this many locations kept, the lapsed ones are forgotten (all of them, if that is not enough): each keeps a
#: whole chunk's block CRCs, a few KiB.
PRUNE_AT = 2048


class LocalReads:
    """Located chunks of open files, and reads from them."""

    def __init__(self, storage: StorageClient) -> None:
        self.storage = storage
        self.enabled = True
        self._files = ReplicaFiles()
        self._boot_id = shm.boot_id()
        #: ino -> chunk index -> (location or None for "read it over the network", the file's stamp, usable until)
        self._located: dict[int, dict[int, tuple[ChunkLocation | None, Stamp, int]]] = {}
        self._count = 0
        self._workers = Workers("mount-local-read", max_threads=8)
        self._average = 0.0  # seconds a recent read took (moving average)
        self._used = False  # logged once, on the first read that worked

    def close(self) -> None:
        self._files.close()

    async def read(self, st: InodeState, offset: int, out: memoryview) -> bool:
        """Fill ``out`` with the file's bytes at ``offset`` (inside one chunk) from a replica on this host; False
        where that cannot be done, and the caller reads over the network."""
        if not self.enabled:
            return False
        index, within = divmod(offset, st.layout.chunk_size)
        kept = self._located.get(st.ino, {}).get(index)
        if kept is not None and kept[1] == st.stamp and kept[2] > time.monotonic_ns():
            if kept[0] is None:
                return False
            loc = kept[0]
        else:
            changes = st.changes
            found = await self.storage.locate(st.ino, st.layout, index, 0, st.layout.chunk_size, self._boot_id)
            if st.changes == changes:  # no write of this mount overtook the locate: later reads may use it
                self._keep(st.ino, index, found, st.stamp)
            if found is None:
                return False
            loc = found
        try:
            if self._average < SLOW_READ:
                got = self._timed_read(loc, within, out)
            else:
                got = await self._workers.run(lambda: self._timed_read(loc, within, out))
        except LocalReadFailed as exc:
            self._forget(st.ino, index)
            FALLBACKS.labels(exc.reason).inc()
            if exc.reason == "permission":
                self.enabled = False
                log.warning("short-circuit reads off: %s; reading over the network", exc.message)
            else:
                log.info("short-circuit read of chunk %d of inode %d: %s; reading it over the network", index,
                         st.ino, exc.message)
            return False
        LOCAL_BYTES.inc(got)
        if not self._used:
            self._used = True
            log.info("short-circuit reads: small reads of chunks with a replica on this host come from %s",
                     loc.path.rsplit("/", 2)[0])
        return True

    def _timed_read(self, loc: ChunkLocation, within: int, out: memoryview) -> int:
        started = time.perf_counter()
        try:
            return self._files.read_checked(loc, within, out)
        finally:
            self._average += (time.perf_counter() - started - self._average) / 8

    def _keep(self, ino: int, index: int, loc: ChunkLocation | None, stamp: Stamp) -> None:
        now = time.monotonic_ns()
        if self._count >= PRUNE_AT:
            self._located = {i: live for i, chunks in self._located.items()
                             if (live := {c: v for c, v in chunks.items() if v[2] > now})}
            self._count = sum(map(len, self._located.values()))
            if self._count >= PRUNE_AT:
                self._located, self._count = {}, 0
        chunks = self._located.setdefault(ino, {})
        self._count += index not in chunks
        chunks[index] = (loc, stamp, now + UNLOCATED_NS if loc is None else loc.deadline_ns - MARGIN_NS)

    def _forget(self, ino: int, index: int) -> None:
        chunks = self._located.get(ino)
        if chunks is not None and chunks.pop(index, None) is not None:
            self._count -= 1

    def drop(self, ino: int) -> None:
        """Forget the file's locations (this mount changed its bytes, or it changed elsewhere)."""
        self._count -= len(self._located.pop(ino, ()))
