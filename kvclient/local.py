"""Reading an object's chunks into a host or GPU buffer: straight from a replica's slot file where one lies on this
host (short-circuit), else from the chunk servers.

For each chunk the reader asks a chunk server on this host where the version a read would serve lies
(``StorageClient.locate``, ``chunk.locate``): the server picks the version by the chain's rules, as for a read,
and keeps it pinned (its slot not reused) until a deadline on the host's monotonic clock. The reader then reads
the slot file itself (``preadv`` into the caller's buffer, or KvikIO into GPU memory), checks every block's CRC32C
and that the deadline has not passed (:mod:`kvfs.chunkserver.shortcircuit`, shared with the mount), and otherwise
reads that chunk over the network instead (chunkserver/README.md, "Short-circuit reads", has the argument). Which way
each chunk goes is :func:`kvfs.kvclient.gpu.choose_read_path`.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import trio
from prometheus_client import Counter

from kvfs.aio import Workers, one_error
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

    def close(self) -> None:
        self.files.close()

    async def read(self, ino: int, layout: LayoutLike, size: int, dest: memoryview | DeviceSpan) -> None:
        """Fill ``dest[:size]`` with the file's first ``size`` bytes."""
        async with one_error(), trio.open_nursery() as nursery:
            for index, within, at in split_range(0, size, layout.chunk_size):
                part = dest[at : at + min(layout.chunk_size - within, size - at)]
                nursery.start_soon(self._read_chunk, ino, layout, index, within, part)

    async def _read_chunk(self, ino: int, layout: LayoutLike, index: int, within: int,
                          part: memoryview | DeviceSpan) -> None:
        async with self._limit:
            to_gpu = isinstance(part, DeviceSpan)
            support = self._gpu_support() if to_gpu else GpuSupport()
            loc = None
            if self.short_circuit:
                loc = await self.storage.locate(ino, layout, index, within, len(part), self.boot_id)
            gdr_region = isinstance(part, DeviceSpan) and part.region is not None
            path = choose_read_path(to_gpu, loc is not None, support, gdr_region)
            if loc is not None:
                try:
                    await self._read_located(path, loc, within, part)
                    return
                except LocalReadFailed as exc:
                    FALLBACKS.labels(exc.reason).inc()
                    if exc.reason == "permission":  # the targets of this host are closed to this user: stop asking
                        self.short_circuit = False
                        self.off_reason = exc.message
                    log.warning("short-circuit read of chunk %d of inode %d: %s; reading it over the network",
                                index, ino, exc.message)
                    path = choose_read_path(to_gpu, False, support, gdr_region)
            offset = index * layout.chunk_size + within
            if path is ReadPath.NETWORK_HOST:
                assert isinstance(part, memoryview)
                await self.storage.read(ino, layout, offset, part)
                return
            assert isinstance(part, DeviceSpan)
            gpu = self._gpu()
            with gpu.staging(len(part)) as staging:
                if path is ReadPath.NETWORK_GDR:
                    await self._read_direct(ino, layout, offset, part, staging)
                else:
                    await self.storage.read(ino, layout, offset, staging)
                    await self._workers.run(lambda: gpu.to_device(part, staging))

    async def _read_direct(self, ino: int, layout: LayoutLike, offset: int, part: DeviceSpan,
                           staging: memoryview) -> None:
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

    async def _read_located(self, path: ReadPath, loc: ChunkLocation, within: int,
                            part: memoryview | DeviceSpan) -> None:
        if path is ReadPath.LOCAL_HOST:
            assert isinstance(part, memoryview)
            await self._workers.run(lambda: self._pread_checked(loc, within, part))
        elif path is ReadPath.LOCAL_GDS:
            assert isinstance(part, DeviceSpan)
            await self._workers.run(lambda: self._gds_checked(loc, within, part))
        else:
            assert isinstance(part, DeviceSpan)
            gpu = self._gpu()
            with gpu.staging(len(part)) as staging:
                await self._workers.run(lambda: (self._pread_checked(loc, within, staging),
                                                 gpu.to_device(part, staging)))

    # ------------------------------------------------------------------- in worker threads
    def _pread_checked(self, loc: ChunkLocation, within: int, out: memoryview) -> None:
        LOCAL_BYTES.inc(self.files.read_checked(loc, within, out))

    def _gds_checked(self, loc: ChunkLocation, within: int, out: DeviceSpan) -> None:
        """``out`` <- the same bytes, read by KvikIO straight into GPU memory; the CRCs are checked on a copy back
        to a pinned host buffer (bytes around the range from the file), as nothing on the GPU computes CRC32C."""
        gpu = self._gpu()
        have, lo, hi = self.files.extent(loc, within, len(out))
        if have < len(out):
            gpu.to_device(out[have:], memoryview(bytes(len(out) - have)))
        if not have:
            return
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
