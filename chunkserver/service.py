"""``kvfs chunkserver``: storage targets on local disks, driven by the CRAQ state machine.

This module is the driver of :class:`kvfs.craq.member.ChainMember`: it turns RPCs from clients and peers into the
member's events, and the member's effects into engine calls and RPCs. It never decides anything about
replication itself — versions, forwarding, commit order and read safety are the member's.

Ordering: effects that touch a chunk's data (persist, commit, reading a whole chunk to send it) run in a worker
thread, so each chunk has a FIFO of such effects drained by one task at a time. That keeps per-chunk order
(a commit of v before the persist of v+1) while different chunks proceed in parallel.
"""

from __future__ import annotations

import collections
import errno
import functools
import ipaddress
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import prometheus_client
import trio
from crc32c import crc32c

from kvfs.chunkserver import protocol as p
from kvfs.chunkserver.engine import ChunkEngine, ChunkVersion, Location, PendingWrite
from kvfs.craq.cluster import Heartbeat, RoutingSnapshot
from kvfs.craq.member import (
    Abort,
    AskTail,
    ChainMember,
    ChunkState,
    Commit,
    Configure,
    DropChunks,
    Effect,
    Persisted,
    PersistFailed,
    PersistPending,
    ReplyClient,
    ReportToMgmtd,
    Retry,
    Send,
    SendChunk,
    ServeVersion,
    Tick,
)
from kvfs.craq.messages import (
    AckStatus,
    BlockDelta,
    ChecksumReport,
    ChunkId,
    ChunkSummary,
    Msg,
    ResyncDone,
    ResyncState,
    UpdateAck,
    UpdateReq,
    VersionQuery,
    WriteReq,
    WriteResp,
)
from kvfs.crc import BLOCK, block_runs, changed_blocks, pack_crcs, unpack_crcs
from kvfs.craq.client import CHECKSUM_REPORT, HEARTBEAT, REGISTER, RESYNC_DONE, MgmtdClient, RegisterNode
from kvfs.aio import Workers, one_error
from kvfs.errors import ChecksumMismatch, KvfsError, NotCommitted, ProtocolError, StaleRouting, from_wire
from kvfs.pool import RECEIVED
from kvfs.rpc import CallContext, RpcClient, RpcServer
from kvfs.transport import shm
from kvfs.wire import Empty, Method

log = logging.getLogger("kvfs.chunkserver")

RESYNC_LEFT = prometheus_client.Gauge(
    "kvfs_resync_chunks_left", "Chunks still to copy to a syncing target (-1: not counted yet)", ["target"]
)
RESYNC_BYTES = prometheus_client.Counter(
    "kvfs_resync_bytes_total", "Chunk bytes sent to syncing targets, as changed blocks or as whole chunks", ["how"]
)
LOCATED = prometheus_client.Counter(
    "kvfs_chunk_located", "Chunk versions located and pinned for short-circuit readers on this host"
)
FLUSH_SECONDS = prometheus_client.Histogram(
    "kvfs_chunk_sync_seconds", "Time to make a target's acknowledged writes durable", ["reason"]
)
_requests_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(dict[int, int]))
_EARLY_HEARTBEAT_GAP = 0.02  # at least this long between heartbeats, however often messages ask for one early
_IDLE_TICK = 0.25  # seconds between ticks while no member has anything to time (see ChunkServer._tick_loop)
#: Seconds a located version stays pinned for its short-circuit reader, which must have read it by then
#: (chunkserver/README.md, "Short-circuit reads"); a slot it holds is reused only after that.
LOCATE_LEASE = 5.0
_LEASE_SLACK = 0.1  # released this long after the deadline the client checks, so a read at the deadline is covered
_LEND_FROM = 256 << 10  # reads from this size are loans, taken in a worker thread (chunkserver/README.md, "Reads");
# for smaller ones a copy from the page cache, inline when cached, costs less than the thread hop


def target_id_for(node_id: int, index: int) -> int:
    """Target ids are derived from the node id so a restarted server owns the same targets without a registry."""
    return node_id * 100 + index


def _member_chunks(engine: ChunkEngine) -> dict[ChunkId, ChunkState]:
    """What a restarted member resumes from: each chunk's committed and pending versions on disk."""
    chunks = {}
    for meta in engine.list_chunks():
        committed, pending = engine.versions(meta.chunk_id)
        newest = pending or committed
        requests = _requests_codec[1].decode(newest.aux) if newest and newest.aux else {}
        chunks[meta.chunk_id] = ChunkState(
            committed.version if committed else 0,
            committed.crc if committed else 0,
            committed.length if committed else 0,
            requests,
            *((pending.version, pending.crc, pending.length) if pending else ()),
        )
    return chunks


def _with_block_crcs(engine: ChunkEngine, state: ResyncState) -> tuple[ResyncState, bytes]:
    """A syncing target's list with each version's length, and the block CRCs of them all, so the predecessor can
    send only the blocks that differ (the member lists versions and CRCs; the blocks' CRCs are the engine's). The
    CRCs go as the frame's data section, not in the list (a body is at most 1 MiB, 256 bytes of CRCs per 4 MiB
    chunk would shrink a list that fits to some 4,000 chunks): a summary's ``length`` says how many are its."""
    chunks, crcs = [], []
    for x in state.chunks:
        blocks = engine.version_blocks(x.chunk_id, x.version) if x.version else None
        if blocks is None:
            chunks.append(x)
        else:
            chunks.append(ChunkSummary(x.chunk_id, x.version, x.crc, blocks[0]))
            crcs.append(pack_crcs(blocks[1]))
    return msgspec.structs.replace(state, chunks=tuple(chunks)), b"".join(crcs)


def _attach_block_crcs(state: ResyncState, data: memoryview | bytes) -> ResyncState:
    """The list as :func:`_with_block_crcs` made it, each summary with its block CRCs from the data section again;
    with none at all if they do not add up (the predecessor then copies every differing chunk whole)."""
    chunks, at = [], 0
    for x in state.chunks:
        n = 4 * -(-x.length // BLOCK)
        chunks.append(msgspec.structs.replace(x, blocks=bytes(data[at : at + n])) if n else x)
        at += n
    if at != len(data):
        log.warning("resync list from target %s: %d bytes of block CRCs for %d; copying whole", state.from_target,
                    len(data), at)
        return msgspec.structs.replace(state, chunks=tuple(msgspec.structs.replace(x, blocks=b"") for x in chunks))
    return msgspec.structs.replace(state, chunks=tuple(chunks))


def _chunk_copy(engine: ChunkEngine, e: SendChunk) -> tuple[bytearray, UpdateReq]:
    """The bytes and message of a :class:`SendChunk`: the whole chunk, or for a resync copy whose receiver listed
    its block CRCs, only the blocks that differ from its copy (a delta), unless half of them or more do (then a
    whole copy, a fresh base at the receiver, costs it less than the delta's checks of what it keeps)."""
    msg, theirs = e.msg, e.theirs
    ours = engine.version_blocks(msg.chunk_id, msg.version) if theirs is not None and theirs.blocks else None
    if ours is not None:
        length, crcs = ours
        changed = changed_blocks(crcs, length, unpack_crcs(theirs.blocks), theirs.length)
        if 2 * len(changed) < len(crcs):
            runs = block_runs(changed, length)
            data = engine.read_runs(msg.chunk_id, msg.version, runs)
            delta = BlockDelta(theirs.version, theirs.crc, length, msg.crc)
            return data, msgspec.structs.replace(msg, crc=crc32c(data), extents=runs, delta=delta)
    data, _ = engine.read(msg.chunk_id, 0, p.MAX_CHUNK_SIZE, version=msg.version)
    return data, msgspec.structs.replace(msg, crc=crc32c(data))


def _hole_or_moved_on(exc: KvfsError, engine: ChunkEngine, chunk_id: ChunkId, version: int) -> None:
    """After the engine failed to pin the version a read chose: return if the chunk was removed meanwhile
    (truncated or garbage-collected: a hole), raise NotCommitted (retry) if a newer version replaced it, and
    ``exc`` itself for anything but ENOENT."""
    if exc.errno != errno.ENOENT:
        raise exc
    if engine.versions(chunk_id) != (None, None):
        raise NotCommitted(f"chunk {chunk_id} moved past v{version} during the read") from None


def _peer_message(msgs: list[UpdateReq | UpdateAck]) -> tuple[Method, msgspec.Struct, list[Any] | None]:
    """The one-way message that carries ``msgs`` to a member: alone, or as one :class:`~p.PeerBatch`. An update's
    bytes leave the message for the frame's data section."""
    data = [m.data if isinstance(m, UpdateReq) and m.data is not None else b"" for m in msgs]
    bare = [msgspec.structs.replace(m, data=None) if isinstance(m, UpdateReq) else m for m in msgs]
    if len(msgs) == 1:
        return p.PEER, p.PeerEnvelope(bare[0]), data if len(data[0]) else None
    return p.PEER_BATCH, p.PeerBatch(bare, [len(d) for d in data]), [d for d in data if len(d)]


def _data_size(msg: UpdateReq | UpdateAck) -> int:
    return len(msg.data) if isinstance(msg, UpdateReq) and msg.data is not None else 0


def _chunk_of(effect: Effect) -> ChunkId | None:
    """The chunk whose data an effect touches (what runs in that chunk's order), if any."""
    if isinstance(effect, (PersistPending, Commit, Abort)):
        return effect.chunk_id
    return effect.msg.chunk_id if isinstance(effect, SendChunk) else None


def _split(data: memoryview | None, sizes: list[int]) -> list[memoryview]:
    """A batch's data section cut into its messages' pieces; [] if the sizes do not add up to it."""
    view = memoryview(data if data is not None else b"")
    if sum(sizes) != len(view) or min(sizes, default=0) < 0:
        return []
    pieces, at = [], 0
    for n in sizes:
        pieces.append(view[at:at + n])
        at += n
    return pieces


@dataclass
class _Waiter:
    """Clients waiting for one write's reply (a retry of the same request waits beside the original)."""

    done: trio.Event = field(default_factory=trio.Event)
    reply: WriteResp | None = None
    count: int = 0


class ChunkServer:
    """One chunk server: its targets, their chain members, and the tasks that drive them."""

    def __init__(
        self,
        node_id: int,
        address: str,
        engines: dict[int, ChunkEngine],
        rpc: RpcClient,
        mgmtd: MgmtdClient,
        *,
        heartbeat_interval: float = 1.0,
        tick_interval: float = 0.02,
        retransmit_after: float = 1.0,
        flush_interval: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``retransmit_after``: how long a member waits for an ack before sending an update again. TCP does
        not lose messages on a live connection, so this only covers broken connections and chain changes;
        too short a wait re-sends whole chunks that are merely slow to persist. ``flush_interval``: how often
        write-back targets flush what no client's fsync did (0: only on fsync and at shutdown)."""
        self.node_id = node_id
        self.address = address
        self.engines = engines
        self.rpc = rpc
        self.mgmtd = mgmtd
        self.heartbeat_interval = heartbeat_interval
        self.tick_interval = tick_interval
        self.retransmit_after = retransmit_after
        self.flush_interval = flush_interval
        self.clock = clock
        self.incarnation = time.time_ns()
        self.members: dict[int, ChainMember] = {}  # target id -> member, once routing places the target
        self.routing: RoutingSnapshot | None = None
        self._chain_targets: dict[int, int] = {}  # chain id -> my target in it
        self._waiters: dict[tuple[int, int], _Waiter] = {}
        self._chunk_queues: dict[tuple[int, ChunkId], collections.deque[Callable[[], Any]]] = {}
        self._nursery: trio.Nursery | None = None
        self._workers = Workers("chunk-engine")  # persists and commits: the threads of every write
        # reads that wait for the disk, which must not queue behind writes' fsyncs: large ones, and small ones the
        # page cache does not hold (a cold 4 KiB read paid trio.to_thread's per-call work on top of its disk read)
        self._readers = Workers("chunk-read")
        self._flushers = Workers("chunk-flush")  # flushes, which take long and must not hold up writes
        self.registered = trio.Event()
        #: set when a message shows this server's routing may be behind mgmtd's: the heartbeat loop goes at once
        self._routing_behind = trio.Event()
        #: syncing target -> [bytes, chunks sent as changed blocks, chunks sent whole] of its resync, logged when done
        self._resync_sent: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        #: targets that may have lost acknowledged unflushed writes before this incarnation (engine.unclean_stop)
        self.unclean_targets = tuple(sorted(t for t, engine in engines.items() if engine.unclean_stop))
        #: (deadline, releases) of each locate's pins, in the order they were taken (_release_located)
        self._located, self._located_out = trio.open_memory_channel[tuple[int, list[Callable[[], None]]]](math.inf)

    def register_handlers(self, server: RpcServer) -> None:
        for method, handler in (
            (p.WRITE, self._on_write),
            (p.WRITE_BATCH, self._on_write_batch),
            (p.READ, self._on_read),
            (p.FETCH, self._on_fetch),
            (p.REMOVE, self._on_remove),
            (p.REMOVE_FILES, self._on_remove_files),
            (p.LAST_CHUNK, self._on_last_chunk),
            (p.SPACE, self._on_space),
            (p.CHUNK_STAT, self._on_chunk_stat),
            (p.FLUSH, self._on_flush),
            (p.LOCATE_MANY, self._on_locate_many),
        ):
            server.register(method, handler)
        # In the connection's reader task, not a task each (two per write and replica): they never wait, they
        # hand the message to the member (whose effects start tasks of their own) or answer from memory.
        server.register(p.PEER, self._on_peer, inline=True)
        server.register(p.PEER_BATCH, self._on_peer_batch, inline=True)
        server.register(p.VERSION_QUERY, self._on_version_query, inline=True)

    async def run(self) -> None:
        """Register, then heartbeat and tick until cancelled; every effect's task lives in this nursery."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._release_located)
            await self._register()
            nursery.start_soon(self._heartbeat_loop)
            nursery.start_soon(self._tick_loop)
            if self.flush_interval > 0:
                nursery.start_soon(self._flush_loop)

    async def _flush_loop(self) -> None:
        """Bound what a power loss can take from write-back targets, and the space their superseded versions hold."""
        while True:
            await trio.sleep(self.flush_interval)
            try:
                await self._flush(list(self.engines.values()), "interval")
            except OSError as exc:
                log.error("periodic flush failed: %s", exc)

    async def _flush(self, engines: list[ChunkEngine], reason: str) -> None:
        async with one_error(), trio.open_nursery() as nursery:
            for engine in engines:
                nursery.start_soon(self._flush_one, engine, reason)

    async def _flush_one(self, engine: ChunkEngine, reason: str) -> None:
        with FLUSH_SECONDS.labels(reason).time():
            await self._flushers.run(engine.flush)

    # ------------------------------------------------------------------------------ mgmtd and routing

    async def _register(self) -> None:
        request = RegisterNode(node_id=self.node_id, address=self.address, targets=sorted(self.engines))
        while True:
            try:
                await self.mgmtd.call(REGISTER, request)
                break
            except KvfsError as exc:
                log.warning("registering with mgmtd failed (%s); retrying", exc.message)
                await trio.sleep(self.heartbeat_interval)
        self.registered.set()

    async def _heartbeat_loop(self) -> None:
        """Heartbeat every ``heartbeat_interval``, and early when :meth:`_routing_may_be_behind` says so. A chain
        change reaches each server with its own next heartbeat; until then its members refuse the messages of
        neighbours that have it, and an update refused so waits for a retransmit, so a write issued as a target
        rejoins would otherwise stall for up to a heartbeat interval."""
        while True:
            self._routing_behind = trio.Event()
            try:
                hb = Heartbeat(self.node_id, self.incarnation, self.address, self.clock(), self.resync_progress(),
                               self.unclean_targets)
                reply = await self.mgmtd.call(HEARTBEAT, hb, timeout=self.heartbeat_interval * 2)
                self._apply_routing(reply.routing, reply.lease_until)
            except KvfsError as exc:
                log.warning("heartbeat failed: %s", exc.message)
            await trio.sleep(min(_EARLY_HEARTBEAT_GAP, self.heartbeat_interval))
            with trio.move_on_after(max(0.0, self.heartbeat_interval - _EARLY_HEARTBEAT_GAP)):
                await self._routing_behind.wait()

    def _routing_may_be_behind(self, member: ChainMember, msg: Any) -> None:
        """A message of a newer chain version than ``member``'s, or a refusal of ours as stale, means mgmtd may
        have moved the chain on: ask now rather than at the next heartbeat."""
        if msg.chain_version > member.chain_version or (isinstance(msg, UpdateAck) and msg.status is AckStatus.STALE):
            self._routing_behind.set()

    def resync_progress(self) -> dict[int, tuple[int, int]]:
        """Resyncs this server drives: syncing target -> (chunks left, chunks in all); also a Prometheus gauge."""
        progress = {}
        for member in self.members.values():
            state = member.resync_progress()
            if state is not None:
                target, left, total = state
                progress[target] = (left, total)
                RESYNC_LEFT.labels(str(target)).set(left)
        return progress

    def _apply_routing(self, routing: RoutingSnapshot, lease_until: float) -> None:
        self.routing = routing
        for chain in routing.chains:
            for target in chain.targets:
                if target.target_id not in self.engines:
                    continue
                member = self.members.get(target.target_id)
                if member is None:
                    engine = self.engines[target.target_id]
                    member = self.members[target.target_id] = ChainMember(
                        target.target_id, chain.chain_id, _member_chunks(engine), self.retransmit_after
                    )
                    self._chain_targets[chain.chain_id] = target.target_id
                self._clock(member)
                self._feed(target.target_id, Configure(chain, lease_until))

    async def _tick_loop(self) -> None:
        """Time out retransmits and resync steps: every ``tick_interval`` while a member has one to time, every
        ``_IDLE_TICK`` otherwise, so an idle server does not wake 50 times a second for nothing. Whatever depends
        on the clock between ticks brings it up to date first (:meth:`_clock`)."""
        while True:
            busy = any(m.has_timers() for m in self.members.values())
            await trio.sleep(self.tick_interval if busy else max(self.tick_interval, _IDLE_TICK))
            now = self.clock()
            for target_id in list(self.members):
                self._feed(target_id, Tick(now))

    def _clock(self, member: ChainMember) -> None:
        """Tick ``member`` if its clock is older than a busy tick: a read checks its lease against it, and an
        update it forwards is timed from it."""
        now = self.clock()
        if now - member.now >= self.tick_interval:
            self._feed(member.target_id, Tick(now))

    def _address_of_target(self, target_id: int) -> str:
        assert self.routing is not None
        for chain in self.routing.chains:
            for t in chain.targets:
                if t.target_id == target_id:
                    return self.routing.addresses[t.node_id]
        raise StaleRouting(f"target {target_id} is in no chain")

    def _member_for_chain(self, chain_id: int) -> ChainMember:
        target = self._chain_targets.get(chain_id)
        if target is None:
            raise StaleRouting(f"this server holds no target of chain {chain_id}")
        return self.members[target]

    # ---------------------------------------------------------------------------------- effects

    def _feed(self, target_id: int, *events: Any) -> None:
        """Hand events to a member and carry out what they ask, in order and together: the effects of a batch's
        events go out as batches (:meth:`_execute`)."""
        effects: list[Effect] = []
        for event in events:
            try:
                effects += self.members[target_id].handle(event)
            except ProtocolError as exc:
                log.warning("target %s dropped %s: %s", target_id, type(event).__name__, exc.message)
            except Exception:  # a bug in one chunk's handling must not take every target of the server down
                log.exception("target %s failed to handle %s", target_id, type(event).__name__)
        self._execute(target_id, effects)

    def _execute(self, target_id: int, effects: list[Effect]) -> None:
        """Carry out effects in order. Persists (other than deltas) and commits of different chunks that come
        together run as one engine call each (one worker hop, one transaction), and updates and acks to the same
        member as one message: a group closes as soon as an effect of one of its chunks comes, so every chunk's
        effects still run in the order given."""
        assert self._nursery is not None
        engine = self.engines[target_id]
        persists: list[PersistPending] = []
        commits: list[Commit] = []
        grouped: set[ChunkId] = set()
        sends: dict[int, list[UpdateReq | UpdateAck]] = {}

        def close_groups() -> None:
            if persists:
                self._in_chunks_order(target_id, [e.chunk_id for e in persists],
                                      functools.partial(self._persist_many, target_id, persists.copy()))
            if commits:
                self._in_chunks_order(target_id, [e.chunk_id for e in commits],
                                      functools.partial(self._commit_many, target_id, commits.copy()))
            persists.clear()
            commits.clear()
            grouped.clear()

        for effect in effects:
            if _chunk_of(effect) in grouped:
                close_groups()
            if isinstance(effect, Send):
                if isinstance(effect.msg, (UpdateReq, UpdateAck)):
                    sends.setdefault(effect.target, []).append(effect.msg)
                else:
                    msg, data = _with_block_crcs(engine, effect.msg) if isinstance(effect.msg, ResyncState) else \
                        (effect.msg, None)
                    self._nursery.start_soon(self._send_peer, effect.target, p.PEER, p.PeerEnvelope(msg), data)
            elif isinstance(effect, SendChunk):
                self._in_chunk_order(target_id, effect.msg.chunk_id, lambda e=effect: self._send_chunk(engine, e))
            elif isinstance(effect, PersistPending) and effect.delta is None:
                persists.append(effect)
                grouped.add(effect.chunk_id)
            elif isinstance(effect, PersistPending):
                self._in_chunk_order(target_id, effect.chunk_id, lambda e=effect: self._persist_delta(target_id, e))
            elif isinstance(effect, Commit):
                commits.append(effect)
                grouped.add(effect.chunk_id)
            elif isinstance(effect, DropChunks):
                self._in_chunks_order(target_id, list(effect.chunk_ids),
                                      functools.partial(self._drop_chunks, engine, effect))
            elif isinstance(effect, Abort):
                self._in_chunk_order(
                    target_id, effect.chunk_id,
                    lambda e=effect: trio.to_thread.run_sync(engine.abort, e.chunk_id, e.version),
                )
            elif isinstance(effect, ReplyClient):
                waiter = self._waiters.get((effect.msg.client_id, effect.msg.request_id))
                if waiter is not None:
                    waiter.reply = effect.msg
                    waiter.done.set()
            elif isinstance(effect, ReportToMgmtd):
                if isinstance(effect.msg, ResyncDone) and effect.msg.target_id in self._resync_sent:
                    sent, as_blocks, whole = self._resync_sent.pop(effect.msg.target_id)
                    log.info("resync of target %s done: %d bytes sent, %d chunks as changed blocks, %d whole",
                             effect.msg.target_id, sent, as_blocks, whole)
                self._nursery.start_soon(self._report, effect.msg)
        close_groups()
        for target, msgs in sends.items():
            for batch in p.batches(msgs, _data_size):
                self._nursery.start_soon(self._send_peer, target, *_peer_message(batch))

    def _in_chunks_order(self, target_id: int, chunk_ids: list[ChunkId], job: Callable[[], Awaitable[Any]]) -> None:
        """Run ``job`` once every earlier job of each of these chunks is done, and their later jobs after it: a
        batch keeps each chunk's order. Batches are queued in one pass in the order they are made, so two that
        share chunks meet in the same order in every queue and cannot wait for each other."""
        if len(chunk_ids) == 1:
            self._in_chunk_order(target_id, chunk_ids[0], job)
            return
        keys = [(target_id, chunk_id) for chunk_id in chunk_ids]
        if not any(key in self._chunk_queues for key in keys):
            # None of them has work queued (a batch of new writes, the usual case): one task runs the job, holding
            # each chunk's queue meanwhile, where a task per chunk would cost more than many a job itself
            for key in keys:
                self._chunk_queues[key] = collections.deque([job])
            assert self._nursery is not None
            self._nursery.start_soon(self._run_batch, keys, job)
            return
        left = len(chunk_ids)
        done = trio.Event()

        async def arrive() -> None:
            nonlocal left
            left -= 1
            if left:
                await done.wait()
                return
            try:
                await job()
            finally:
                done.set()

        for chunk_id in chunk_ids:
            self._in_chunk_order(target_id, chunk_id, arrive)

    def _in_chunk_order(self, target_id: int, chunk_id: ChunkId, job: Callable[[], Any]) -> None:
        """Run ``job`` after every earlier job of the same chunk; chunks do not wait for each other."""
        assert self._nursery is not None
        key = (target_id, chunk_id)
        queue = self._chunk_queues.get(key)
        if queue is not None:
            queue.append(job)
            return
        queue = self._chunk_queues[key] = collections.deque([job])
        self._nursery.start_soon(self._drain_chunk_queue, key, queue)

    async def _drain_chunk_queue(self, key: tuple[int, ChunkId], queue: collections.deque[Callable[[], Any]]) -> None:
        try:
            while queue:
                await self._run_job(key, queue[0])
                queue.popleft()
        finally:
            del self._chunk_queues[key]

    async def _run_batch(self, keys: list[tuple[int, ChunkId]], job: Callable[[], Awaitable[Any]]) -> None:
        """Run a batch's job that heads every one of its chunks' queues, then let each queue go on."""
        try:
            await self._run_job(keys[0], job)
        finally:
            assert self._nursery is not None
            for key in keys:
                queue = self._chunk_queues[key]
                queue.popleft()
                if queue:
                    self._nursery.start_soon(self._drain_chunk_queue, key, queue)
                else:
                    del self._chunk_queues[key]

    @staticmethod
    async def _run_job(key: tuple[int, ChunkId], job: Callable[[], Any]) -> None:
        try:
            await job()
        except KvfsError as exc:
            log.error("target %s chunk %s: %s", key[0], key[1], exc.message)
        except Exception:  # one chunk's failure must not stop the server's other work
            log.exception("target %s chunk %s: effect failed", key[0], key[1])

    async def _persist_many(self, target_id: int, effects: list[PersistPending]) -> None:
        """Stage the versions of a batch (one worker hop, one transaction; chunkserver/README.md, "The driver")
        and report each one's outcome to the member, together."""
        engine = self.engines[target_id]
        writes = [PendingWrite(e.chunk_id, e.version, e.offset, e.data, e.crc, e.full_replace,
                               _requests_codec[0].encode(e.requests), e.force, e.block_crcs, e.extents)
                  for e in effects]
        try:
            results = await self._workers.run(lambda: engine.write_pending_many(writes, chunk_size=p.MAX_CHUNK_SIZE))
        except KvfsError as exc:
            results = [exc] * len(effects)
        self._feed(target_id, *(self._persist_outcome(target_id, e, r) for e, r in zip(effects, results)))

    async def _persist_delta(self, target_id: int, e: PersistPending) -> None:
        """Stage a resync copy of only the blocks that differ (``engine.write_delta``)."""
        engine = self.engines[target_id]
        d = e.delta
        assert d is not None
        try:
            result: ChunkVersion | KvfsError = await self._workers.run(lambda: engine.write_delta(
                e.chunk_id, e.version, d.base_version, d.length, d.chunk_crc, e.data, e.crc, e.extents or (),
                aux=_requests_codec[0].encode(e.requests), force=e.force, block_crcs=e.block_crcs))
        except KvfsError as exc:
            result = exc
        self._feed(target_id, self._persist_outcome(target_id, e, result))

    @staticmethod
    def _persist_outcome(target_id: int, e: PersistPending, result: ChunkVersion | KvfsError
                         ) -> Persisted | PersistFailed:
        if isinstance(result, KvfsError):  # e.g. ENOSPC: nothing was stored; the chain abandons the version
            log.warning("target %s cannot store chunk %s v%s: %s", target_id, e.chunk_id, e.version, result.message)
            return PersistFailed(e.chunk_id, e.version, result.errno or errno.EIO, result.message)
        return Persisted(e.chunk_id, e.version, result.crc, result.length)

    async def _commit_many(self, target_id: int, commits: list[Commit]) -> None:
        """Commit the versions of a batch (not fsync'ed: README, "Durability"), one worker hop and one transaction."""
        engine = self.engines[target_id]
        results = await self._workers.run(
            lambda: engine.commit_many([(c.chunk_id, c.version) for c in commits], durable=False))
        for c, result in zip(commits, results):
            if isinstance(result, KvfsError):
                log.error("target %s chunk %s: %s", target_id, c.chunk_id, result.message)

    async def _send_chunk(self, engine: ChunkEngine, e: SendChunk) -> None:
        try:
            data, msg = await trio.to_thread.run_sync(lambda: _chunk_copy(engine, e))
        except KvfsError as exc:
            log.warning("cannot send chunk %s v%s to %s: %s", e.msg.chunk_id, e.msg.version, e.target, exc.message)
            return
        if msg.resync:
            how = "blocks" if msg.delta is not None else "whole"
            RESYNC_BYTES.labels(how).inc(len(data))
            sent = self._resync_sent[e.target]
            sent[0] += len(data)
            sent[1 if msg.delta is not None else 2] += 1
        self._nursery.start_soon(self._send_peer, e.target, p.PEER, p.PeerEnvelope(msg), data)

    async def _send_peer(self, target_id: int, method: Method, body: msgspec.Struct, data: Any) -> None:
        """One-way message to another member; losses are repaired by the member's retransmissions."""
        try:
            address = self._address_of_target(target_id)
            # lent: a member keeps an update's bytes until its successor acknowledges it, and checks their CRC
            await self.rpc.send(address, method, body, data=data, timeout=5, lend=True)
        except KvfsError as exc:
            log.debug("message to target %s lost: %s", target_id, exc.message)

    async def _drop_chunks(self, engine: ChunkEngine, effect: DropChunks) -> None:
        """Rule 10 of craq/member.py: the chunks leave the disk before the predecessor hears they are gone. If the
        engine fails, no answer: the predecessor asks again and the retry removes them."""
        try:
            removed = await trio.to_thread.run_sync(engine.remove_chunks, effect.chunk_ids)
        except (KvfsError, OSError) as exc:
            log.error("resync could not drop %d chunks: %s", len(effect.chunk_ids), exc)
            return
        if removed:
            log.info("resync dropped %d chunks that the chain removed while this target was away", len(removed))
        await self._send_peer(effect.target, p.PEER, p.PeerEnvelope(effect.ack), None)

    async def _report(self, msg: ResyncDone | ChecksumReport) -> None:
        method = RESYNC_DONE if isinstance(msg, ResyncDone) else CHECKSUM_REPORT
        try:
            await self.mgmtd.call(method, msg)
        except KvfsError as exc:
            log.warning("report to mgmtd failed: %s", exc.message)

    # -------------------------------------------------------------------------------- handlers

    async def _on_write(self, req: WriteReq, data: memoryview | None, ctx: CallContext) -> WriteResp:
        (reply,) = await self._write_all([msgspec.structs.replace(req, data=data if data is not None else b"")])
        if reply.errno:
            raise from_wire(reply.errno, reply.message)
        return reply

    async def _on_write_batch(self, batch: p.WriteBatch, data: memoryview | None, ctx: CallContext
                              ) -> p.WriteBatchResult:
        """Writes of several chunks in one request: fed to their members together, so that every replica stages
        and commits them as batches and forwards them as one message (chunkserver/README.md, "Batched writes").
        Each chunk is answered on its own."""
        pieces = _split(data, batch.sizes)
        if len(pieces) != len(batch.writes) or len({(w.chain_id, w.chunk_id) for w in batch.writes}) != len(pieces):
            raise KvfsError("a write batch whose sizes do not match its data, or that names a chunk twice",
                            errno.EINVAL)
        return p.WriteBatchResult(await self._write_all(
            [msgspec.structs.replace(w, data=piece) for w, piece in zip(batch.writes, pieces)]))

    async def _write_all(self, reqs: list[WriteReq]) -> list[WriteResp]:
        """Start client writes at their members, all before any waits, and wait for each one's reply; a write
        this server cannot take (not a head of its chain here) is answered ESTALE at once."""
        keys = [(r.client_id, r.request_id) for r in reqs]
        waiters = []
        for key in keys:
            waiters.append(self._waiters.setdefault(key, _Waiter()))
            waiters[-1].count += 1
        try:
            replies: list[WriteResp | None] = [None] * len(reqs)
            effects: dict[int, list[Effect]] = {}
            for i, req in enumerate(reqs):
                try:
                    member = self._member_for_chain(req.chain_id)
                    self._clock(member)
                    self._routing_may_be_behind(member, req)
                    try:
                        effects.setdefault(member.target_id, []).extend(member.handle(req))
                    except ProtocolError as exc:  # e.g. not the head any more: the client's routing is behind
                        raise StaleRouting(exc.message) from None
                except KvfsError as exc:
                    replies[i] = WriteResp(req.chain_id, req.chain_version, req.chunk_id, *keys[i],
                                           exc.errno or errno.EIO, exc.message)
            for target_id, target_effects in effects.items():
                self._execute(target_id, target_effects)
            for i, waiter in enumerate(waiters):
                if replies[i] is None:
                    await waiter.done.wait()
                    replies[i] = waiter.reply
        finally:
            for key, waiter in zip(keys, waiters):
                waiter.count -= 1
                if not waiter.count:
                    self._waiters.pop(key, None)
        return replies  # type: ignore[return-value]  # every one answered

    async def _on_peer(self, envelope: p.PeerEnvelope, data: memoryview | None, ctx: CallContext) -> Empty:
        msg = envelope.msg
        if isinstance(msg, ResyncState):
            msg = _attach_block_crcs(msg, data if data is not None else b"")
        self._on_peer_msgs([msg], [data])
        return Empty()

    async def _on_peer_batch(self, batch: p.PeerBatch, data: memoryview | None, ctx: CallContext) -> Empty:
        pieces = _split(data, batch.sizes)
        if len(pieces) != len(batch.msgs):
            raise KvfsError("a peer batch whose sizes do not match its data", errno.EINVAL)
        self._on_peer_msgs(batch.msgs, pieces)
        return Empty()

    def _on_peer_msgs(self, msgs: Sequence[Msg], data: Sequence[memoryview | bytes | None]) -> None:
        """Feed messages from a peer to their members, each member's together."""
        events: dict[int, list[Msg]] = {}
        for msg, piece in zip(msgs, data):
            if isinstance(msg, UpdateReq):  # the member always sees an update's bytes attached
                msg = msgspec.structs.replace(msg, data=piece if piece is not None else b"")
            target = self._chain_targets.get(msg.chain_id)
            if target is None:
                raise StaleRouting(f"no target of chain {msg.chain_id} here")
            member = self.members[target]
            self._clock(member)
            self._routing_may_be_behind(member, msg)
            events.setdefault(target, []).append(msg)
        for target, target_events in events.items():
            self._feed(target, *target_events)

    async def _on_version_query(self, q: VersionQuery, data: Any, ctx: CallContext) -> Any:
        member = self._member_for_chain(q.chain_id)
        self._clock(member)
        return member.answer_version_query(q)

    async def _on_read(self, batch: p.ReadBatch, data: Any, ctx: CallContext) -> Any:
        results: list[p.ReadResult] = [p.ReadResult()] * len(batch.reads)
        buffers: list[Any] = [b""] * len(batch.reads)

        async def one(i: int, r: p.ReadRange) -> None:
            try:
                version, buf = await self._read_one(r, ctx)
                results[i], buffers[i] = p.ReadResult(0, "", version, len(buf)), buf
            except KvfsError as exc:
                results[i] = p.ReadResult(exc.errno or errno.EIO, exc.message)

        if len(batch.reads) == 1:  # the common case: no task to spawn
            await one(0, batch.reads[0])
        else:
            async with trio.open_nursery() as nursery:
                for i, r in enumerate(batch.reads):
                    nursery.start_soon(one, i, r)
        return p.ReadBatchResult(results), [b for b in buffers if len(b)]

    async def _read_one(self, r: p.ReadRange, ctx: CallContext) -> tuple[int, memoryview | bytes]:
        if not 0 <= r.offset < p.MAX_CHUNK_SIZE or not 0 <= r.length <= p.MAX_CHUNK_SIZE:
            raise KvfsError(f"read range {r.offset}+{r.length} outside any chunk", errno.EINVAL)
        member, version = await self._readable_version(r.chain_id, r.chain_version, r.chunk_id)
        if version == 0:
            return 0, b""
        engine = self.engines[member.target_id]
        try:
            data = await self._engine_data(engine, r.chunk_id, r.offset, r.length, version, ctx)
        except ChecksumMismatch as exc:
            log.error("target %s chunk %s: %s; repairing from a peer", member.target_id, r.chunk_id, exc.message)
            await self._repair(member, r.chunk_id)
            data = await self._engine_data(engine, r.chunk_id, r.offset, r.length, version, ctx)
        return version, data

    async def _readable_version(self, chain_id: int, chain_version: int, chunk_id: ChunkId) -> tuple[ChainMember, int]:
        """This replica's member of the chain and the version a read may serve now (CRAQ: the clean committed one,
        or the one the tail says is committed); raises what the client should retry elsewhere."""
        member = self._member_for_chain(chain_id)
        self._clock(member)
        decision = member.read_decision(chunk_id, chain_version)
        if isinstance(decision, AskTail):
            address = self._address_of_target(decision.target)
            reply = await self.rpc.call(address, p.VERSION_QUERY, decision.query, timeout=5)
            decision = member.decide_with_tail(chunk_id, reply)
        if isinstance(decision, Retry):
            raise decision.error
        assert isinstance(decision, ServeVersion)
        return member, decision.version

    async def _on_locate_many(self, req: p.LocateChunks, data: Any, ctx: CallContext) -> p.Located:
        """Short-circuit reads: tell a client on this host where the versions a read would serve lie, and keep
        them there (pinned) for ``LOCATE_LEASE`` seconds while the client reads the files itself. Each version is
        chosen exactly as for a read; one the chain would not serve now is None (the client reads it over the
        network). A batch's pins are taken inline, those of versions still held in memory in one worker hop (they
        are written out first), and released together. A client elsewhere gets EPERM and reads over the
        network."""
        if not self._same_host(ctx.peer, req.boot_id):
            raise KvfsError(f"short-circuit reads are for clients on this host; {ctx.peer} is not", errno.EPERM)
        located: list[p.ChunkLocation | None] = [None] * len(req.ranges)
        chosen: list[tuple[int, ChunkEngine, p.ReadRange, int]] = []
        for i, r in enumerate(req.ranges):
            if not 0 <= r.offset < p.MAX_CHUNK_SIZE or not 0 <= r.length <= p.MAX_CHUNK_SIZE:
                continue
            try:
                member, version = await self._readable_version(r.chain_id, r.chain_version, r.chunk_id)
            except KvfsError as exc:
                log.debug("locate of chunk %s: %s", r.chunk_id, exc.message)
                continue
            if version == 0:
                located[i] = p.ChunkLocation(0)
            else:
                chosen.append((i, self.engines[member.target_id], r, version))
        if not chosen:
            return p.Located(located)

        def pin(engine: ChunkEngine, r: p.ReadRange, version: int, nowait: bool) -> Location | KvfsError | None:
            try:
                return engine.pin_location(r.chunk_id, version, r.offset, r.length, nowait, req.reads_back)
            except KvfsError as exc:
                return exc
            except BlockingIOError:
                return None

        # inline where the versions lie in their slots already; a held one is written out first, and that may
        # wait for the disk: those in one worker hop
        pinned = [pin(engine, r, version, True) for _, engine, r, version in chosen]
        held = [k for k, loc in enumerate(pinned) if loc is None]
        if held:
            settled = await self._readers.run(lambda: [pin(*chosen[k][1:], False) for k in held])
            for k, loc in zip(held, settled):
                pinned[k] = loc
        # the pins must outlive the deadline the client checks against: take the time after pinning
        deadline = time.monotonic_ns() + int(LOCATE_LEASE * 1e9)
        pins: dict[ChunkEngine, list[object]] = {}
        for (_, engine, _, _), loc in zip(chosen, pinned):
            if isinstance(loc, Location):
                pins.setdefault(engine, []).append(loc.pin)
        if pins:
            self._located.send_nowait((deadline, [functools.partial(engine.release_pins, held)
                                                  for engine, held in pins.items()]))
            LOCATED.inc(sum(map(len, pins.values())))
        for (i, engine, r, version), loc in zip(chosen, pinned):
            if isinstance(loc, Location):
                located[i] = p.ChunkLocation(loc.version, str(loc.path), loc.offset, loc.length, loc.first_block,
                                             loc.block_crcs, deadline)
                continue
            try:
                _hole_or_moved_on(loc, engine, r.chunk_id, version)
                located[i] = p.ChunkLocation(0)  # removed meanwhile: a hole
            except KvfsError as exc:  # moved on, or in several places (EXDEV): read over the network
                log.debug("locate of chunk %s: %s", r.chunk_id, exc.message)
        return p.Located(located)

    async def _release_located(self) -> None:
        """Release each locate's pins once its lease has ended, one task for all of them (a task each, sleeping
        out its lease, cost a fifth of a serving server's event loop in a get loop). They come in the order they
        were taken, and every lease is as long, so that is nearly the order of their deadlines: one that waits
        behind a later deadline is released late, never early. When the server stops, every pin goes."""
        try:
            async for deadline_ns, releases in self._located_out:
                try:
                    # past the deadline (and the slack) already, as the locates queued behind one that waited are:
                    # released without a wait, so a server answering hundreds of locates a second keeps up
                    wait = (deadline_ns - time.monotonic_ns()) / 1e9 + _LEASE_SLACK
                    if wait > 0:
                        await trio.sleep(wait)
                finally:
                    for release in releases:
                        release()
        finally:
            while True:
                try:
                    _, releases = self._located_out.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                for release in releases:
                    release()

    def _same_host(self, peer: str, boot_id: str) -> bool:
        """The peer connected from this host (loopback, or this server's own address) and runs on this kernel."""
        host = peer.rsplit(":", 1)[0].strip("[]")
        own = self.address.rsplit(":", 1)[0].strip("[]")
        try:
            local = ipaddress.ip_address(host).is_loopback or host == own
        except ValueError:
            local = False
        return local and bool(boot_id) and boot_id == shm.boot_id()

    async def _engine_data(self, engine: ChunkEngine, chunk_id: ChunkId, offset: int, length: int, version: int,
                           ctx: CallContext) -> memoryview | bytes:
        """The bytes of a read. Large ones are a loan (:meth:`ChunkEngine.lend`, in a worker thread: a direct read
        into a pooled buffer, or the slot file's mapping), released once the reply is out; small ones are copied
        into a pooled buffer, from the page cache inline, else in a thread. The engine pins the version when it starts reading: if it is gone by then (the read waited for
        a thread while a newer version committed), the chunk was removed (a hole) or moved on (retry)."""
        try:
            if length >= _LEND_FROM:
                lent = await self._readers.run(lambda: engine.lend(chunk_id, offset, length, version))
                ctx.after_reply(lent.release)
                return lent.data
            buf = memoryview(RECEIVED.take(length))  # filled by the read; only the part read goes out
            try:
                n = engine.read(chunk_id, offset, length, version=version, into=buf, nowait=True)[0]
            except BlockingIOError:  # some of it is on disk only: wait for it in a thread, not in the event loop
                n, _ = await self._readers.run(
                    lambda: engine.read(chunk_id, offset, length, version=version, into=buf))
            return buf[:n]
        except KvfsError as exc:
            _hole_or_moved_on(exc, engine, chunk_id, version)
            return b""

    async def _repair(self, member: ChainMember, chunk_id: ChunkId) -> None:
        """Replace a corrupt local copy with a peer's committed copy of the same version: only the blocks that
        fail their CRC where a peer has the version and its blocks make ours whole again, else the whole chunk."""
        assert member.config is not None
        committed, _ = member.chunk_versions(chunk_id)
        engine = self.engines[member.target_id]
        try:
            version, bad = await trio.to_thread.run_sync(lambda: engine.bad_blocks(chunk_id))
        except KvfsError:
            version, bad = -1, []
        for t in member.config.targets:
            if t.target_id == member.target_id or t.state.value != "serving":
                continue
            try:
                address = self._address_of_target(t.target_id)
                if version == committed and bad and await self._repair_blocks(engine, address, t.target_id, chunk_id,
                                                                              committed, bad):
                    log.info("target %s chunk %s: blocks %s repaired from target %s", member.target_id, chunk_id,
                             bad, t.target_id)
                    return
                fetched, data = await self.rpc.call_with_data(address, p.FETCH, p.FetchChunk(t.target_id, chunk_id))
            except KvfsError as exc:
                log.warning("repair source %s failed: %s", t.target_id, exc.message)
                continue
            if fetched.version != committed:
                continue
            await trio.to_thread.run_sync(
                lambda: engine.replace_full(chunk_id, fetched.version, data or b"", fetched.crc)
            )
            log.info("target %s chunk %s repaired from target %s", member.target_id, chunk_id, t.target_id)
            return
        raise ChecksumMismatch(f"chunk {chunk_id} is corrupt here and no peer holds v{committed}")

    async def _repair_blocks(self, engine: ChunkEngine, address: str, source: int, chunk_id: ChunkId, version: int,
                             bad: list[int]) -> bool:
        """Fetch blocks ``bad`` of ``version`` from target ``source`` and write them over ours; whether it worked
        (the source holds another version, or its blocks do not make ours whole: copy the chunk whole)."""
        fetched, data = await self.rpc.call_with_data(address, p.FETCH, p.FetchChunk(source, chunk_id, bad, version))
        if fetched.version != version:
            return False
        data = data or b""
        try:
            await trio.to_thread.run_sync(lambda: engine.repair_blocks(
                chunk_id, version, data, crc32c(data), block_runs(bad, fetched.length)))
        except KvfsError as exc:
            log.warning("chunk %s: blocks %s from target %s do not repair it (%s); copying it whole",
                        chunk_id, bad, source, exc.message)
            return False
        return True

    async def _on_fetch(self, req: p.FetchChunk, data: Any, ctx: CallContext) -> Any:
        engine = self.engines.get(req.target_id)
        if engine is None:
            raise StaleRouting(f"target {req.target_id} is not on this server")
        committed, _ = engine.versions(req.chunk_id)
        if committed is None:
            raise KvfsError(f"chunk {req.chunk_id} not on target {req.target_id}", errno.ENOENT)
        if req.blocks is None:
            buf, meta = await trio.to_thread.run_sync(lambda: engine.read(req.chunk_id, 0, p.MAX_CHUNK_SIZE))
            return p.FetchedChunk(meta.version, meta.crc, meta.length), buf
        if committed.version != req.version:
            return p.FetchedChunk(committed.version, committed.crc, committed.length), b""
        if sorted(set(req.blocks)) != req.blocks or any(not 0 <= b * BLOCK < committed.length for b in req.blocks):
            raise KvfsError(f"blocks {req.blocks[:8]} are not sorted blocks of chunk {req.chunk_id}", errno.EINVAL)
        runs = block_runs(req.blocks, committed.length)
        buf = await trio.to_thread.run_sync(lambda: engine.read_runs(req.chunk_id, committed.version, runs))
        return p.FetchedChunk(committed.version, committed.crc, committed.length), buf

    async def _on_remove(self, req: p.RemoveChunks, data: Any, ctx: CallContext) -> p.Removed:
        return p.Removed(await self._remove_chunks(lambda engine: engine.remove_from(req.inode, req.from_index)))

    async def _on_remove_files(self, req: p.RemoveFiles, data: Any, ctx: CallContext) -> p.Removed:
        return p.Removed(await self._remove_chunks(lambda engine: engine.remove_files(req.inodes)))

    async def _remove_chunks(self, remove: Callable[[ChunkEngine], list[ChunkId]]) -> int:
        """Remove chunks from every target's engine, then from its chain member's state: removals bypass the
        chain, and a member that still listed them would wait forever to copy them in a resync."""
        removed = await trio.to_thread.run_sync(lambda: {t: remove(e) for t, e in self.engines.items()})
        for target_id, chunk_ids in removed.items():
            member = self.members.get(target_id)
            if member is not None and chunk_ids:
                self._execute(target_id, member.forget(chunk_ids))
        return sum(map(len, removed.values()))

    async def _on_last_chunk(self, req: p.LastChunkQuery, data: Any, ctx: CallContext) -> p.LastChunk:
        last = p.LastChunk(-1, 0)
        for engine in self.engines.values():
            for meta in engine.list_chunks(req.inode):
                if meta.chunk_id.index > last.index and meta.length:
                    last = p.LastChunk(meta.chunk_id.index, meta.length)
        return last

    async def _on_space(self, req: Empty, data: Any, ctx: CallContext) -> p.Space:
        capacity = used = free = 0
        for engine in self.engines.values():
            c, u, f = engine.space()
            capacity, used, free = capacity + c, used + u, free + f
        return p.Space(capacity, used, free)

    async def _on_flush(self, req: p.FlushTargets, data: Any, ctx: CallContext) -> Empty:
        unknown = set(req.target_ids) - set(self.engines)
        if unknown:
            raise StaleRouting(f"targets {sorted(unknown)} are not on this server")
        await self._flush([self.engines[t] for t in req.target_ids], "client")
        return Empty()

    async def _on_chunk_stat(self, req: p.ChunkStatQuery, data: Any, ctx: CallContext) -> p.ChunkStat:
        engine = self.engines.get(req.target_id)
        if engine is None:
            raise StaleRouting(f"target {req.target_id} is not on this server")
        committed, pending = engine.versions(req.chunk_id)
        if committed is None:
            return p.ChunkStat(0, 0, 0, pending.version if pending else 0)
        return p.ChunkStat(committed.version, committed.length, committed.crc, pending.version if pending else 0)
