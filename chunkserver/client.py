"""The storage client: file byte ranges -> chunks -> chains -> chunk servers.

Shared by the FUSE mount and kvclient (it implements :class:`kvfs.storage.FileStorage`). It owns everything a
caller should not see: placement (:func:`kvfs.chunkserver.placement.chunk_chain`), routing (refreshed from mgmtd when a
server says the caller's chain version is stale), spreading reads over serving replicas, writes to chain heads,
parallel I/O across chunks with a bounded window, retries across chain changes and failed targets, and
receiving read data straight into the caller's buffer.

Writes carry ``(client_id, request_id)``; a retry reuses the ids, so a write whose answer was lost is applied
once. One write per chunk is in flight at a time from one client (the CRAQ head requires it).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import ipaddress
import itertools
import logging
import random
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio
from crc32c import crc32c

from kvfs.chunkserver import protocol as p
from kvfs.craq.cluster import RoutingSnapshot
from kvfs.craq.messages import ChainConfig, ChunkId, TargetState, WriteReq
from kvfs.craq.client import MgmtdClient
from kvfs.aio import one_error
from kvfs.errors import (ChecksumMismatch, ConnectionLost, KvfsError, RpcTimeout, ServiceUnavailable, StaleRouting,
                         from_wire)
from kvfs.rpc import RpcClient
from kvfs.storage import Buffer, LayoutLike
from kvfs.transport.direct import DirectInto
from kvfs.wire import Empty
from kvfs.chunkserver.placement import chunk_chain

log = logging.getLogger("kvfs.storage")

#: Failures after which the same operation may succeed elsewhere or a little later.
_TRANSIENT = (ServiceUnavailable, ConnectionLost, RpcTimeout, StaleRouting)
_RETRY_ERRNOS = {errno.EAGAIN, errno.ESTALE, errno.EBADMSG, errno.ETIMEDOUT, errno.ECONNRESET, errno.EHOSTUNREACH}


#: Target states of a chunk server that is up, so that a removal reaches it.
_UP = (TargetState.SERVING, TargetState.SYNCING, TargetState.WAITING)
#: Chunks a truncation empties per chain round while a chunk server is down (StorageClient.truncate).
EMPTIED_AT_ONCE = 4096


def _may_be_left_out(routing: RoutingSnapshot, address: str) -> bool:
    """Whether a whole-cluster call may go on without the chunk server at ``address``: mgmtd has taken every
    target of it offline, and each of their chains still has a serving target, whose resync of the returning
    target drops what it missed (craq/member.py, rule 10)."""
    nodes = {node for node, a in routing.addresses.items() if a == address}
    chains = [c for c in routing.chains if any(t.node_id in nodes for t in c.targets)]
    return all(t.state is TargetState.OFFLINE for c in chains for t in c.targets if t.node_id in nodes) and all(
        any(t.state is TargetState.SERVING for t in c.targets) for c in chains)


def _transient(exc: KvfsError) -> bool:
    """Whether the same operation may succeed elsewhere or a little later."""
    return isinstance(exc, _TRANSIENT) or exc.errno in _RETRY_ERRNOS


@dataclass(eq=False)
class _ChunkWrite:
    """One chunk's update in a :meth:`StorageClient.write_many`: its runs ``(offset in chunk, bytes)``, sorted and
    apart, and the entries of the call whose runs they are."""

    ino: int
    layout: LayoutLike
    index: int
    runs: list[tuple[int, memoryview]]
    entries: set[int]
    request_id: int = 0
    error: KvfsError | None = None
    full_replace: bool = False  # the one run, at 0, is the whole new version (a truncation's emptied chunk)

    @property
    def size(self) -> int:
        return sum(len(data) for _, data in self.runs)

    def request(self, chain: ChainConfig, client_id: int) -> WriteReq:
        crc = 0
        for _, data in self.runs:
            crc = crc32c(data, crc)
        extents = [(at, len(data)) for at, data in self.runs] if len(self.runs) > 1 else None
        return WriteReq(chain.chain_id, chain.chain_version, ChunkId(self.ino, self.index), client_id,
                        self.request_id, self.runs[0][0], crc, extents=extents, full_replace=self.full_replace)


def _plan(writes: Sequence[tuple[int, LayoutLike, list[tuple[int, Buffer]]]]) -> list[list[_ChunkWrite]]:
    """Rounds of chunk updates, each chunk at most once per round: all runs of a chunk in one update, except that
    a run overlapping an earlier one goes to a later round than it (so the later bytes win)."""
    placed: dict[tuple[int, int], list[tuple[int, int, int, memoryview, int]]] = {}  # chunk -> (round, lo, hi, data, entry)
    layouts: dict[int, LayoutLike] = {}
    for entry, (ino, layout, runs) in enumerate(writes):
        layouts[ino] = layout
        for offset, data in runs:
            view = memoryview(data).cast("B")
            for index, within, at in split_range(offset, len(view), layout.chunk_size):
                piece = view[at : at + layout.chunk_size - within]
                end = within + len(piece)
                got = placed.setdefault((ino, index), [])
                later = max((r + 1 for r, lo, hi, _, _ in got if lo < end and within < hi), default=0)
                got.append((later, within, end, piece, entry))
    rounds: list[list[_ChunkWrite]] = []
    for (ino, index), got in placed.items():
        for r in range(max(g[0] for g in got) + 1):
            mine = sorted((g for g in got if g[0] == r), key=lambda g: g[1])
            if mine:
                while len(rounds) <= r:
                    rounds.append([])
                rounds[r].append(_ChunkWrite(ino, layouts[ino], index, [(lo, data) for _, lo, _, data, _ in mine],
                                             {g[4] for g in mine}))
    return rounds


def split_range(offset: int, length: int, chunk_size: int) -> list[tuple[int, int, int]]:
    """``(chunk index, offset in chunk, offset in the caller's buffer)`` pieces of a byte range; lengths follow."""
    pieces = []
    pos = offset
    end = offset + length
    while pos < end:
        index, within = divmod(pos, chunk_size)
        pieces.append((index, within, pos - offset))
        pos += chunk_size - within
    return pieces


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.rsplit(":", 1)[0].strip("[]")).is_loopback
    except ValueError:
        return False


class StorageClient:
    """Reads and writes files' chunks on the chunk servers; one instance per process is plenty."""

    def __init__(
        self,
        rpc: RpcClient,
        mgmtd: MgmtdClient,
        *,
        window: int = 32,
        retry_for: float = 120.0,
        call_timeout: float = 30.0,
    ) -> None:
        self.rpc = rpc
        self.mgmtd = mgmtd
        self.client_id = secrets.randbits(62) + 1
        self._request_ids = itertools.count(1)
        self._window = trio.CapacityLimiter(window)
        self._retry_for = retry_for
        self._call_timeout = call_timeout
        self._routing: RoutingSnapshot | None = None
        self._refreshing: trio.Event | None = None
        self._chunk_locks: dict[tuple[int, int], trio.Lock] = {}
        self._unflushed: set[int] = set()  # chains this client's writes reached since its last flush
        self._flush_lock = trio.Lock()
        self._rng = random.Random()
        self._not_local: set[str] = set()  # chunk servers that refused chunk.locate_many: on another host

    # ---------------------------------------------------------------------------------- routing

    async def routing(self) -> RoutingSnapshot:
        if self._routing is None:
            await self.refresh_routing()
        assert self._routing is not None
        return self._routing

    async def refresh_routing(self) -> None:
        """Fetch routing from mgmtd; concurrent callers share one fetch."""
        if self._refreshing is not None:
            await self._refreshing.wait()
            return
        self._refreshing = trio.Event()
        try:
            self._routing = await self.mgmtd.routing()
        finally:
            self._refreshing.set()
            self._refreshing = None

    async def _chain(self, layout: LayoutLike, ino: int, index: int) -> ChainConfig:
        routing = await self.routing()
        if not routing.chains:
            raise ServiceUnavailable("the cluster has no chains yet (create them with kvfs admin create-chains)")
        return routing.chains[chunk_chain(layout, ino, index, len(routing.chains))]  # type: ignore[arg-type]

    def _address(self, target_id: int, chain: ChainConfig) -> str:
        assert self._routing is not None
        node = next(t.node_id for t in chain.targets if t.target_id == target_id)
        address = self._routing.addresses.get(node)
        if address is None:
            raise StaleRouting(f"no address for node {node}")
        return address

    async def _retrying(self, what: str, attempt: Callable[[int], Awaitable[Any]]) -> Any:
        """Run ``attempt(n)`` until it succeeds, a permanent error occurs, or ``retry_for`` seconds pass."""
        deadline = trio.current_time() + self._retry_for
        for n in itertools.count():
            try:
                return await attempt(n)
            except KvfsError as exc:
                if not _transient(exc):
                    raise
                if trio.current_time() > deadline:
                    raise KvfsError(f"{what}: gave up after {self._retry_for:g}s: {exc.message}", exc.errno) from None
                log.debug("%s: attempt %d failed: %s", what, n, exc.message)
                if isinstance(exc, (StaleRouting, ServiceUnavailable, ConnectionLost, RpcTimeout)) or n % 4 == 3:
                    await trio.sleep(min(0.02 * 2 ** min(n, 6), 1.0))
                    try:
                        await self.refresh_routing()
                    except KvfsError as refresh_error:
                        log.debug("routing refresh failed: %s", refresh_error.message)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------ writes

    async def write(self, ino: int, layout: LayoutLike, offset: int, data: Buffer) -> None:
        await self.write_runs(ino, layout, [(offset, data)])

    async def write_runs(self, ino: int, layout: LayoutLike, runs: list[tuple[int, Buffer]]) -> None:
        (error,) = await self.write_many([(ino, layout, runs)])
        if error is not None:
            raise error

    async def write_many(self, writes: Sequence[tuple[int, LayoutLike, list[tuple[int, Buffer]]]]
                         ) -> list[KvfsError | None]:
        """Write ``(inode, layout, runs of (file offset, bytes))`` entries, of one file or many, as few chain
        rounds as it takes: a chunk's runs become one update (one new version), and the small updates of one
        chain go to its head as one ``chunk.write_batch``, which every replica stages and commits as one batch
        (chunkserver/README.md, "Batched writes"). Returns for each entry None, or the error of its first chunk
        that failed; the other entries' chunks are written regardless. The bytes must stay unchanged until this
        returns (they are lent to the transport)."""
        rounds = _plan(writes)
        for updates in rounds:
            await self._write_round(updates)
        results: list[KvfsError | None] = [None] * len(writes)
        for updates in rounds:
            for u in updates:
                for entry in u.entries:
                    if u.error is not None and results[entry] is None:
                        results[entry] = u.error
        return results

    @contextlib.asynccontextmanager
    async def _locked(self, keys: list[tuple[int, int]]) -> AsyncIterator[None]:
        """Hold the locks of these chunks (in one order, so two callers cannot wait for each other): one write per
        chunk in flight from this client, as the head requires."""
        held: list[tuple[tuple[int, int], trio.Lock]] = []
        try:
            for key in sorted(keys):
                lock = self._chunk_locks.setdefault(key, trio.Lock())
                await lock.acquire()
                held.append((key, lock))
            yield
        finally:
            for key, lock in held:
                lock.release()
                if not lock.statistics().tasks_waiting and not lock.locked():
                    self._chunk_locks.pop(key, None)

    async def _write_round(self, updates: list[_ChunkWrite]) -> None:
        """Write updates of distinct chunks; each ends with ``error`` None or why it failed. Transient failures
        are retried (with the same request ids: a retry is applied once) after a routing refresh."""
        async with self._locked([(u.ino, u.index) for u in updates]):
            for u in updates:
                u.request_id = next(self._request_ids)
            todo = updates

            async def attempt(n: int) -> None:
                nonlocal todo
                by_chain: dict[int, tuple[ChainConfig, list[_ChunkWrite]]] = {}
                for u in todo:
                    chain = await self._chain(u.layout, u.ino, u.index)
                    by_chain.setdefault(chain.chain_id, (chain, []))[1].append(u)
                async with trio.open_nursery() as nursery:
                    for chain, mine in by_chain.values():
                        for batch in p.batches(mine, lambda u: u.size):
                            nursery.start_soon(self._bounded, self._send_writes, chain, batch)
                todo = [u for u in todo if u.error is not None and _transient(u.error)]
                if todo:
                    raise todo[0].error  # type: ignore[misc]

            try:
                await self._retrying(f"write of {len(updates)} chunks", attempt)
            except KvfsError as exc:
                for u in todo:
                    u.error = exc

    async def _send_writes(self, chain: ChainConfig, updates: list[_ChunkWrite]) -> None:
        """One ``chunk.write`` (one update) or ``chunk.write_batch`` to the chain's head; sets each one's ``error``."""
        try:
            writers = chain.write_chain()
            if not writers:
                raise ServiceUnavailable(f"chain {chain.chain_id} has no serving target")
            address = self._address(writers[0], chain)
            requests = [u.request(chain, self.client_id) for u in updates]
            data = [piece for u in updates for _, piece in u.runs]
            # lent: the caller keeps the bytes unchanged until this returns, and the head checks their CRC
            if len(updates) == 1:
                await self.rpc.call(address, p.WRITE, requests[0], data=data, timeout=self._call_timeout, lend=True)
                replies = [None]
            else:
                answer = await self.rpc.call(address, p.WRITE_BATCH, p.WriteBatch(requests, [u.size for u in updates]),
                                             data=data, timeout=self._call_timeout, lend=True)
                replies = [from_wire(r.errno, r.message) if r.errno else None for r in answer.results]
        except KvfsError as exc:
            replies = [exc] * len(updates)
        for u, error in zip(updates, replies):
            u.error = error
            if error is None:
                self._unflushed.add(chain.chain_id)

    async def _bounded(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        async with self._window:
            await fn(*args)

    # ------------------------------------------------------------------------------------- reads

    async def read(self, ino: int, layout: LayoutLike, offset: int, into: memoryview) -> int:
        """Fill ``into`` with the file's bytes at ``offset``; chunks or their parts that hold no data (holes, or
        past a chunk's end) read as zeros. Returns how many bytes came from stored data: fewer than ``len(into)``
        tells a caller that knows the data must be there (kvclient's write-once objects) that it is not."""
        into = into.cast("B") if into.format != "B" else into
        pieces = split_range(offset, len(into), layout.chunk_size)
        if len(pieces) == 1:
            index, within, at = pieces[0]
            return await self._read_chunk(ino, layout, index, within, into)
        stored = [0] * len(pieces)

        async def piece(n: int, index: int, within: int, at: int) -> None:
            async with self._window:
                piece = into[at : at + layout.chunk_size - within]
                stored[n] = await self._read_chunk(ino, layout, index, within, piece)

        async with one_error(), trio.open_nursery() as nursery:
            for n, (index, within, at) in enumerate(pieces):
                nursery.start_soon(piece, n, index, within, at)
        return sum(stored)

    async def read_direct(self, ino: int, layout: LayoutLike, offset: int, target: DirectInto) -> None:
        """Read ``len(target)`` bytes at ``offset``, within one chunk, into a caller's registered region (GPUDirect
        RDMA where the connection to the serving replica allows, else into ``target.staging``; see
        :class:`~kvfs.transport.direct.DirectInto`). Unlike :meth:`read`, a hole past the chunk's end is not
        zeroed: ``target.filled`` says where the data ends, and the caller, who can reach the region, fills it."""
        pieces = split_range(offset, len(target), layout.chunk_size)
        if len(pieces) != 1:
            raise ValueError(f"a direct read of {len(target)} bytes at {offset} spans {len(pieces)} chunks")
        index, within, _ = pieces[0]
        await self._read_chunk(ino, layout, index, within, target)

    async def _read_chunk(self, ino: int, layout: LayoutLike, index: int, within: int,
                          into: memoryview | DirectInto) -> int:
        """Returns the bytes the chunk held in the range (the rest of ``into`` is a hole)."""

        async def attempt(n: int) -> int:
            chain = await self._chain(layout, ino, index)
            serving = [t.target_id for t in chain.targets if t.state is TargetState.SERVING]
            if not serving:
                raise ServiceUnavailable(f"chain {chain.chain_id} has no serving target")
            # spread first attempts over replicas; later ones go to the tail, which never needs to ask anyone
            target = self._rng.choice(serving) if n == 0 else serving[-1 - (n // 2) % len(serving)]
            request = p.ReadBatch([p.ReadRange(chain.chain_id, chain.chain_version, ChunkId(ino, index), within,
                                               len(into))])
            reply, data = await self.rpc.call_with_data(self._address(target, chain), p.READ, request, into=into,
                                                        timeout=self._call_timeout)
            result = reply.results[0]
            if result.errno:
                raise KvfsError(result.message, result.errno) if result.errno != errno.EBADMSG else ChecksumMismatch(
                    result.message)
            if isinstance(into, DirectInto):
                into.filled = result.length
            else:
                into[result.length :] = bytes(len(into) - result.length)  # past the chunk's end: a hole
            return result.length

        return await self._retrying(f"read of chunk {index} of inode {ino}", attempt)

    async def locate(self, ino: int, layout: LayoutLike, index: int, within: int, length: int,
                     boot_id: str) -> p.ChunkLocation | None:
        """:meth:`locate_many` of one chunk range."""
        return (await self.locate_many([(ino, layout, index, within, length)], boot_id))[0]

    async def locate_many(self, chunks: Sequence[tuple[int, LayoutLike, int, int, int]],
                          boot_id: str, reads_back: bool = False) -> list[p.ChunkLocation | None]:
        """Where replicas on this host keep the versions that reads of these ranges ``(ino, layout, index,
        within, length)`` would get, pinned for short-circuit reads (``chunk.locate_many``). One call per server
        asked, and as few servers as hold a serving replica of every chunk (loopback ones first), so a batch get
        costs one round trip on a host with one chunk server. None for a chunk no server here locates: the
        caller reads it over the network. Servers that refused once as not local are not asked again.
        ``reads_back``: see :class:`~kvfs.chunkserver.protocol.LocateChunks`."""
        routing = await self.routing()
        ranges: list[p.ReadRange] = []
        holders: list[frozenset[str]] = []  # per chunk: the servers with a serving replica of it
        of_chain: dict[int, frozenset[str]] = {}  # the same for every chunk of a chain
        for ino, layout, index, within, length in chunks:
            chain = await self._chain(layout, ino, index)
            ranges.append(p.ReadRange(chain.chain_id, chain.chain_version, ChunkId(ino, index), within, length))
            serving = of_chain.get(chain.chain_id)
            if serving is None:
                serving = of_chain[chain.chain_id] = frozenset(
                    a for t in chain.targets
                    if t.state is TargetState.SERVING and (a := routing.addresses.get(t.node_id)) is not None)
            holders.append(serving)
        located: list[p.ChunkLocation | None] = [None] * len(chunks)
        left = set(range(len(chunks)))
        while left:
            counts = collections.Counter(a for i in left for a in holders[i] if a not in self._not_local)
            if not counts:
                break
            address = max(sorted(counts), key=lambda a: (_loopback(a), counts[a]))
            group = sorted(i for i in left if address in holders[i])
            left.difference_update(group)
            try:
                reply = await self.rpc.call(address, p.LOCATE_MANY,
                                            p.LocateChunks([ranges[i] for i in group], boot_id, reads_back),
                                            timeout=self._call_timeout)
            except KvfsError as exc:
                if exc.errno in (errno.EPERM, errno.ENOSYS):  # another host, or a server without chunk.locate_many
                    self._not_local.add(address)
                    left.update(group)
                else:
                    log.debug("locate of %d chunks at %s: %s", len(group), address, exc.message)
                continue
            for i, loc in zip(group, reply.locations):
                located[i] = loc
        return located

    # ------------------------------------------------------------------------- whole-file operations

    async def _all_nodes(self, method: Any, request: Any, *, offline_may_miss: bool = False) -> list[Any]:
        """Call every chunk server; one that cannot be reached fails the call. ``offline_may_miss``: except those
        that :func:`_may_be_left_out` (their return undoes a removal they missed: craq/member.py, rule 10), and
        one that cannot be reached while mgmtd still counts it is tried again, routing refreshed, until mgmtd
        takes it out (within its heartbeat timeout) or ``retry_for`` runs out."""
        results: dict[str, Any] = {}

        async def attempt(n: int) -> None:
            routing = await self.routing()
            unreachable: list[tuple[str, KvfsError]] = []

            async def one(address: str) -> None:
                try:
                    results[address] = await self.rpc.call(address, method, request, timeout=self._call_timeout)
                except KvfsError as exc:
                    if not (offline_may_miss and _transient(exc)):
                        raise
                    unreachable.append((address, exc))

            async with one_error(), trio.open_nursery() as nursery:
                for address in sorted(set(routing.addresses.values()) - results.keys()):
                    nursery.start_soon(one, address)
            missing = [exc for address, exc in unreachable if not _may_be_left_out(routing, address)]
            if missing:
                raise missing[0]

        if offline_may_miss:
            await self._retrying(f"{method.name} on every chunk server", attempt)
        else:
            await attempt(0)
        return list(results.values())

    async def truncate(self, ino: int, layout: LayoutLike, old_length: int, new_length: int) -> None:
        """Zero the cut part of the new last chunk and remove the chunks past it.

        Keeping bytes past a file's length zero is what lets a later extension read zeros without any work.
        With every target of the cluster up (and every server answering a first call), the chunks past the end
        are removed on every server. Otherwise (mgmtd has taken one out, or one cannot be reached: tried again
        until mgmtd does) each is replaced by an empty version through its chain: a removal it missed, a returning
        target would hold on to, and a chunk removed on some servers and written again starts its versions at 1,
        so a recovering member (craq/member.py, rule 9) could take a returning target's older copy for newer. The
        empty versions' rows stay until the file is deleted. A server that dies between the first call and the
        removal leaves the removal made on the others only (then the emptying goes on from there).
        """
        if new_length >= old_length:
            return
        size = layout.chunk_size
        cut = new_length % size
        if cut:
            end = min(old_length, new_length - cut + size)
            await self.write(ino, layout, new_length, bytes(end - new_length))
        first_gone = -(-new_length // size)

        async def attempt(n: int) -> None:
            if any(t.state not in _UP for c in (await self.routing()).chains for t in c.targets):
                await self._empty_chunks(ino, layout, range(first_gone, -(-old_length // size)))
            else:
                await self._all_nodes(p.SPACE, Empty())  # all answer first: a removal only some made is the hazard
                await self._all_nodes(p.REMOVE, p.RemoveChunks(ino, first_gone))

        await self._retrying(f"truncation of inode {ino}", attempt)
        self._unflushed.update(c.chain_id for c in (await self.routing()).chains)

    async def _empty_chunks(self, ino: int, layout: LayoutLike, indexes: range) -> None:
        """Replace each of these chunks of ``ino`` with an empty version, through its chain."""
        for start in range(0, len(indexes), EMPTIED_AT_ONCE):
            updates = [_ChunkWrite(ino, layout, index, [(0, memoryview(b""))], {0}, full_replace=True)
                       for index in indexes[start : start + EMPTIED_AT_ONCE]]
            await self._write_round(updates)
            failed = next((u.error for u in updates if u.error is not None), None)
            if failed is not None:
                raise failed

    async def flush(self, ino: int) -> None:
        """Make this client's writes and truncations of ``ino`` durable on every replica (the file's fsync):
        chunk servers may acknowledge them before they are flushed. A target flushes all it holds, so this flushes
        the chains any of this client's writes reached since its last flush: state bounded by the chains, not by
        the files ever written. Returns at once if nothing is unflushed."""
        async with self._flush_lock:  # a concurrent flush waits for this one, then flushes what came after
            chains, self._unflushed = self._unflushed, set()
            if chains:
                try:
                    await self._retrying(f"flush of inode {ino}", lambda n: self._flush_chains(chains))
                except BaseException:
                    self._unflushed |= chains
                    raise

    async def _flush_chains(self, chain_ids: set[int]) -> None:
        """SYNC every target that takes writes in these chains, one call per chunk server (as routing is now:
        a target that left a chain meanwhile has nothing its chain still needs)."""
        routing = await self.routing()
        by_address: dict[str, list[int]] = {}
        for chain in routing.chains:
            if chain.chain_id in chain_ids:
                for target in chain.write_chain():
                    by_address.setdefault(self._address(target, chain), []).append(target)
        async with one_error(), trio.open_nursery() as nursery:
            for address, targets in by_address.items():
                nursery.start_soon(functools.partial(
                    self.rpc.call, address, p.FLUSH, p.FlushTargets(sorted(set(targets))), timeout=self._call_timeout))

    async def remove_files(self, inodes: list[int]) -> None:
        """Remove every chunk of these (deleted) inodes. A chunk server that mgmtd took out of its chains is left
        out, and its resync drops them when it returns: meta's collector does not wait for it."""
        await self._all_nodes(p.REMOVE_FILES, p.RemoveFiles(inodes), offline_may_miss=True)

    async def capacity(self) -> tuple[int, int]:
        """(total, free) bytes a user can store: raw space divided by the replication factor."""
        routing = await self.routing()
        spaces = await self._all_nodes(p.SPACE, Empty(), offline_may_miss=True)  # what the servers up hold
        replicas = max((len(c.targets) for c in routing.chains), default=1)
        return sum(s.capacity for s in spaces) // replicas, sum(s.free for s in spaces) // replicas

    async def last_chunk(self, ino: int) -> tuple[int, int]:
        """(index, length) of a file's last chunk anywhere in the cluster; (-1, 0) when it has none."""
        results = await self._all_nodes(p.LAST_CHUNK, p.LastChunkQuery(ino))
        best = max(results, key=lambda r: r.index, default=p.LastChunk(-1, 0))
        return best.index, best.length


class SyncChunkRemover:
    """meta's ChunkRemover for a store running in a worker thread of a trio service: blocks on the async client."""

    def __init__(self, storage: StorageClient) -> None:
        self._storage = storage

    def remove_chunks(self, inodes: list[int]) -> None:
        trio.from_thread.run(self._storage.remove_files, inodes)
