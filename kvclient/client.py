"""KVClient: a put/get library for KV-cache blocks over kvfs that bypasses FUSE (see kvclient/README.md).

Entries are ordinary files under ``/kvcache/<namespace>/<key>``. The client talks to ``kvfs meta`` (RemoteMeta)
and the chunk servers (StorageClient) directly, from a trio event loop in its own thread; public calls block on
that loop and are safe from any number of threads. :class:`AsyncKVClient` gives asyncio callers the same calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import errno
import os
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import trio
from prometheus_client import Counter, Histogram

from kvfs.chunkserver.client import StorageClient
from kvfs.chunkserver.protocol import CHUNK_LIMITS
from kvfs.chunkserver.shortcircuit import enabled_by_environment
from kvfs.config import ClusterConfig, load_config
from kvfs.craq.client import MgmtdClient
from kvfs.errors import KvfsError
from kvfs.meta.client import RemoteMeta
from kvfs.meta.posix import NAME_MAX, ROOT_INO
from kvfs.meta.types import Caller, Commit, Found
from kvfs.kvclient.buffers import DeviceSpan, RegisteredBuffer, as_buffer, host_values
from kvfs.kvclient.evict import CAPACITY_XATTR, TTL_XATTR, AccessLog, EvictionPolicy, Maintenance
from kvfs.kvclient.gpu import GpuBackend, GpuSupport, probe
from kvfs.kvclient.local import ChunkReader, ObjectRead
from kvfs.kvclient.metabatch import TEMP_PREFIX, per_batch
from kvfs.rpc import RpcClient
from kvfs.transport import shm
from kvfs.transport.direct import DirectRegion
from kvfs.transport.errors import UnregisteredMemory

ROOT_DIR = b"kvcache"
#: Seconds a ``batch_exists``/``prefix_hits`` answer stands in for the lookup of a get of the same key: engines
#: ask which blocks are there, then get them at once, and the second metadata round trip would only repeat the
#: first. Within it a get may return a value another client removed meanwhile (README, "Semantics").
FOUND_FOR = 1.0
#: The most such answers kept; the oldest go first.
KEEP_FOUND = 8192

HITS = Counter("kvfs_kvclient_hits", "kvclient gets that found their key")
MISSES = Counter("kvfs_kvclient_misses", "kvclient gets whose key was absent")
BYTES_READ = Counter("kvfs_kvclient_read_bytes", "bytes kvclient read into callers' buffers")
BYTES_WRITTEN = Counter("kvfs_kvclient_written_bytes", "bytes kvclient wrote (new objects only)")
BATCH_SECONDS = Histogram("kvfs_kvclient_batch_seconds", "kvclient batch call latency", ["op"])


class InvalidKey(KvfsError):
    """A key that cannot name an entry: empty, longer than 255 bytes encoded, or holding '/' or NUL."""

    default_errno = errno.EINVAL


class BufferTooSmall(KvfsError):
    """The caller's buffer cannot hold the whole object (nothing is read)."""

    default_errno = errno.EMSGSIZE


class ClientClosed(KvfsError):
    default_errno = errno.EBADF


class ValueTooLarge(KvfsError):
    """A value larger than the namespace's whole capacity (``capacity_bytes``): it could never be kept."""

    default_errno = errno.EFBIG


def _key(key: str | bytes) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    elif not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"a key is str or bytes, not {type(key).__name__}")
    key = bytes(key)
    if not key:
        raise InvalidKey("empty key")
    if len(key) > NAME_MAX:
        raise InvalidKey(f"key of {len(key)} bytes; at most {NAME_MAX}", errno.ENAMETOOLONG)
    if b"/" in key or b"\0" in key:
        raise InvalidKey("a key may not hold '/' or NUL")
    if key in (b".", b"..") or key.startswith(TEMP_PREFIX):
        raise InvalidKey(f"reserved key {key!r}")
    return key


class _Core:
    """The trio side: everything here runs on the client's event loop."""

    def __init__(self, meta: RemoteMeta, storage: StorageClient, reader: ChunkReader, namespace: bytes,
                 parallel: int) -> None:
        self.meta = meta
        self.storage = storage
        self.reader = reader
        self.namespace = namespace
        self.caller = Caller(os.getuid(), os.getgid(), client=meta.client_id)
        self.limit = trio.CapacityLimiter(parallel)
        self._dir: int | None = None
        self._dir_lock = trio.Lock()
        self.accesses = AccessLog()
        #: key -> what an exists call found for it, and until when (monotonic) a get may use that; oldest first
        self._found: dict[bytes, tuple[Found, float]] = {}

    async def _subdir(self, parent: int, name: bytes) -> int:
        try:
            return (await self.meta.lookup(self.caller, parent, name)).ino
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
        try:
            return (await self.meta.mkdir(self.caller, parent, name, 0o755)).ino
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise
            return (await self.meta.lookup(self.caller, parent, name)).ino

    async def ns_dir(self, create: bool) -> int | None:
        if self._dir is not None:
            return self._dir
        async with self._dir_lock:
            if self._dir is None:
                if create:
                    self._dir = await self._subdir(await self._subdir(ROOT_INO, ROOT_DIR), self.namespace)
                else:
                    try:
                        self._dir = (await self.meta.resolve(self.caller, b"/" + ROOT_DIR + b"/" + self.namespace)).ino
                    except OSError as e:
                        if e.errno != errno.ENOENT:
                            raise
        return self._dir

    async def put_many(self, items: Sequence[tuple[bytes, memoryview]]) -> list[int]:
        """Write-once puts in two metadata round trips per batch (``begin_puts``, ``commit_puts``), the chunk
        writes in between in parallel: 0 or -errno per item. A key that exists, or that another put commits
        first (-EEXIST from the commit), keeps its value and counts as success."""
        d = await self.ns_dir(create=True)
        assert d is not None
        temps = [TEMP_PREFIX + secrets.token_hex(8).encode() for _ in items]
        opened = await per_batch(self.meta.begin_puts, self.caller, d,
                                 [(key, temp) for (key, _), temp in zip(items, temps)], 0o644)
        results = [0] * len(items)
        begun = {i: Commit(temps[i], items[i][0], o.attr.ino, o.session, len(items[i][1]))
                 for i, o in enumerate(opened) if o is not None}
        failed = set(begun)  # until committed; their temporary files and sessions go in the end
        try:
            nonempty = [i for i in begun if begun[i].length]
            # one chain round per chain for the small blocks, every replica holding them when it returns
            writes = [(begun[i].ino, opened[i].layout, [(0, items[i][1])]) for i in nonempty]  # type: ignore[union-attr]
            for i, error in zip(nonempty, await self.storage.write_many(writes)):
                if error is not None:
                    results[i] = -(error.errno or errno.EIO)
            ready = [i for i in begun if results[i] == 0]
            for i, r in zip(ready, await per_batch(self.meta.commit_puts, self.caller, d, [begun[i] for i in ready])):
                if r == 0:
                    BYTES_WRITTEN.inc(begun[i].length)
                if r in (0, -errno.EEXIST):  # EEXIST: another put of this key won; meta removed our file
                    failed.discard(i)
                else:
                    results[i] = r
        finally:
            if failed:
                with trio.CancelScope(shield=True):
                    await self._abandon(d, [begun[i] for i in failed])
        return results

    async def _abandon(self, d: int, puts: list[Commit]) -> None:
        """Remove the temporary files of puts that will not commit and end their write sessions, so their chunks
        are collected now rather than when this client goes; what fails here is left to the orphan sweep."""
        try:
            await per_batch(self.meta.batch_unlink, self.caller, d, [p.temp for p in puts])
            await self.meta.close_sessions(self.caller, [(p.ino, p.session, None) for p in puts])
        except OSError:
            pass

    async def lookup_many(self, keys: Sequence[bytes]) -> list[Found | None]:
        """One ``batch_lookup`` per MAX_BATCH keys: attributes and layout of each, or None."""
        d = await self.ns_dir(create=False)
        if d is None:
            return [None] * len(keys)
        return await per_batch(self.meta.batch_lookup, self.caller, d, keys)

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`lookup_many`, its answers kept for a get that follows within FOUND_FOR seconds."""
        found = await self.lookup_many(keys)
        until = time.monotonic() + FOUND_FOR
        for key, f in zip(keys, found):
            self._found.pop(key, None)  # re-inserted last: the dict stays oldest first
            if f is not None:
                self._found[key] = (f, until)
        while len(self._found) > KEEP_FOUND:
            del self._found[next(iter(self._found))]
        return [f is not None for f in found]

    async def read_many(self, items: Sequence[tuple[bytes, memoryview | DeviceSpan]]) -> list[int | OSError]:
        """Per item: the bytes read, -ENOENT, or the error. One metadata round trip for the keys no exists call
        answered within FOUND_FOR seconds, then every object's chunks together (``ChunkReader.read_many``). A
        key whose read fails is looked up again: removed meanwhile, it is -ENOENT; put again (or a kept answer
        gone stale), it is read again; still the same file, the read's error stands."""
        return await self._read_keys([key for key, _ in items], lambda i, found: items[i][1])

    async def _read_keys(self, keys: Sequence[bytes],
                         out_for: Callable[[int, Found | None], memoryview | DeviceSpan]) -> list[int | OSError]:
        """:meth:`read_many`, key ``i`` read into ``out_for(i, found)``: asked again for a key looked up again."""
        now = time.monotonic()
        kept = [self._found.get(key) for key in keys]
        found: list[Found | None] = [k[0] if k is not None and k[1] > now else None for k in kept]
        ask = [i for i, f in enumerate(found) if f is None]
        for i, f in zip(ask, await self.lookup_many([keys[i] for i in ask]) if ask else []):
            found[i] = f
        results = await self._read_found([(key, f, out_for(i, f)) for i, (key, f) in enumerate(zip(keys, found))])
        failed = [i for i, r in enumerate(results) if isinstance(r, OSError)]
        if failed:
            again: list[tuple[int, Found | None]] = []
            for i, f in zip(failed, await self.lookup_many([keys[i] for i in failed])):
                self._found.pop(keys[i], None)
                if f is None or f.attr.ino != found[i].attr.ino:  # type: ignore[union-attr]
                    again.append((i, f))
            for (i, _), r in zip(again, await self._read_found([(keys[i], f, out_for(i, f)) for i, f in again])):
                results[i] = r
        return results

    async def get_many(self, items: Sequence[tuple[bytes, memoryview | DeviceSpan]]) -> list[int]:
        """Batch get: :meth:`read_many`, an error as -errno."""
        return [r if isinstance(r, int) else -(r.errno or errno.EIO) for r in await self.read_many(items)]

    async def _read_found(self, items: Sequence[tuple[bytes, Found | None, memoryview | DeviceSpan]]
                          ) -> list[int | OSError]:
        """Per item: the bytes read, -ENOENT for a key not found, or the error (BufferTooSmall, ShortObject, ...)."""
        results: list[int | OSError] = [0] * len(items)
        reads: list[tuple[int, ObjectRead]] = []
        for i, (key, found, out) in enumerate(items):
            if found is None:
                MISSES.inc()
                results[i] = -errno.ENOENT
            elif found.attr.size > len(out):
                results[i] = BufferTooSmall(f"object {key!r} is {found.attr.size} bytes; the buffer holds {len(out)}")
            else:
                attr = found.attr
                layout = found.layout or await self.meta.get_layout(self.caller, attr.ino)
                reads.append((i, ObjectRead(attr.ino, layout, attr.size, attr.mtime_ns, out)))
        errors = await self.reader.read_many([read for _, read in reads])
        for (i, read), error in zip(reads, errors):
            if error is not None:
                results[i] = error
                continue
            results[i] = read.size
            HITS.inc()
            BYTES_READ.inc(read.size)
            self.accesses.record(items[i][0])
        return results

    async def remove_many(self, keys: Sequence[bytes]) -> list[int]:
        for key in keys:
            self._found.pop(key, None)
        d = await self.ns_dir(create=False)
        if d is None:
            return [-errno.ENOENT] * len(keys)
        return await per_batch(self.meta.batch_unlink, self.caller, d, keys)

    async def get_into(self, key: bytes, out: memoryview | DeviceSpan) -> int:
        (result,) = await self.read_many([(key, out)])
        if isinstance(result, OSError):
            raise result
        return result

    async def get(self, key: bytes) -> bytes | None:
        """:meth:`get_into` a buffer of the object's size, made once the key is found (again, if looked up again)."""
        bufs: list[bytearray] = []

        def out_for(i: int, found: Found | None) -> memoryview:
            bufs.append(bytearray(found.attr.size if found is not None else 0))
            return memoryview(bufs[-1])

        (result,) = await self._read_keys([key], out_for)
        if isinstance(result, OSError):
            raise result
        return bytes(bufs[-1]) if result >= 0 else None

    async def remove(self, key: bytes) -> int:
        self._found.pop(key, None)
        d = await self.ns_dir(create=False)
        if d is None:
            return -errno.ENOENT
        try:
            await self.meta.unlink(self.caller, d, key)
            return 0
        except OSError as e:
            if e.errno == errno.ENOENT:
                return -errno.ENOENT
            raise

    async def batch(self, fn: Callable[..., Awaitable[Any]], items: Sequence[tuple]) -> list[Any]:
        """Run ``fn(*item)`` for every item concurrently; a per-item OSError becomes ``-errno``."""
        results: list[Any] = [0] * len(items)

        async def one(i: int, args: tuple) -> None:
            try:
                r = await fn(*args)
                results[i] = 0 if r is None else r
            except OSError as e:
                results[i] = -(e.errno or errno.EIO)

        async with trio.open_nursery() as nursery:
            for i, args in enumerate(items):
                nursery.start_soon(one, i, args)
        return results


class KVClient:
    """Blocking, thread-safe client; one trio loop in a background thread does the I/O."""

    def __init__(self, config: ClusterConfig, namespace: str | bytes, *, parallel: int = 16,
                 short_circuit: bool | None = None, capacity_bytes: int | None = None, ttl: float | None = None,
                 evict: bool | None = None, evict_interval: float = 10.0, orphan_grace: float = 600.0,
                 access_flush: float = 1.0) -> None:
        """``short_circuit``: read replicas on this host from their files (default ``$KVFS_SHORT_CIRCUIT``, else
        on); it is off by itself where this user cannot open the chunk servers' files. ``capacity_bytes`` and
        ``ttl`` (seconds) limit the namespace for this client, over the limits stored with it (:meth:`set_limits`,
        kvclient/evict.py); ``evict``: whether this client sweeps it every ``evict_interval`` seconds (by default
        while a limit applies), removing also temporary files of dead puts older than ``orphan_grace`` seconds;
        reads are recorded for the LRU order every ``access_flush`` seconds."""
        self.namespace = _key(namespace)
        if not config.meta or not config.mgmtd:
            raise KvfsError("the config must list meta = [...] and mgmtd = [...] addresses")
        self._config = config
        self._parallel = parallel
        self._policy = EvictionPolicy(capacity_bytes, ttl, orphan_grace, evict_interval)
        self._sweep = evict
        self._upkeep: Maintenance | None = None
        self._access_flush = access_flush
        if short_circuit is None:
            short_circuit = enabled_by_environment()
        self._short_circuit = short_circuit
        self._shared_memory = config.resolved_shared_memory()
        self._gpu_lock = threading.Lock()
        self._gpu_support: GpuSupport | None = None
        self._gpu: GpuBackend | None = None
        self._registered: dict[int, RegisteredBuffer] = {}
        self._closed = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._core: _Core | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvclient-trio", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._closed = True
            raise self._error

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], namespace: str | bytes, **kw: Any) -> KVClient:
        """A client for the cluster a client config names (``kvfs up`` writes DATA/client.toml)."""
        return cls(load_config(path), namespace, **kw)

    # ---------------------------------------------------------------------------- the loop thread
    def _run(self) -> None:
        config = self._config

        async def main() -> None:
            t = config.timeouts
            try:
                rpc_cm = RpcClient(config.resolved_token(), limits=CHUNK_LIMITS, connect_timeout=t.connect,
                                   call_timeout=t.call, transport=config.resolved_transport(),
                                   shared_memory=config.resolved_shared_memory())
                async with rpc_cm as rpc:
                    meta = RemoteMeta(rpc, config.meta)
                    storage = StorageClient(rpc, MgmtdClient(rpc, config.mgmtd), call_timeout=t.call)
                    reader = ChunkReader(storage, short_circuit=self._short_circuit, gpu_support=self.gpu_support,
                                         gpu=self._gpu_backend, parallel=self._parallel)
                    core = self._core = _Core(meta, storage, reader, self.namespace, self._parallel)
                    upkeep = self._upkeep = Maintenance(meta, core.caller, lambda: core.ns_dir(create=False),
                                                        core.accesses, self._policy, access_flush=self._access_flush)
                    with contextlib.suppress(OSError):  # meta unreachable for now: each sweep reads them again
                        await upkeep.refresh()
                    self._token = trio.lowlevel.current_trio_token()
                    self._stop = trio.Event()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(meta.keep_alive)
                        nursery.start_soon(functools.partial(upkeep.run, sweep=self._sweep))
                        nursery.start_soon(shm.give_back_idle, 2.0, 5.0)  # put buffers back 5 s after the last put
                        self._ready.set()
                        await self._stop.wait()
                        with trio.move_on_after(self._config.timeouts.call), contextlib.suppress(OSError):
                            await upkeep.flush()  # the last reads count for the LRU order too
                        with trio.move_on_after(self._config.timeouts.call):
                            for buf in list(self._registered.values()):
                                if buf.span is not None and buf.span.region is not None:
                                    await buf.span.region.close()  # no rkey of the caller's memory outlives us
                        nursery.cancel_scope.cancel()
                    rpc.close()
            except BaseException as exc:  # noqa: BLE001 - reported to the constructor
                if not self._ready.is_set():
                    self._error = exc
                raise
            finally:
                self._ready.set()

        try:
            trio.run(main)
        except BaseException:  # noqa: BLE001 - already handed to the constructor, or a shutdown
            pass

    def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        if self._closed or self._token is None:
            raise ClientClosed("the client is closed")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise ClientClosed("the client is closed") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(30)
        if self._core is not None:
            self._core.reader.close()
        if self._gpu is not None:
            self._gpu.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------- the API
    def capabilities(self) -> dict[str, Any]:
        """What this client can do here, each with the reason where it cannot; probing the GPU imports a GPU
        library only on a host with an NVIDIA device."""
        reader = self._core.reader if self._core is not None and not self._closed else None
        gpu = self.gpu_support()
        gdr, gdr_reason = self._gdr()
        return {
            "transports": ["tcp", *(["shm"] if self._config.resolved_shared_memory() else [])],
            "transport": self._config.resolved_transport(),
            "shm_reads": self._config.resolved_shared_memory(),  # what is not short-circuit, from this host's servers
            "short_circuit": bool(reader and reader.short_circuit),
            "short_circuit_reason": reader.off_reason if reader else "the client is closed",
            "gpu": gpu.gpu and gpu.copier is not None,
            "gpu_copier": gpu.copier,
            "gds": gpu.gds,
            "gds_direct": gpu.gds_direct,
            "gpu_reason": gpu.reason,
            "gdr": gdr,  # "dmabuf" or "peer-memory": how registered GPU memory is offered to the NIC; None: not
            "gdr_reason": gdr_reason,
        }

    def _gdr(self) -> tuple[str | None, str]:
        """How GPU memory registered here is offered to the NIC (``"dmabuf"``/``"peer-memory"``), or None and why."""
        support = self.gpu_support()
        if support.gdr is not None and self._config.resolved_transport() == "tcp":
            return None, "no GPUDirect RDMA: the transport is 'tcp'"
        return support.gdr, support.gdr_reason or support.reason

    def gpu_support(self) -> GpuSupport:
        """What this process can do with GPU memory (probed once)."""
        with self._gpu_lock:
            if self._gpu_support is None:
                self._gpu_support = probe()
            return self._gpu_support

    def _gpu_backend(self) -> GpuBackend:
        support = self.gpu_support()
        with self._gpu_lock:
            if self._gpu is None:
                self._gpu = GpuBackend(support)
            return self._gpu

    def register_buffer(self, ptr: int, size: int, device: str = "cpu") -> RegisteredBuffer:
        """Register memory at a raw address (host memory for ``"cpu"``, GPU memory for ``"cuda"``/``"cuda:N"``);
        pass the returned object as a value or an output buffer. Bad arguments raise ValueError. GPU memory is
        also opened for GPUDirect RDMA where ``capabilities()["gdr"]`` says how: reads from remote replicas into it,
        or into any GPU array inside it, are then RDMA-written there by the chunk servers."""
        buf = RegisteredBuffer(ptr, size, device)
        if buf.span is not None and self._gdr()[0] is not None:
            buf.span.region = self._gpu_backend().direct_region(ptr, size)
        self._registered[ptr] = buf
        return buf

    def unregister_buffer(self, buf: RegisteredBuffer) -> None:
        """Forget a registration. A GPU region is deregistered from the NIC once the reads in flight into it end;
        later reads into it raise UnregisteredMemory (EFAULT) rather than let a server write into freed memory."""
        self._registered.pop(buf.ptr, None)
        region = None if buf.span is None else buf.span.region
        if region is not None and not region.closed and not self._closed:  # closing the client closed it
            self._call(region.close)

    def _region_of(self, span: DeviceSpan) -> DirectRegion | None:
        """The open GPUDirect RDMA region ``span`` lies in; UnregisteredMemory for one that was unregistered."""
        region = span.region
        if region is None:
            region = next((b.span.region for b in list(self._registered.values()) if b.span is not None
                           and b.span.region is not None and b.span.region.contains(span.ptr, span.nbytes)), None)
        if region is not None and region.closed:
            raise UnregisteredMemory(f"{region!r} was unregistered")
        return region

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("the client is closed")

    def _values(self, values: Sequence[Any]) -> list[memoryview]:
        """The values' bytes in host memory (see :func:`host_values`). A value larger than the namespace's capacity
        could never be kept: ValueTooLarge."""
        bufs = [as_buffer(value, writable=False) for value in values]
        assert self._upkeep is not None  # made before the constructor returns
        capacity = self._upkeep.policy.capacity_bytes
        for buf in bufs:
            if capacity is not None and len(buf) > capacity:
                raise ValueTooLarge(f"a value of {len(buf)} bytes; the namespace holds at most {capacity}")
        return host_values(bufs, lambda host, span: self._gpu_backend().to_host(host, span),
                           shm.SHARED if self._shared_memory else None)

    def _out(self, out: Any) -> memoryview | DeviceSpan:
        """An output buffer; for GPU memory the GPU backend is set up first, so a host without one raises
        GpuUnavailable before anything is read."""
        buf = as_buffer(out, writable=True)
        if isinstance(buf, DeviceSpan):
            self._gpu_backend()
            buf = DeviceSpan(buf.ptr, buf.nbytes, buf.device, buf.owner, self._region_of(buf))
        return buf

    def put(self, key: str | bytes, value: Any) -> None:
        self._check_open()
        (result,) = self._call(self._core.put_many, [(_key(key), *self._values([value]))])  # type: ignore[union-attr]
        if result < 0:
            raise KvfsError(f"put of {key!r} failed: {os.strerror(-result)}", -result)

    def batch_put(self, keys: Sequence[str | bytes], values: Sequence[Any]) -> list[int]:
        """0 or -errno per key; bad keys or values raise before anything is written."""
        self._check_open()
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        items = list(zip(map(_key, keys), self._values(values)))
        with BATCH_SECONDS.labels("put").time():
            return self._call(self._core.put_many, items)  # type: ignore[union-attr]

    def get_into(self, key: str | bytes, out: Any) -> int:
        """Bytes read into ``out`` (no copy on the way), or -ENOENT; a too-small buffer raises BufferTooSmall."""
        self._check_open()
        k, view = _key(key), self._out(out)
        return self._call(self._core.get_into, k, view)  # type: ignore[union-attr]

    def batch_get_into(self, keys: Sequence[str | bytes], outs: Sequence[Any]) -> list[int]:
        """Bytes read per key, or -ENOENT, -EMSGSIZE (buffer too small), -errno."""
        self._check_open()
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        items = [(_key(k), self._out(o)) for k, o in zip(keys, outs)]
        with BATCH_SECONDS.labels("get").time():
            return self._call(self._core.get_many, items)  # type: ignore[union-attr]

    def get(self, key: str | bytes) -> bytes | None:
        self._check_open()
        return self._call(self._core.get, _key(key))  # type: ignore[union-attr]

    def batch_exists(self, keys: Sequence[str | bytes]) -> list[bool]:
        self._check_open()
        items = [_key(k) for k in keys]
        with BATCH_SECONDS.labels("exists").time():
            return self._call(self._core.exists_many, items)  # type: ignore[union-attr]

    def prefix_hits(self, keys: Sequence[str | bytes]) -> int:
        """How many leading keys are present (the usable prefix of a token sequence's blocks)."""
        n = 0
        for present in self.batch_exists(keys):
            if not present:
                break
            n += 1
        return n

    def remove(self, key: str | bytes) -> int:
        """0, or -ENOENT if there was no such key."""
        self._check_open()
        return self._call(self._core.remove, _key(key))  # type: ignore[union-attr]

    def batch_remove(self, keys: Sequence[str | bytes]) -> list[int]:
        self._check_open()
        items = [_key(k) for k in keys]
        with BATCH_SECONDS.labels("remove").time():
            return self._call(self._core.remove_many, items)  # type: ignore[union-attr]


    def set_limits(self, capacity_bytes: int | None = None, ttl: float | None = None) -> None:
        """Store the namespace's limits with it, for every client of it (its directory's ``user.kvfs.capacity_bytes``
        and ``user.kvfs.ttl``; None removes one). A client made with a limit of its own keeps that one."""
        self._check_open()
        EvictionPolicy(capacity_bytes, ttl)  # ValueError for a limit that is not positive
        self._call(self._store_limits, capacity_bytes, ttl)

    async def _store_limits(self, capacity_bytes: int | None, ttl: float | None) -> None:
        core, upkeep = self._core, self._upkeep
        assert core is not None and upkeep is not None
        directory = await core.ns_dir(create=True)
        assert directory is not None
        for name, value in ((CAPACITY_XATTR, capacity_bytes), (TTL_XATTR, ttl)):
            if value is not None:
                await core.meta.setxattr(core.caller, directory, name, str(value).encode())
                continue
            try:
                await core.meta.removexattr(core.caller, directory, name)
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise
        await upkeep.refresh()


class AsyncKVClient:
    """The same API for asyncio callers: each call runs the blocking client in a worker thread."""

    def __init__(self, client: KVClient, *, workers: int = 8) -> None:
        self.client = client
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvclient-aio")

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], namespace: str | bytes, **kw: Any) -> AsyncKVClient:
        return cls(KVClient.from_config(path, namespace, **kw))

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def close(self) -> None:
        await self._run(self.client.close)
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def capabilities(self) -> dict[str, Any]:
        return self.client.capabilities()

    async def put(self, key, value): return await self._run(self.client.put, key, value)  # noqa: E704
    async def batch_put(self, keys, values): return await self._run(self.client.batch_put, keys, values)  # noqa: E704
    async def get_into(self, key, out): return await self._run(self.client.get_into, key, out)  # noqa: E704
    async def batch_get_into(self, keys, outs): return await self._run(self.client.batch_get_into, keys, outs)  # noqa: E704,E501
    async def get(self, key): return await self._run(self.client.get, key)  # noqa: E704
    async def batch_exists(self, keys): return await self._run(self.client.batch_exists, keys)  # noqa: E704
    async def prefix_hits(self, keys): return await self._run(self.client.prefix_hits, keys)  # noqa: E704
    async def remove(self, key): return await self._run(self.client.remove, key)  # noqa: E704
    async def batch_remove(self, keys): return await self._run(self.client.batch_remove, keys)  # noqa: E704

    async def set_limits(self, capacity_bytes: int | None = None, ttl: float | None = None) -> None:
        await self._run(self.client.set_limits, capacity_bytes, ttl)
