"""Reading objects' chunks into host or GPU buffers: straight from a replica's slot file where one lies on this
host (short-circuit), else from the chunk servers.

A batch get asks the chunk servers on this host where the versions a read would serve lie, all chunks of all its
objects in one ``chunk.locate_many`` call per server (``StorageClient.locate_many``): each server picks the versions
by the chain's rules, as for a read, and keeps them pinned (their slots not reused) until a deadline on the host's
monotonic clock. The reader keeps each location while its pin lasts and the object's (size, mtime) is the one it
was located under, so a repeated get of a key asks nothing. It then reads the slot files itself, the host chunks of
a batch in a few worker-thread hops (``preadv`` straight into the caller's buffers, or KvikIO into GPU memory),
checks every block's CRC32C and that the deadline has not passed (:mod:`kvfs.chunkserver.shortcircuit`, shared with
the mount), and otherwise reads that chunk over the network instead (chunkserver/README.md, "Short-circuit reads",
has the argument). Which way each chunk goes is :func:`kvfs.kvclient.gpu.choose_read_path`.

Objects are written whole, so a chunk that holds fewer bytes than the object's recorded size says is an error
(:class:`ShortObject`), never a zero-filled read.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import trio
from prometheus_client import Counter

from kvfs.aio import Workers
from kvfs.chunkserver.client import StorageClient, split_range
from kvfs.chunkserver.protocol import ChunkLocation
from kvfs.chunkserver.shortcircuit import LocalReadFailed, ReplicaFiles
from kvfs.errors import KvfsError
from kvfs.kvclient.buffers import DeviceSpan
from kvfs.kvclient.gpu import GpuBackend, GpuSupport, ReadPath, choose_read_path
from kvfs.storage import LayoutLike
from kvfs.transport import shm
from kvfs.transport.direct import DirectInto

log = logging.getLogger("kvfs.kvclient")

LOCAL_BYTES = Counter("kvfs_kvclient_short_circuit_bytes", "bytes kvclient read from replicas' files on this host")
GDS_BYTES = Counter("kvfs_kvclient_gds_bytes", "bytes kvclient read from replicas' files straight into GPU memory")
GDR_BYTES = Counter("kvfs_kvclient_gdr_bytes", "bytes chunk servers RDMA-wrote straight into GPU memory")
FALLBACKS = Counter("kvfs_kvclient_short_circuit_fallbacks",
                    "chunks located on this host but read over the network instead", ["reason"])

#: A kept location is not used within this long of its pin's deadline: a read must end before the pin does.
MARGIN_NS = 500_000_000
#: Past this many kept locations the lapsed ones are forgotten (all of them, if that is not enough): each keeps
#: a whole chunk's block CRCs.
KEEP_AT = 4096
#: Worker-thread hops a batch's local host reads are spread over, at most: one hop costs ~100 us, and a few in
#: flight keep the disk and the CRC checks (which release the GIL) busy.
LOCAL_HOPS = 4
#: Bytes of host reads per worker hop: reads the page cache answers are mostly the reading thread's CPU (a copy
#: and a CRC check), so hops beyond one per core, or for less than this, only trade the GIL. On the 2-vCPU VM a
#: batch of 42 cached 128 KiB blocks took 1.5 ms in one hop and 2.6 ms in four; 16 blocks of 1 MiB 4.7 ms in
#: two, 5.5 in four, 6.6-7.3 in one.
HOP_BYTES = 8 << 20
#: Worker hops for the reads of a batch that the page cache cannot answer: reads in flight for the disk. On the
#: 2-vCPU VM 70 cold 128 KiB reads took 19 ms one at a time, 15 in two threads, 10-12 in eight.
DISK_HOPS = 8


class ShortObject(KvfsError):
    """Fewer bytes are stored than the object holds: an error, never a silent short read."""

    default_errno = errno.EIO


class ObjectRead(NamedTuple):
    """One object of a batch get: ``dest[:size]`` <- its bytes. ``mtime_ns`` with ``size`` stamps the locations
    kept for it: an object changed since (removed and put again) is located afresh."""

    ino: int
    layout: LayoutLike
    size: int
    mtime_ns: int
    dest: memoryview | DeviceSpan


class _Piece(NamedTuple):
    """The part of an object within one chunk."""

    obj: int  # index in the batch
    ino: int
    layout: LayoutLike
    index: int
    within: int
    part: memoryview | DeviceSpan
    stamp: tuple[int, int]


class ChunkReader:
    """Reads objects' bytes chunk by chunk, in parallel, each the way :func:`choose_read_path` says.
    ``gpu``: gives the GPU backend (made on first use, so a host-only client imports no GPU library)."""

    def __init__(self, storage: StorageClient, *, short_circuit: bool, gpu_support: Callable[[], GpuSupport],
                 gpu: Callable[[], GpuBackend], parallel: int = 16) -> None:
        self.storage = storage
        self.boot_id = shm.boot_id()
        self.short_circuit = short_circuit
        self.off_reason = "" if short_circuit else "turned off (short_circuit=False or KVFS_SHORT_CIRCUIT=0)"
        self._gpu_support = gpu_support
        self._gpu = gpu
        self._limit = trio.CapacityLimiter(parallel)
        self.files = ReplicaFiles()
        self._workers = Workers("kvclient-read")
        #: (ino, chunk index) -> (location, the object's (size, mtime_ns) it was found under, usable until)
        self._kept: dict[tuple[int, int], tuple[ChunkLocation, tuple[int, int], int]] = {}

    def close(self) -> None:
        self.files.close()

    async def read_many(self, objects: Sequence[ObjectRead]) -> list[OSError | None]:
        """Fill every object's ``dest[:size]``: None per object read whole, else its error (:class:`ShortObject`
        where a chunk holds fewer bytes than the size says). Chunks are located with one call per chunk server
        on this host; host chunks located here are read in a few worker hops, the rest in parallel, each chunk
        that could not be read here over the network."""
        pieces = [_Piece(n, o.ino, o.layout, index, within,
                         o.dest[at : at + min(o.layout.chunk_size - within, o.size - at)], (o.size, o.mtime_ns))
                  for n, o in enumerate(objects) for index, within, at in split_range(0, o.size, o.layout.chunk_size)]
        locations = await self._locations(pieces)
        local = [k for k, loc in enumerate(locations) if loc is not None and isinstance(pieces[k].part, memoryview)]
        failures = await self._read_local([(locations[k], pieces[k].within, pieces[k].part)  # type: ignore[misc]
                                           for k in local])
        rest = sorted(set(range(len(pieces))) - set(local))
        for k, failure in zip(local, failures):
            if failure is not None:
                self._fell_back(pieces[k], failure)
                locations[k] = None
                rest.append(k)
        errors: list[OSError | None] = [None] * len(objects)

        async def one(piece: _Piece, loc: ChunkLocation | None) -> None:
            try:
                await self._read_chunk(piece, loc)
            except OSError as exc:
                errors[piece.obj] = errors[piece.obj] or exc

        async with trio.open_nursery() as nursery:
            for k in rest:
                nursery.start_soon(one, pieces[k], locations[k])
        return errors

    async def _locations(self, pieces: list[_Piece]) -> list[ChunkLocation | None]:
        """Each piece's location on this host (None: read it over the network): kept ones while their pin lasts
        and their object's stamp holds, the others from ``locate_many`` (whole chunks, so any read of them may use
        the answer), kept in turn."""
        if not self.short_circuit or not pieces:
            return [None] * len(pieces)
        now = time.monotonic_ns()
        found: list[ChunkLocation | None] = [None] * len(pieces)
        ask: list[int] = []
        for k, piece in enumerate(pieces):
            kept = self._kept.get((piece.ino, piece.index))
            if kept is not None and kept[1] == piece.stamp and kept[2] > now:
                found[k] = kept[0]
            else:
                ask.append(k)
        if ask:
            chunks = [(pieces[k].ino, pieces[k].layout, pieces[k].index, 0, pieces[k].layout.chunk_size) for k in ask]
            # reads_back: an engine gets what was put a moment ago, which the servers then keep in the page cache
            for k, loc in zip(ask, await self.storage.locate_many(chunks, self.boot_id, reads_back=True)):
                found[k] = loc
                if loc is not None:
                    self._keep(pieces[k], loc)
        return found

    def _keep(self, piece: _Piece, loc: ChunkLocation) -> None:
        now = time.monotonic_ns()
        if len(self._kept) >= KEEP_AT:
            self._kept = {key: kept for key, kept in self._kept.items() if kept[2] > now}
            if len(self._kept) >= KEEP_AT:
                self._kept.clear()
        self._kept[piece.ino, piece.index] = (loc, piece.stamp, loc.deadline_ns - MARGIN_NS)

    def _fell_back(self, piece: _Piece, exc: LocalReadFailed) -> None:
        """A located chunk that could not be read here: forget its location, count why, and stop short-circuit
        reads altogether where this host's targets are closed to this user."""
        self._kept.pop((piece.ino, piece.index), None)
        FALLBACKS.labels(exc.reason).inc()
        if exc.reason == "permission":
            self.short_circuit = False
            self.off_reason = exc.message
        log.warning("short-circuit read of chunk %d of inode %d: %s; reading it over the network",
                    piece.index, piece.ino, exc.message)

    async def _read_local(self, reads: list[tuple[ChunkLocation, int, memoryview]]) -> list[LocalReadFailed | None]:
        """Checked reads from this host's replicas into host buffers: None per read that filled its buffer, else
        why not (a chunk shorter than asked included). What the page cache holds is read first, in worker hops
        of ``HOP_BYTES`` per core, at most ``LOCAL_HOPS``; what must come from the disk then in up to
        ``DISK_HOPS`` hops, so the disk has that many reads in flight."""
        failures: list[LocalReadFailed | None] = [None] * len(reads)
        from_disk: list[int] = []

        def run(ks: Sequence[int], nowait: bool) -> None:
            for k in ks:
                loc, within, out = reads[k]
                try:
                    have = self.files.read_checked(loc, within, out, nowait)
                except BlockingIOError:
                    from_disk.append(k)  # list.append is atomic: hops may add at once
                    continue
                except LocalReadFailed as exc:
                    failures[k] = exc
                    continue
                LOCAL_BYTES.inc(have)
                if have < len(out):
                    failures[k] = LocalReadFailed("short", f"{loc.path}: v{loc.version} holds {have} of the "
                                                           f"{len(out)} bytes asked")

        async def spread(ks: Sequence[int], hops: int, nowait: bool) -> None:
            async with trio.open_nursery() as nursery:
                for h in range(hops):
                    nursery.start_soon(self._workers.run, lambda part=ks[h::hops]: run(part, nowait))

        wanted = -(-sum(len(out) for _, _, out in reads) // HOP_BYTES)
        await spread(range(len(reads)), min(len(reads), max(1, min(LOCAL_HOPS, os.cpu_count() or 1, wanted))), True)
        if from_disk:
            await spread(sorted(from_disk), min(len(from_disk), DISK_HOPS), False)
        return failures

    async def _read_chunk(self, piece: _Piece, loc: ChunkLocation | None) -> None:
        """One chunk's part the way :func:`choose_read_path` says, over the network where the local read fails;
        ShortObject where the chunk holds fewer bytes than the part."""
        ino, layout, index, within, part = piece.ino, piece.layout, piece.index, piece.within, piece.part
        async with self._limit:
            to_gpu = isinstance(part, DeviceSpan)
            support = self._gpu_support() if to_gpu else GpuSupport()
            gdr_region = isinstance(part, DeviceSpan) and part.region is not None
            path = choose_read_path(to_gpu, loc is not None, support, gdr_region)
            if loc is not None:
                try:
                    assert isinstance(part, DeviceSpan)  # host ones with a location went through _read_local
                    have = await self._read_located(path, loc, within, part)
                    if have == len(part):
                        return
                    raise LocalReadFailed("short", f"{loc.path}: v{loc.version} holds {have} of {len(part)} bytes")
                except LocalReadFailed as exc:
                    self._fell_back(piece, exc)
                    path = choose_read_path(to_gpu, False, support, gdr_region)
            offset = index * layout.chunk_size + within
            if path is ReadPath.NETWORK_HOST:
                assert isinstance(part, memoryview)
                have = await self.storage.read(ino, layout, offset, part)
            else:
                assert isinstance(part, DeviceSpan)
                gpu = self._gpu()
                with gpu.staging(len(part)) as staging:
                    if path is ReadPath.NETWORK_GDR:
                        have = await self._read_direct(ino, layout, offset, part, staging)
                    else:
                        have = await self.storage.read(ino, layout, offset, staging)
                        await self._workers.run(lambda: gpu.to_device(part, staging))
            if have < len(part):
                raise ShortObject(f"chunk {index} of inode {ino} holds {have} of the {len(part)} bytes its object's"
                                  " size says")

    async def _read_direct(self, ino: int, layout: LayoutLike, offset: int, part: DeviceSpan,
                           staging: memoryview) -> int:
        """GPUDirect RDMA: the serving replica's server writes the bytes straight into ``part`` where its connection
        has an RDMA link that took the region, else they come into ``staging`` and are copied. No CRC is computed
        here: the server checks every block's CRC32C before it answers, as for any network read, and the fabric's
        own per-packet CRC (InfiniBand/RoCE ICRC) guards the transfer, as TCP's checksum does the host path."""
        assert part.region is not None
        target = DirectInto(part.region, part.ptr - part.region.addr, len(part), staging)
        await self.storage.read_direct(ino, layout, offset, target)
        gpu, n = self._gpu(), target.filled
        if target.written and target.written != n:
            raise KvfsError(f"chunk server wrote {target.written} bytes into GPU memory for a {n}-byte answer",
                            errno.EIO)
        start = n if target.written else 0  # written: only a hole past the chunk's end is left to fill
        GDR_BYTES.inc(target.written)
        if start < len(part):
            staging[n:] = bytes(len(part) - n)
            await self._workers.run(lambda: gpu.to_device(part[start:], staging[start:]))
        return n

    async def _read_located(self, path: ReadPath, loc: ChunkLocation, within: int, part: DeviceSpan) -> int:
        """A GPU destination from this host's replica (host ones go through :meth:`_read_local`); returns the
        bytes the located version held."""
        if path is ReadPath.LOCAL_GDS:
            return await self._workers.run(lambda: self._gds_checked(loc, within, part))
        gpu = self._gpu()
        with gpu.staging(len(part)) as staging:
            return await self._workers.run(lambda: self._staged_checked(loc, within, part, staging))

    # ------------------------------------------------------------------- in worker threads
    def _staged_checked(self, loc: ChunkLocation, within: int, out: DeviceSpan, staging: memoryview) -> int:
        have = self.files.read_checked(loc, within, staging)
        LOCAL_BYTES.inc(have)
        self._gpu().to_device(out, staging)
        return have

    def _gds_checked(self, loc: ChunkLocation, within: int, out: DeviceSpan) -> int:
        """``out`` <- the same bytes, read by KvikIO straight into GPU memory; the CRCs are checked on a copy back
        to a pinned host buffer (bytes around the range from the file), as nothing on the GPU computes CRC32C."""
        gpu = self._gpu()
        have, lo, hi = self.files.extent(loc, within, len(out))
        if have < len(out):
            gpu.to_device(out[have:], memoryview(bytes(len(out) - have)))
        if not have:
            return 0
        got = gpu.gds_read(loc.path, out[:have], loc.file_offset + within)
        if got != have:
            raise LocalReadFailed("short", f"{loc.path}: short GPU read ({got} of {have} bytes)")
        with gpu.staging(hi - lo) as scratch:
            head, middle, tail = scratch[: within - lo], scratch[within - lo : within - lo + have], \
                scratch[within - lo + have :]
            self.files.pread(loc, lo, [head], len(head))
            self.files.pread(loc, within + have, [tail], len(tail))
            gpu.to_host(middle, out[:have])
            self.files.check(loc, [(lo, scratch)], lo, hi)
        GDS_BYTES.inc(have)
        return have
