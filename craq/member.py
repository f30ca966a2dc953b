"""The CRAQ chain member: a sans-I/O state machine for one storage target in one chain.

Rules
-----
1. A chunk ``(inode, index)`` has a committed version and at most one pending version.
2. The head serializes writes per chunk: one in flight, later ones queued; it assigns ``committed + 1``.
3. A successor accepts an update only if it is the next version (``committed + 1``), or a full-chunk
   replace of a newer version. A duplicate of its pending version is a retransmit (idempotent); a duplicate
   of its committed version is acknowledged again. Anything else is refused with ``VERSION_GAP`` so the
   predecessor repairs it with a full-chunk replace.
3a. A syncing member takes a partial update of a chunk only once the live chain has written that chunk there
   since it started syncing (by a full replace or a resync copy): a version it held from before may be of
   another lineage under the same number, so a partial update on top of it, or acknowledged as already there,
   could leave it with other bytes. Until then it answers ``VERSION_GAP`` and gets the chunk whole.
4. The last member of the write chain (serving targets, then at most one syncing target) commits first;
   the commit flows back as :class:`UpdateAck`; the head commits last and then replies to the client.
5. Data carries a CRC32C. This module computes ``crc32c(data)`` itself and refuses a mismatch (by 64 KiB blocks,
   whose CRCs ``PersistPending`` hands on so that the engine need not read the data again). Acks carry the
   sender's committed chunk CRC; a predecessor whose own CRC differs reports it to mgmtd (comparing each
   adjacent pair finds any divergence along the chain).
6. A message whose chain version differs from ours is refused (clients get ``StaleRouting``/ESTALE, peers a
   ``STALE`` ack or silence); the sender re-drives once it has the new chain config.
7. Reads: only serving members with an unexpired mgmtd lease answer. A clean chunk answers from its committed
   version. A dirty chunk asks the read tail (last serving target) which version is committed. The read tail
   itself serves its committed version, except for pending versions it held when it *became* tail (an
   old tail may have committed and served them), which it commits before serving them, and except for
   every pending version once it has reported :class:`ResyncDone` for its syncing successor (7a).
7a. Handing the tail over: the syncing successor is the end of the write chain, so it commits a write before
   the read tail does, and mgmtd makes it serving -- the new read tail -- as soon as the ResyncDone arrives, with
   no lease to wait for: the old tail may keep serving under the old chain version (a heartbeat reply still on
   its way, or cut off from mgmtd with a valid lease) while the new tail serves a version it has not committed.
   So from its ResyncDone until the next chain config, the read tail serves clean chunks only (a dirty one: retry,
   EAGAIN); the successor can only hold versions that passed through it, so its clean committed version is
   still the newest anyone serves.
8. Client retries carry the same ``(client_id, request_id)``. Every version carries a table of the highest
   request id it includes per client, adopted when the version commits (never earlier: a pending write may
   be dropped), so a retry at any (new) head attaches to the pending write or is answered from the committed
   table. Clients issue one write at a time per chunk, with growing request ids.
9. Recovery: in a recovering chain (:attr:`ChainConfig.recovering`, set by mgmtd when the only serving target came
   back after it may have lost unflushed writes) the serving member is *fenced*: it answers reads and writes
   "retry" (EAGAIN), neither forwards nor commits its pending versions, and resyncs its syncing successor
   backwards: from the successor's list it asks (:class:`ResyncPull`) for every chunk the successor committed
   newer than anything it holds, commits each once persisted, and then reports :class:`ResyncDone`. While the
   fenced member has served nothing, every replica's committed versions of a chunk are prefixes of one lineage,
   so the newest one is the right one and equal versions hold equal bytes.
10. Removal (a deleted file's chunks, a truncation's tail) bypasses the chain: each chunk server removes them
   itself, and one whose targets are offline misses it. So a resync drops what the syncing successor listed
   and its predecessor does not hold at all (:class:`ResyncDrop`): a committed chunk anywhere was committed by
   the tail, so a serving member lacks it only once it was removed. The successor drops a chunk only at the
   listed version with nothing pending (a write since has made it anew), and the resync is done only once every
   drop is confirmed (:class:`ResyncDropped`), so a target never serves a chunk its chain removed.

Theory of operation
-------------------
A write at the head becomes ``PersistPending``; when the driver reports :class:`Persisted` the member
forwards an :class:`UpdateReq` to its successor, or, as the end of the write chain, emits ``Commit`` and acks
its predecessor. Each ack commits one more member upstream. On a chain reconfiguration every pending
version that is already persisted is forwarded again to the (new) successor, or committed at once by a new
end of chain, so a write that any member committed (and so possibly acknowledged or read) survives and
reaches every replica; a write only some members hold is finished too, which is allowed because its client
was never answered. A member that leaves the chain answers its clients with ESTALE so they retry elsewhere.

A returning target sits at the end of the write chain as ``syncing``: its predecessor forwards writes to it
as full-chunk replaces, asks it for its chunk versions (:class:`ResyncQuery`) and copies every committed chunk
whose version or CRC differs (only the blocks that differ where the driver can: :class:`SendChunk`); when all
are acknowledged it reports :class:`ResyncDone` to mgmtd, which makes the target serving, and so the new read
tail (rule 7a: from then on the old tail serves clean chunks only).
The lease (from mgmtd heartbeats, shorter than mgmtd's failure timeout) fences reads at a member that mgmtd
may already have removed from the chain.

Driving
-------
``handle(event) -> list[Effect]`` for every input; effects are executed in list order. ``PersistPending`` is
asynchronous: the driver reports its completion with :class:`Persisted`; every other effect is done before
the next one starts. A ``Tick`` costs O(chunks with a pending version), not O(chunks): the member keeps an
index of them (retransmitted in chunk creation order, so runs are deterministic). Reads use the pure queries
:meth:`ChainMember.read_decision`, :meth:`ChainMember.answer_version_query` and
:meth:`ChainMember.decide_with_tail`. Chunks that the engine removed (file deletion and truncation bypass the
chain) the driver hands to :meth:`ChainMember.forget`. ``handle`` raises
:class:`ProtocolError` for an event the current state does not expect; nothing else changes replication state.
"""

from __future__ import annotations

import collections
import enum
import itertools
from errno import EINVAL, EIO, ENOENT
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Union

import msgspec
from kvfs.crc import block_crcs, fold_crc
from kvfs.errors import ChecksumMismatch, KvfsError, NotCommitted, ProtocolError, StaleRouting

from kvfs.craq.messages import (
    AckStatus,
    BlockDelta,
    ChainConfig,
    ChecksumReport,
    ChunkId,
    ChunkSummary,
    Msg,
    ResyncDone,
    ResyncDrop,
    ResyncDropped,
    ResyncPull,
    ResyncQuery,
    ResyncState,
    TargetState,
    UpdateAck,
    UpdateReq,
    VersionQuery,
    VersionReply,
    WriteReq,
    WriteResp,
)

# ---------------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Configure:
    """A chain config from mgmtd (heartbeat reply) and the lease it grants: reads are served until then."""

    config: ChainConfig
    lease_until: float


@dataclass(frozen=True)
class Persisted:
    """The driver's ``write_pending`` finished; the engine's resulting full-chunk CRC and length."""

    chunk_id: ChunkId
    version: int
    chunk_crc: int
    chunk_len: int


@dataclass(frozen=True)
class PersistFailed:
    """The driver's ``write_pending`` failed (disk full, I/O error) and stored nothing."""

    chunk_id: ChunkId
    version: int
    errno: int
    message: str


@dataclass(frozen=True)
class Tick:
    """Time passes: retransmit what has not been acknowledged within ``retransmit_after`` (only chunks with a
    pending version are looked at)."""

    now: float


Event = Union[
    Configure, Persisted, PersistFailed, Tick, WriteReq, UpdateReq, UpdateAck, ResyncQuery, ResyncState, ResyncPull,
    ResyncDrop, ResyncDropped,
]

# --------------------------------------------------------------------------------------------- effects


@dataclass(frozen=True)
class Send:
    """Send ``msg`` to member ``target``."""

    target: int
    msg: Msg


@dataclass(frozen=True)
class SendChunk:
    """Send ``msg`` (a full-chunk :class:`UpdateReq`) with ``data`` = the whole chunk at ``msg.version``,
    read from the local engine (committed or pending).

    ``theirs``: a resync copy's receiver listed this copy of the chunk; where it names block CRCs the driver may
    send only the blocks that differ (``msg.delta``, :func:`kvfs.crc.changed_blocks`) instead of the whole chunk."""

    target: int
    msg: UpdateReq
    theirs: ChunkSummary | None = None


@dataclass(frozen=True)
class PersistPending:
    """``engine.write_pending(...)`` in the background, then report :class:`Persisted`.

    ``crc`` covers ``data`` (the whole chunk when ``full_replace``); ``requests`` is the idempotency table to
    store with this version (see :class:`ChunkState`). ``force``: a full replace whose version is not newer
    than the committed one (a syncing target overwriting what it held before); it only happens at the end
    of the write chain, where ``Commit`` follows at once, so ``engine.replace_full`` may serve it.
    """

    chunk_id: ChunkId
    version: int
    offset: int
    data: bytes
    crc: int
    full_replace: bool
    requests: dict[int, int]
    force: bool = False
    #: CRC32Cs of ``data``'s 64 KiB blocks (:func:`kvfs.crc.block_crcs`), computed by the check of the data
    block_crcs: list[int] | None = field(default=None, compare=False, repr=False)
    extents: list[tuple[int, int]] | None = None  # the runs ``data`` holds (:class:`WriteReq`)
    #: a resync copy of only the blocks that differ: ``engine.write_delta`` (which checks the blocks it keeps)
    delta: BlockDelta | None = None


@dataclass(frozen=True)
class Commit:
    """``engine.commit(chunk_id, version)``: the pending version becomes the committed one."""

    chunk_id: ChunkId
    version: int


@dataclass(frozen=True)
class Abort:
    """``engine.abort(chunk_id, version)``: drop a pending version that the chain abandoned."""

    chunk_id: ChunkId
    version: int


@dataclass(frozen=True)
class DropChunks:
    """Remove these chunks from the engine (rule 10), then send ``ack`` to member ``target``: the predecessor
    counts them dropped only once they are gone from the disk."""

    chunk_ids: tuple[ChunkId, ...]
    target: int
    ack: ResyncDropped


@dataclass(frozen=True)
class ReplyClient:
    msg: WriteResp


@dataclass(frozen=True)
class ReportToMgmtd:
    msg: ResyncDone | ChecksumReport


Effect = Union[Send, SendChunk, PersistPending, Commit, Abort, DropChunks, ReplyClient, ReportToMgmtd]

# ------------------------------------------------------------------------------------- read decisions


@dataclass(frozen=True)
class ServeVersion:
    """Read this version (committed, or pending that the tail confirmed committed) from the engine."""

    version: int


@dataclass(frozen=True)
class AskTail:
    """Send ``query`` to ``target`` (the read tail), then call :meth:`ChainMember.decide_with_tail`."""

    target: int
    query: VersionQuery


@dataclass(frozen=True)
class Retry:
    """Answer the client with ``error``; it retries (elsewhere, or after refreshing routing)."""

    error: KvfsError


ReadDecision = Union[ServeVersion, AskTail, Retry]

# ----------------------------------------------------------------------------------------- chunk state


class Phase(enum.Enum):
    CLEAN = "clean"  # no pending version
    PERSISTING = "persisting"  # pending version being written by the driver
    FORWARDED = "forwarded"  # pending version persisted and sent on; waiting for the ack


@dataclass(frozen=True)
class ChunkState:
    """What the engine keeps across restarts; a restarted member starts from this.

    ``requests``/``pending_requests``: the idempotency table stored with the committed/pending version.
    """

    committed_version: int = 0
    crc: int = 0
    length: int = 0
    requests: dict[int, int] = field(default_factory=dict)
    pending_version: int = 0  # 0: none
    pending_crc: int = 0
    pending_length: int = 0
    pending_requests: dict[int, int] = field(default_factory=dict)


@dataclass
class _Pending:
    update: UpdateReq  # as accepted, data included, so it can be re-driven after a reconfiguration
    requests: dict[int, int]  # the idempotency table once this version commits
    persisted: bool = False
    chunk_crc: int = 0
    chunk_len: int = 0
    resend_at: float = 0.0  # when a Tick forwards it again if no ack has come
    maybe_visible: bool = False  # held when this member became read tail: must commit before serving
    orphan: bool = False  # from before this member started syncing: another lineage, never committed
    pulled: bool = False  # a recovering member's copy of a newer committed version (rule 9): commit, don't forward
    waiters: list[tuple[int, int]] = field(default_factory=list)  # head only: (client_id, request_id)


@dataclass
class _Chunk:
    cid: ChunkId
    committed: int = 0
    crc: int = 0
    length: int = 0
    requests: dict[int, int] = field(default_factory=dict)  # of the committed version only
    #: head only: writes waiting for the pending one; made on the first (an empty deque is ~600 bytes, and a
    #: server holds a record per chunk)
    queue: collections.deque[WriteReq] | None = None
    fresh: bool = True  # syncing member: written by the live chain since it started syncing
    seq: int = 0  # creation order at the member
    dirty: dict[ChunkId, _Chunk] | None = None  # the member's index of chunks with a pending version
    _pending: _Pending | None = None

    @property
    def pending(self) -> _Pending | None:
        return self._pending

    @pending.setter
    def pending(self, p: _Pending | None) -> None:
        # every change of the pending version goes through here, so the index cannot miss one
        self._pending = p
        if self.dirty is not None:
            if p is None:
                self.dirty.pop(self.cid, None)
            else:
                self.dirty[self.cid] = self

    @property
    def phase(self) -> Phase:
        if self.pending is None:
            return Phase.CLEAN
        return Phase.FORWARDED if self.pending.persisted else Phase.PERSISTING


@dataclass
class _ResyncJob:
    """Predecessor side of a resync: chunks not yet confirmed at the syncing successor."""

    target: int
    outstanding: set[ChunkId] | None = None  # None until the successor's ResyncState arrived
    sent_at: float = 0.0
    done: bool = False  # ResyncDone reported: mgmtd may make the successor the read tail at any moment (rule 7a)
    total: int = 0  # chunks found to differ, for progress reports
    pull: bool = False  # recovering (rule 9): ``outstanding`` are chunks to pull from the successor, not to copy
    #: the successor's copies as it listed them, so a copy may carry only the blocks that differ; dropped for a
    #: chunk whose delta it refused, which then goes whole
    theirs: dict[ChunkId, ChunkSummary] = field(default_factory=dict)
    #: chunks the successor listed (at these committed versions) that this member does not hold: removed while it
    #: was away, to be dropped there (rule 10); also in ``outstanding`` until confirmed
    drops: dict[ChunkId, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- the member


class ChainMember:
    """One target's replication state in one chain. See the module docstring for the rules."""

    def __init__(
        self,
        target_id: int,
        chain_id: int,
        chunks: dict[ChunkId, ChunkState] | None = None,
        retransmit_after: float = 0.05,
        *,
        retransmit_scan_every: float = 0.0,
        resend_refused_after: float = 0.02,
    ) -> None:
        """``retransmit_after``: how long a forwarded update waits for its ack before it is sent again;
        ``resend_refused_after``: how long after a refusal that only asks to come back later (``BUSY``: the
        successor is persisting another version of the chunk, a resync copy say; ``STALE``: the two views of the
        chain differ for a moment; ``CHECKSUM``: damaged in transit), since those clear in milliseconds and a
        client's write waits on them. ``retransmit_scan_every``: look for unacknowledged updates at most this often
        (0: every tick); the simulator raises it to delay retransmissions, which must only ever cost time."""
        self.target_id = target_id
        self.chain_id = chain_id
        self.retransmit_after = retransmit_after
        self.resend_refused_after = resend_refused_after
        self.retransmit_scan_every = retransmit_scan_every
        self._last_scan = 0.0
        self.config: ChainConfig | None = None
        self._chain: list[int] = []  # the config's write chain, head first: asked several times per update
        self._state: TargetState | None = None  # this target's state in the config: asked at every message
        self.lease_until = 0.0
        self.now = 0.0
        self._chunks: dict[ChunkId, _Chunk] = {}
        self._dirty: dict[ChunkId, _Chunk] = {}  # chunks with a pending version (what a Tick looks at)
        self._resync: _ResyncJob | None = None
        self._forgotten_persists: set[tuple[ChunkId, int]] = set()  # (chunk, version) forgotten mid-persist
        self._queries = 0
        self._created = itertools.count()  # chunk creation order
        for cid, meta in (chunks or {}).items():
            c = self._chunk(cid)
            c.committed, c.crc, c.length, c.requests = meta.committed_version, meta.crc, meta.length, dict(meta.requests)
            if meta.pending_version:
                # Kept in case this target returns as the last one serving (then it must finish the write);
                # returning as syncing drops it. Its bytes are only in the engine: re-driven as a full chunk.
                u = UpdateReq(chain_id, 0, cid, target_id, meta.pending_version, 0, meta.pending_crc, full_replace=True)
                c.pending = _Pending(u, dict(meta.pending_requests), persisted=True, chunk_crc=meta.pending_crc,
                                     chunk_len=meta.pending_length)

    # ----------------------------------------------------------------------------------- public queries

    @property
    def chain_version(self) -> int:
        return self.config.chain_version if self.config else 0

    @property
    def state(self) -> TargetState | None:
        return self._state

    def chunk_versions(self, chunk_id: ChunkId) -> tuple[int, int | None]:
        """(committed, pending or None), for tests and admin tools."""
        c = self._chunks.get(chunk_id)
        if c is None:
            return (0, None)
        return (c.committed, c.pending.update.version if c.pending else None)

    def has_timers(self) -> bool:
        """Whether a :class:`Tick` can do anything: a forwarded update waits for its ack, or a resync runs. A driver
        may tick an idle member rarely, as long as it ticks before asking it anything that depends on the time
        (reads check the lease against the last tick's clock)."""
        return bool(self._dirty) or self._resync is not None

    def resync_progress(self) -> tuple[int, int, int] | None:
        """(successor, chunks still to copy, chunks to copy in all) of the resync this member drives, or None.

        Before the successor has listed its chunks the total is unknown and reported as (successor, -1, -1)."""
        job = self._resync
        if job is None:
            return None
        if job.outstanding is None:
            return (job.target, -1, -1)
        return (job.target, len(job.outstanding), job.total)

    def read_decision(self, chunk_id: ChunkId, chain_version: int) -> ReadDecision:
        """How to answer a client read of ``chunk_id``; changes no replication state."""
        refusal = self._read_refusal(chain_version)
        if refusal:
            return refusal
        c = self._chunks.get(chunk_id)
        if c is None or c.pending is None:
            return ServeVersion(c.committed if c else 0)
        tail = self.config.read_tail()
        if tail == self.target_id:
            hidden = self._hidden_pending(c.pending)
            return Retry(NotCommitted(hidden)) if hidden else ServeVersion(c.committed)
        self._queries += 1
        return AskTail(tail, VersionQuery(self.chain_id, self.chain_version, chunk_id, self.target_id, self._queries))

    def answer_version_query(self, q: VersionQuery) -> VersionReply:
        """The read tail's answer to :class:`VersionQuery` (pure)."""
        refusal = self._read_refusal(q.chain_version)
        if refusal is None and self.config.read_tail() != self.target_id:
            refusal = Retry(StaleRouting("not the read tail"))
        c = self._chunks.get(q.chunk_id) or _Chunk(q.chunk_id)
        if refusal is None and c.pending is not None and self._hidden_pending(c.pending):
            refusal = Retry(NotCommitted(self._hidden_pending(c.pending)))
        if refusal is not None:
            return VersionReply(self.chain_id, self.chain_version, q.chunk_id, q.query_id, errno=refusal.error.errno)
        return VersionReply(self.chain_id, self.chain_version, q.chunk_id, q.query_id, c.committed)

    def _hidden_pending(self, p: _Pending) -> str:
        """At the read tail: why a pending version may already be committed and served elsewhere, so the
        committed one must not be served ("" if it may be served)."""
        if p.maybe_visible:
            return "pending at new tail"  # rule 7: an old tail may have committed and served it
        if self._resync is not None and self._resync.done:
            return "pending while handing the tail over"  # rule 7a: the syncing successor may already serve it
        return ""

    def decide_with_tail(self, chunk_id: ChunkId, reply: VersionReply) -> ServeVersion | Retry:
        """Given the tail's answer, serve that version if this member still holds it."""
        if reply.errno:
            return Retry(KvfsError("tail refused version query", reply.errno))
        if reply.chain_version != self.chain_version:
            return Retry(StaleRouting("chain changed during read"))
        c = self._chunks.get(chunk_id) or _Chunk(chunk_id)
        v = reply.committed_version
        if v == c.committed or (c.pending is not None and c.pending.persisted and c.pending.update.version == v):
            return ServeVersion(v)
        return Retry(NotCommitted("version moved on during read"))

    # ----------------------------------------------------------------------------------------- handle

    def forget(self, chunk_ids: Iterable[ChunkId]) -> list[Effect]:
        """The engine removed these chunks (their file was deleted, or truncated below them): drop their state.

        Otherwise a resync would wait forever for copies of bytes that no longer exist (the driver cannot read
        them), and the member would keep every chunk ever written. A write still waiting on one fails with
        ENOENT; the late completion of its persist is aborted (:meth:`handle`)."""
        gone = KvfsError("chunk removed: its file was deleted or truncated", ENOENT)
        job = self._resync
        effects: list[Effect] = []
        resolved = False
        for cid in chunk_ids:
            c = self._chunks.pop(cid, None)
            if c is None:
                continue
            if c.pending is not None:
                effects += [self._reply(cid, key, gone) for key in c.pending.waiters]
                if not c.pending.persisted:
                    self._forgotten_persists.add((cid, c.pending.update.version))
                c.pending = None  # out of the dirty index too
            effects += [self._reply(cid, (w.client_id, w.request_id), gone) for w in c.queue or ()]
            if job is not None and job.outstanding and cid in job.outstanding:
                job.outstanding.discard(cid)
                resolved = True
        if resolved:
            effects += self._resync_maybe_done(job)
        return effects

    def handle(self, event: Event) -> list[Effect]:
        """Feed one input; returns the effects to execute, in order."""
        if isinstance(event, Configure):
            return self._configure(event)
        if isinstance(event, Tick):
            return self._tick(event.now)
        if isinstance(event, (Persisted, PersistFailed)):
            if (event.chunk_id, event.version) in self._forgotten_persists:  # drop what the engine staged
                self._forgotten_persists.discard((event.chunk_id, event.version))
                return [Abort(event.chunk_id, event.version)] if isinstance(event, Persisted) else []
            return self._dispatch(self._chunk(event.chunk_id), event)
        if isinstance(event, Msg):
            if event.chain_id != self.chain_id:
                raise ProtocolError(f"chain {event.chain_id} message at member of chain {self.chain_id}")
            if self.config is None or event.chain_version != self.chain_version or self.state not in _IN_CHAIN:
                return self._refuse_stale(event)
            if isinstance(event, ResyncQuery):
                return self._resync_query(event)
            if isinstance(event, ResyncState):
                return self._resync_state(event)
            if isinstance(event, ResyncPull):
                return self._resync_pull(event)
            if isinstance(event, ResyncDrop):
                return self._resync_drop(event)
            if isinstance(event, ResyncDropped):
                return self._resync_dropped(event)
            if isinstance(event, UpdateAck) and event.chunk_id not in self._chunks:
                return self._dispatch(_Chunk(event.chunk_id), event)  # late, of a forgotten chunk: keep it forgotten
            if isinstance(event, (WriteReq, UpdateReq, UpdateAck)):
                return self._dispatch(self._chunk(event.chunk_id), event)
        raise ProtocolError(f"unexpected event {type(event).__name__}")

    def _dispatch(self, c: _Chunk, event: Event) -> list[Effect]:
        action = _TRANSITIONS.get((c.phase, type(event)))
        if action is None:
            raise ProtocolError(f"{type(event).__name__} not expected for a {c.phase.value} chunk")
        return action(self, c, event)

    # ---------------------------------------------------------------------------------- client writes

    def _write(self, c: _Chunk, w: WriteReq) -> list[Effect]:
        """A client write at the head: start it, attach it to the same pending write, or queue it."""
        if self._write_chain()[0] != self.target_id:
            raise ProtocolError(f"write for chunk {w.chunk_id} at non-head target {self.target_id}")
        blocks = _checked_blocks(w)
        if blocks is None:
            return [self._reply(w.chunk_id, (w.client_id, w.request_id), ChecksumMismatch("write data CRC"))]
        if w.full_replace and (w.offset or w.extents is not None):
            return [self._reply(w.chunk_id, (w.client_id, w.request_id),
                                KvfsError("a full replace is one run at offset 0", EINVAL))]
        key = (w.client_id, w.request_id)
        if self._fenced():
            return [self._reply(w.chunk_id, key, NotCommitted(f"chain {self.chain_id} is recovering; retry"))]
        if c.pending is not None and (c.pending.update.client_id, c.pending.update.request_id) == key:
            if key not in c.pending.waiters:
                c.pending.waiters.append(key)
            return []
        if c.requests.get(w.client_id, -1) >= w.request_id:
            return [self._reply(w.chunk_id, key, None, c.committed)]  # retry of a write already applied
        if c.pending is not None:
            if c.queue is None:
                c.queue = collections.deque()
            if all((q.client_id, q.request_id) != key for q in c.queue):
                c.queue.append(w)
            return []
        return self._start(c, w, blocks)

    def _start(self, c: _Chunk, w: WriteReq, blocks: list[int]) -> list[Effect]:
        u = UpdateReq(
            self.chain_id, self.chain_version, w.chunk_id, self.target_id, c.committed + 1, w.offset, w.crc,
            full_replace=w.full_replace, client_id=w.client_id, request_id=w.request_id, data=w.data,
            extents=w.extents,
        )
        effects = self._accept(c, u, blocks)
        c.pending.waiters.append((w.client_id, w.request_id))
        return effects

    def _reply(self, chunk_id: ChunkId, key: tuple[int, int], error: KvfsError | None, version: int = 0) -> Effect:
        errno, message = (error.errno, error.message) if error else (0, "")
        return ReplyClient(WriteResp(self.chain_id, self.chain_version, chunk_id, *key, errno, message, version))

    # -------------------------------------------------------------------------------------- updates

    def _update(self, c: _Chunk, u: UpdateReq) -> list[Effect]:
        """An update from the predecessor (rule 3), or a pulled chunk from the successor (rule 9)."""
        job = self._resync
        if job is not None and job.pull and u.from_target == job.target:
            return self._pulled(c, u)
        chain = self._write_chain()
        i = chain.index(self.target_id)
        if i == 0 or chain[i - 1] != u.from_target:
            raise ProtocolError(f"update from {u.from_target}, not the predecessor of {self.target_id}")
        blocks = _checked_blocks(u)
        if blocks is None:
            return [self._ack(u, AckStatus.CHECKSUM, c)]
        p = c.pending
        if p is not None and not p.orphan and u.version == p.update.version:
            # retransmit: forward again if we already did (the successor may have missed it)
            return self._forward(c) if p.persisted and self._successor() else []
        if self.state is TargetState.SYNCING and not c.fresh and not u.full_replace:
            return [self._ack(u, AckStatus.VERSION_GAP, c)]  # our copy may be of another lineage: take it whole first
        if p is None and u.version == c.committed and (c.fresh or not u.full_replace):
            return [self._ack(u, AckStatus.OK, c)]  # already committed here; our ack was lost
        if u.resync and c.fresh and u.version < c.committed:
            return [self._ack(u, AckStatus.OK, c)]  # the live chain already wrote a newer version
        if p is not None:
            if not p.persisted or p.orphan:
                return [self._ack(u, AckStatus.BUSY, c)]
            if not (u.full_replace and u.version > p.update.version):
                return [self._ack(u, AckStatus.VERSION_GAP, c)]
        elif not (u.version == c.committed + 1 or (u.full_replace and (not c.fresh or u.version > c.committed))):
            return [self._ack(u, AckStatus.VERSION_GAP, c)]
        if u.delta is not None and (p is not None or (c.committed, c.crc) != (u.delta.base_version, u.delta.base_crc)):
            return [self._ack(u, AckStatus.VERSION_GAP, c)]  # made against a copy we no longer hold: send it whole
        c.fresh = True
        return self._accept(c, u, blocks)

    def _accept(self, c: _Chunk, u: UpdateReq, blocks: list[int]) -> list[Effect]:
        requests = dict(u.requests if u.full_replace and u.requests is not None else c.requests)
        if u.client_id:
            requests[u.client_id] = max(requests.get(u.client_id, -1), u.request_id)
        c.pending = _Pending(u, requests)
        force = u.full_replace and u.version <= c.committed
        return [PersistPending(u.chunk_id, u.version, u.offset, u.data or b"", u.crc, u.full_replace, dict(requests),
                               force, blocks, u.extents, u.delta)]

    def _persisted(self, c: _Chunk, e: Persisted) -> list[Effect]:
        if e.version != c.pending.update.version:
            raise ProtocolError(f"persisted version {e.version}, pending is {c.pending.update.version}")
        if c.pending.orphan:
            c.pending = None  # the engine's pending version is garbage; the next full replace overwrites it
            return []
        c.pending.persisted, c.pending.chunk_crc, c.pending.chunk_len = True, e.chunk_crc, e.chunk_len
        if self.state not in _IN_CHAIN:
            return []
        if c.pending.pulled and self._fenced():
            return self._commit(c) + self._harvested(c.cid)
        return self._forward(c) if self._successor() else self._commit(c)

    def _forward(self, c: _Chunk) -> list[Effect]:
        """Send the (persisted) pending version on as received; whole when only the engine has the bytes (after a
        restart), and a full replace to a syncing successor as a forward of its own (not as the copy or pull it
        came as). A syncing successor refuses a partial one (``VERSION_GAP``, and ``_acked`` sends it whole)
        unless the live chain wrote its copy of the chunk since it started syncing (rule 3a)."""
        succ = self._successor()
        p = c.pending
        p.resend_at = self.now + self.retransmit_after
        if p.update.data is None or (p.update.full_replace and self.config.state_of(succ) is TargetState.SYNCING):
            return [SendChunk(succ, self._full_update(c, p.update.version, p.chunk_crc, resync=False))]
        return [Send(succ, msgspec.structs.replace(p.update, chain_version=self.chain_version, from_target=self.target_id))]

    def _full_update(self, c: _Chunk, version: int, crc: int, resync: bool) -> UpdateReq:
        """The whole chunk at ``version`` (the driver attaches the bytes): forward to a syncing target,
        repair of a successor that refused, or (``resync``) a resync copy of a committed version."""
        u = c.pending.update if c.pending is not None and not resync else None
        return UpdateReq(
            self.chain_id, self.chain_version, c.cid, self.target_id, version, 0, crc, full_replace=True,
            resync=resync, client_id=u.client_id if u else 0, request_id=u.request_id if u else 0,
            requests=dict(c.pending.requests if u else c.requests),
        )

    def _commit(self, c: _Chunk) -> list[Effect]:
        """Commit the pending version; ack upstream, or (head) answer the clients and start the next write."""
        p = c.pending
        cid = p.update.chunk_id
        c.committed, c.crc, c.length, c.requests, c.pending = p.update.version, p.chunk_crc, p.chunk_len, p.requests, None
        effects: list[Effect] = [Commit(cid, c.committed)]
        pred = self._predecessor()
        if pred is not None:
            effects.append(Send(pred, UpdateAck(
                self.chain_id, self.chain_version, cid, self.target_id, c.committed, AckStatus.OK,
                c.committed, c.crc, c.length)))
            return effects
        return effects + [self._reply(cid, key, None, c.committed) for key in p.waiters] + self._start_queued(c)

    def _ack(self, u: UpdateReq, status: AckStatus, c: _Chunk) -> Effect:
        return Send(u.from_target, UpdateAck(
            self.chain_id, self.chain_version, u.chunk_id, self.target_id, u.version, status,
            c.committed, c.crc, c.length, u.resync))

    # ------------------------------------------------------------------------------------------ acks

    def _acked(self, c: _Chunk, a: UpdateAck) -> list[Effect]:
        if a.from_target != self._successor():
            raise ProtocolError(f"ack from {a.from_target}, not the successor of {self.target_id}")
        effects = self._resync_acked(a)
        p = c.pending
        if p is None or not p.persisted or a.version != p.update.version:
            return effects  # an ack of a resync copy, or a late duplicate
        if a.status is AckStatus.VERSION_GAP:
            return effects + [SendChunk(a.from_target, self._full_update(c, p.update.version, p.chunk_crc, resync=False))]
        if a.status is AckStatus.FAILED:
            return effects + [Abort(c.cid, p.update.version)] + self._abandon(c, KvfsError(a.message, a.errno))
        if a.status is not AckStatus.OK:  # BUSY / CHECKSUM / STALE: the tick retransmits, soon
            p.resend_at = min(p.resend_at, self.now + self.resend_refused_after)
            return effects
        if (a.chunk_crc, a.chunk_len) != (p.chunk_crc, p.chunk_len):
            effects.append(ReportToMgmtd(ChecksumReport(
                self.chain_id, self.chain_version, a.chunk_id, self.target_id, a.from_target, a.version)))
        return effects + self._commit(c)

    def _persist_failed(self, c: _Chunk, e: PersistFailed) -> list[Effect]:
        """Nothing was stored: no member can have committed this version, so the chain abandons it."""
        if e.version != c.pending.update.version:
            raise ProtocolError(f"failed version {e.version}, pending is {c.pending.update.version}")
        u = c.pending.update
        if u.delta is not None:  # a block it kept is corrupt here, or the copy moved on: ask for the chunk whole
            c.pending = None
            return [self._ack(u, AckStatus.VERSION_GAP, c)]
        return self._abandon(c, KvfsError(e.message, e.errno))

    def _abandon(self, c: _Chunk, error: KvfsError) -> list[Effect]:
        """Drop the pending version here; tell the predecessor, or (head) fail the clients and go on."""
        p = c.pending
        c.pending = None
        pred = self._predecessor()
        if pred is not None:
            return [Send(pred, UpdateAck(
                self.chain_id, self.chain_version, c.cid, self.target_id, p.update.version, AckStatus.FAILED,
                c.committed, c.crc, c.length, errno=error.errno or EIO, message=error.message))]
        return [self._reply(c.cid, key, error) for key in p.waiters] + self._start_queued(c)

    def _start_queued(self, c: _Chunk) -> list[Effect]:
        """(Head, the chunk's write just ended.) Start the next queued write; give an emptied queue back."""
        effects: list[Effect] = []
        while c.queue and c.pending is None:
            effects += self._write(c, c.queue.popleft())
        if not c.queue:
            c.queue = None
        return effects

    # ---------------------------------------------------------------------------------- reconfiguration

    def _configure(self, e: Configure) -> list[Effect]:
        cfg = e.config
        if cfg.chain_id != self.chain_id:
            raise ProtocolError(f"config of chain {cfg.chain_id} at member of chain {self.chain_id}")
        if cfg.chain_version < self.chain_version:
            return []
        self.lease_until = max(self.lease_until, e.lease_until) if cfg.chain_version == self.chain_version else e.lease_until
        if cfg.chain_version == self.chain_version:
            return []
        was_syncing = self.state is TargetState.SYNCING
        self.config = cfg
        self._chain = cfg.write_chain()
        self._state = cfg.state_of(self.target_id)
        self._resync = None
        effects: list[Effect] = []
        state = self.state
        if state is TargetState.SYNCING and not was_syncing:
            # Our data may be from before a partition: resync decides per chunk; pending writes are not ours
            # to finish (the chain went on without us and may have reused their versions for other writes).
            for c in self._chunks.values():
                c.fresh = False
                if c.pending is not None and c.pending.persisted:
                    c.pending = None
                elif c.pending is not None:
                    c.pending.orphan = True
        in_chain = state in _IN_CHAIN
        is_head = in_chain and self._write_chain()[0] == self.target_id
        is_tail = cfg.read_tail() == self.target_id
        for cid, c in self._chunks.items():
            p = c.pending
            if p is not None:
                p.maybe_visible = p.maybe_visible or is_tail
                if not is_head:
                    effects += [self._reply(cid, key, StaleRouting("head moved")) for key in p.waiters]
                    p.waiters.clear()
            if not is_head:
                effects += [self._reply(cid, (w.client_id, w.request_id), StaleRouting("head moved"))
                            for w in c.queue or ()]
                c.queue = None
            if in_chain and p is not None and p.persisted and not self._fenced():
                effects += self._forward(c) if self._successor() else self._commit(c)
        succ = self._successor() if in_chain else None
        if state is TargetState.SERVING and succ is not None and cfg.state_of(succ) is TargetState.SYNCING:
            self._resync = _ResyncJob(succ, sent_at=self.now, pull=self._fenced())
            effects.append(Send(succ, ResyncQuery(self.chain_id, self.chain_version, self.target_id)))
        return effects

    def _refuse_stale(self, m: Msg) -> list[Effect]:
        err = StaleRouting(f"chain version {m.chain_version}, target {self.target_id} has {self.chain_version}")
        if isinstance(m, WriteReq):
            return [self._reply(m.chunk_id, (m.client_id, m.request_id), err)]
        if isinstance(m, UpdateReq):
            ack = self._ack(m, AckStatus.STALE, self._chunks.get(m.chunk_id) or _Chunk(m.chunk_id))
            # echo the sender's chain version: the refusal belongs to the sender's view of the chain
            return [Send(ack.target, msgspec.structs.replace(ack.msg, chain_version=m.chain_version))]
        return []  # acks and resync messages of another chain version: the sender re-drives

    # ------------------------------------------------------------------------------------------- resync

    def _resync_query(self, q: ResyncQuery) -> list[Effect]:
        if self.state is not TargetState.SYNCING or q.from_target != self._predecessor():
            raise ProtocolError(f"resync query from {q.from_target} at {self.state} target {self.target_id}")
        chunks = tuple(ChunkSummary(cid, c.committed, c.crc) for cid, c in sorted(self._chunks.items()))
        return [Send(q.from_target, ResyncState(self.chain_id, self.chain_version, self.target_id, chunks))]

    def _resync_state(self, s: ResyncState) -> list[Effect]:
        job = self._resync
        if job is None or s.from_target != job.target:
            raise ProtocolError(f"resync state from {s.from_target} without a resync job")
        if job.outstanding is not None:
            return []  # duplicate answer to a retransmitted query
        if job.pull:
            job.outstanding = {x.chunk_id for x in s.chunks if self._pull_needed(x.chunk_id, x.version)}
            job.total = len(job.outstanding)
            return self._pull(job)
        job.theirs = {x.chunk_id: x for x in s.chunks}
        job.drops = {x.chunk_id: x.version for x in s.chunks if x.version and x.chunk_id not in self._chunks}
        job.outstanding = set(job.drops)
        differing = [cid for cid, c in self._chunks.items()
                     if c.pending is not None or _listed(job.theirs.get(cid)) != (c.committed, c.crc)]
        job.total = len(differing) + len(job.drops)
        return self._ask_drops(job) + self._resync_send(job, differing)

    def _ask_drops(self, job: _ResyncJob) -> list[Effect]:
        """Rule 10: tell the syncing successor to drop what it listed and the chain removed."""
        if not job.drops:
            return []
        job.sent_at = self.now
        chunks = tuple(sorted(job.drops.items()))
        return [Send(job.target, ResyncDrop(self.chain_id, self.chain_version, self.target_id, chunks))]

    def _resync_drop(self, d: ResyncDrop) -> list[Effect]:
        """At the syncing successor: drop each chunk still as we held it before syncing (the version we listed,
        nothing pending, not written by the live chain since), then confirm all of them: one the chain wrote anew
        meanwhile stays, whatever its version number (a re-created chunk starts again at 1). One we no longer
        hold is dropped from the engine again: a retransmit after the engine failed to remove it finishes the job."""
        if self.state is not TargetState.SYNCING or d.from_target != self._predecessor():
            raise ProtocolError(f"resync drop from {d.from_target} at {self.state} target {self.target_id}")
        gone: list[ChunkId] = []
        for cid, version in d.chunks:
            c = self._chunks.get(cid)
            if c is None or (not c.fresh and c.committed == version and c.pending is None):
                self._chunks.pop(cid, None)
                gone.append(cid)
        ack = ResyncDropped(self.chain_id, self.chain_version, self.target_id, tuple(cid for cid, _ in d.chunks))
        return [DropChunks(tuple(gone), d.from_target, ack)]

    def _resync_dropped(self, r: ResyncDropped) -> list[Effect]:
        job = self._resync
        if job is None or job.outstanding is None or r.from_target != job.target:
            return []  # late, of a job that ended
        confirmed = [cid for cid in r.chunks if job.drops.pop(cid, None) is not None]
        if not job.outstanding.intersection(confirmed):
            return []  # a duplicate answer, or for chunks a live write's ack already confirmed
        job.outstanding.difference_update(confirmed)
        return self._resync_maybe_done(job)

    def _pull_needed(self, cid: ChunkId, version: int) -> bool:
        """Rule 9: whether the successor's committed ``version`` is newer than what we hold. Our pending version
        was never acknowledged, so a committed one as new replaces it (it may be of a write the chain abandoned)."""
        c = self._chunks.get(cid)
        if c is None:
            return version > 0
        return version > c.committed and (c.pending is None or version >= c.pending.update.version)

    def _pull(self, job: _ResyncJob) -> list[Effect]:
        """Rule 9: ask the syncing successor for the chunks it holds newer (or report that none are left)."""
        job.sent_at = self.now
        if not job.outstanding:
            return self._resync_maybe_done(job)
        return [Send(job.target, ResyncPull(self.chain_id, self.chain_version, self.target_id,
                                            tuple(sorted(job.outstanding))))]

    def _resync_pull(self, q: ResyncPull) -> list[Effect]:
        """At the syncing successor: send the recovering predecessor our committed version of each chunk."""
        if self.state is not TargetState.SYNCING or q.from_target != self._predecessor():
            raise ProtocolError(f"resync pull from {q.from_target} at {self.state} target {self.target_id}")
        chunks = [self._chunks[cid] for cid in q.chunks if cid in self._chunks]  # it asks only for ones we listed
        return [SendChunk(q.from_target, self._full_update(c, c.committed, c.crc, resync=True)) for c in chunks]

    def _pulled(self, c: _Chunk, u: UpdateReq) -> list[Effect]:
        """A chunk the successor sent for a pull: store it as a pending version, committed once persisted."""
        if (c.pending is not None and c.pending.pulled) or not self._pull_needed(c.cid, u.version):
            return []  # a retransmitted copy: being stored, or stored
        blocks = _checked_blocks(u)
        if blocks is None:
            return []  # the next pull asks again
        effects = self._accept(c, u, blocks)
        c.pending.pulled = True
        return effects

    def _harvested(self, cid: ChunkId) -> list[Effect]:
        """A pulled chunk is committed: report ResyncDone once none is left (unless the job ended meanwhile)."""
        job = self._resync
        if job is None or cid not in (job.outstanding or ()):
            return []
        job.outstanding.discard(cid)
        return self._resync_maybe_done(job)

    def _resync_send(self, job: _ResyncJob, chunk_ids: list[ChunkId]) -> list[Effect]:
        """Copy clean chunks (whole, or the blocks that differ from the successor's listed copy); a dirty one is
        covered by its pending write's full-chunk forward."""
        job.sent_at = self.now
        effects: list[Effect] = []
        for cid in chunk_ids:
            c = self._chunks[cid]
            job.outstanding.add(cid)
            if c.pending is None:
                effects.append(self._resync_copy(job, c))
        return effects + self._resync_maybe_done(job)

    def _resync_copy(self, job: _ResyncJob, c: _Chunk) -> SendChunk:
        return SendChunk(job.target, self._full_update(c, c.committed, c.crc, resync=True), job.theirs.get(c.cid))

    def _resync_acked(self, a: UpdateAck) -> list[Effect]:
        job = self._resync
        if job is None or job.outstanding is None or a.chunk_id not in job.outstanding:
            return []
        if a.status is AckStatus.VERSION_GAP and a.resync and job.theirs.pop(a.chunk_id, None) is not None:
            c = self._chunks[a.chunk_id]  # it refused a delta: from now on the chunk goes whole
            return [self._resync_copy(job, c)] if c.pending is None else []
        if a.status is not AckStatus.OK:
            return []
        if a.committed_version < self._chunks[a.chunk_id].committed:
            return []  # confirms an older copy than we hold now; wait for the newer one
        job.outstanding.discard(a.chunk_id)
        return self._resync_maybe_done(job)

    def _resync_maybe_done(self, job: _ResyncJob) -> list[Effect]:
        if job.outstanding:
            return []
        job.done = True  # from now on mgmtd may make the successor the read tail: rule 7a
        return [ReportToMgmtd(ResyncDone(self.chain_id, self.chain_version, job.target))]

    # --------------------------------------------------------------------------------------------- tick

    def _tick(self, now: float) -> list[Effect]:
        self.now = now
        if self.state not in _IN_CHAIN:
            return []
        effects: list[Effect] = []
        due = now - self.retransmit_after
        if self._successor() is not None and not self._fenced() and now - self._last_scan >= self.retransmit_scan_every:
            self._last_scan = now
            for c in sorted(self._dirty.values(), key=lambda c: c.seq):  # O(in flight), deterministic order
                if c.pending.persisted and c.pending.resend_at <= now:
                    effects += self._forward(c)
        job = self._resync
        if job is not None and job.sent_at <= due:
            if job.outstanding is None:
                job.sent_at = now
                effects.append(Send(job.target, ResyncQuery(self.chain_id, self.chain_version, self.target_id)))
            elif job.pull:
                effects += self._pull(job)
            else:  # resend what is unconfirmed; ResyncDone again if mgmtd has not acted on it yet
                effects += self._ask_drops(job)
                effects += self._resync_send(job, sorted(job.outstanding - job.drops.keys()))
        return effects

    # ------------------------------------------------------------------------------------------ helpers

    def _chunk(self, cid: ChunkId) -> _Chunk:
        c = self._chunks.get(cid)
        if c is None:
            c = self._chunks[cid] = _Chunk(cid, seq=next(self._created), dirty=self._dirty)
        return c

    def _write_chain(self) -> list[int]:
        return self._chain

    def _neighbour(self, step: int) -> int | None:
        chain = self._write_chain()
        if self.target_id not in chain:
            return None
        i = chain.index(self.target_id) + step
        return chain[i] if 0 <= i < len(chain) else None

    def _successor(self) -> int | None:
        return self._neighbour(1)

    def _predecessor(self) -> int | None:
        return self._neighbour(-1)

    def _read_refusal(self, chain_version: int) -> Retry | None:
        if self.config is None or chain_version != self.chain_version:
            return Retry(StaleRouting(f"chain version {chain_version}, target has {self.chain_version}"))
        if self.state is not TargetState.SERVING:
            return Retry(StaleRouting(f"target {self.target_id} is {self.state}"))
        if self.now >= self.lease_until:
            return Retry(StaleRouting(f"target {self.target_id} lease expired"))
        if self._fenced():
            return Retry(NotCommitted(f"target {self.target_id} is recovering newer chunks from its replicas"))
        return None

    def _fenced(self) -> bool:
        """Rule 9: serving in a recovering chain, so possibly behind an acknowledged write: serve nothing."""
        return self.config is not None and self.config.recovering and self.state is TargetState.SERVING


_IN_CHAIN = (TargetState.SERVING, TargetState.SYNCING)


def _listed(x: ChunkSummary | None) -> tuple[int, int]:
    return (0, 0) if x is None else (x.version, x.crc)


def _checked_blocks(m: WriteReq | UpdateReq) -> list[int] | None:
    """The CRC32Cs of the data's 64 KiB blocks, or None if they do not fold into the message's CRC (rule 5)."""
    blocks = block_crcs(m.data or b"")
    return blocks if fold_crc(blocks, len(m.data or b"")) == m.crc else None

# (chunk phase, event type) -> action. A missing pair is a protocol error.
_TRANSITIONS: dict[tuple[Phase, type], Callable[[ChainMember, _Chunk, Event], list[Effect]]] = {
    (Phase.CLEAN, WriteReq): ChainMember._write,  # head: start (or answer a retry from the table)
    (Phase.PERSISTING, WriteReq): ChainMember._write,  # head: attach a retry, or queue
    (Phase.FORWARDED, WriteReq): ChainMember._write,
    (Phase.CLEAN, UpdateReq): ChainMember._update,  # accept next version / full replace, or refuse
    (Phase.PERSISTING, UpdateReq): ChainMember._update,  # retransmit of the pending one, else BUSY
    (Phase.FORWARDED, UpdateReq): ChainMember._update,  # retransmit: forward again
    (Phase.PERSISTING, Persisted): ChainMember._persisted,  # forward, or (end of chain) commit and ack
    (Phase.PERSISTING, PersistFailed): ChainMember._persist_failed,  # abandon the version along the chain
    (Phase.FORWARDED, UpdateAck): ChainMember._acked,  # commit and ack upstream / answer clients
    (Phase.CLEAN, UpdateAck): ChainMember._acked,  # resync copy confirmed, or a late duplicate
    (Phase.PERSISTING, UpdateAck): ChainMember._acked,  # a late duplicate of the previous version
}
