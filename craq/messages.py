"""Wire messages of the CRAQ chain protocol.

Every message is a msgspec Struct, tagged so a union decodes without a type byte of our own, and every message
carries ``chain_id`` and ``chain_version`` so a receiver with a different view of the chain can refuse it.

Bulk data: messages that move chunk bytes (:class:`WriteReq`, :class:`UpdateReq`, :class:`ReadResp`) keep them
in a separate ``data: bytes | None`` field. The RPC driver strips it before encoding
(``msgspec.structs.replace(msg, data=None)``), sends the bytes as the frame's raw payload (or by RDMA), and
attaches them again on receipt before handing the message to :class:`kvfs.craq.member.ChainMember`. The state
machine always sees ``data`` attached; ``crc`` is the CRC32C of ``data`` as computed by the sender.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import msgspec


class TargetState(enum.Enum):
    """3FS target states; only serving targets answer reads, serving and syncing targets take writes."""

    SERVING = "serving"  # up to date, in the write chain, serves reads
    SYNCING = "syncing"  # returning; at the end of the write chain, resynced from its predecessor
    WAITING = "waiting"  # alive again, waiting for its turn to sync (one syncing target per chain)
    LASTSRV = "lastsrv"  # was the last serving target when it went down; holds the newest data
    OFFLINE = "offline"  # down


class ChunkId(NamedTuple):
    """A chunk is ``(inode, index)``; the layout, not the KV store, says which chain holds it. A tuple: on the wire
    an array ``[inode, index]``, ordered and hashable as one, and what the chunk engine keys its chunks by."""

    inode: int
    index: int


class ChainTarget(msgspec.Struct, frozen=True):
    target_id: int
    node_id: int
    state: TargetState


class ChainConfig(msgspec.Struct, frozen=True, tag=True):
    """One chain as mgmtd publishes it: targets in chain order (serving, syncing, waiting, then down)."""

    chain_id: int
    chain_version: int
    targets: tuple[ChainTarget, ...]
    #: The only serving target came back after it may have lost unflushed writes (a rolled-back ``lastsrv``):
    #: it serves nothing and pulls newer chunks from each returning replica first (craq/README.md, "Recovery").
    recovering: bool = False

    def state_of(self, target_id: int) -> TargetState | None:
        return next((t.state for t in self.targets if t.target_id == target_id), None)

    def write_chain(self) -> list[int]:
        """Targets that receive writes, head first: the serving ones, then the syncing one."""
        return [t.target_id for t in self.targets if t.state in (TargetState.SERVING, TargetState.SYNCING)]

    def read_tail(self) -> int | None:
        """The last serving target: its committed version is the chain's committed version."""
        serving = [t.target_id for t in self.targets if t.state is TargetState.SERVING]
        return serving[-1] if serving else None


class Msg(msgspec.Struct, frozen=True, tag=True):
    chain_id: int
    chain_version: int


class WriteReq(Msg, frozen=True, tag=True):
    """Client -> head. ``(client_id, request_id)`` makes retries idempotent; ids grow per client and chunk.

    ``extents``: a write of several runs of the chunk (scattered small writes a client gathered), as
    ``(offset, length)`` pairs, sorted and apart, whose bytes ``data`` holds one after another; they become one
    version, so they cost the chain one round. None: ``data`` is one run at ``offset``. ``full_replace``: ``data``
    (at offset 0, one run) is the whole new version, however long the chunk was: a truncation empties the chunks
    past a file's new end this way while a chunk server is down, so their versions go on rather than start again."""

    chunk_id: ChunkId
    client_id: int
    request_id: int
    offset: int
    crc: int
    data: bytes | None = None
    extents: list[tuple[int, int]] | None = None
    full_replace: bool = False


class WriteResp(Msg, frozen=True, tag=True):
    """Head -> client, after the whole chain committed (errno 0) or refused."""

    chunk_id: ChunkId
    client_id: int
    request_id: int
    errno: int = 0
    message: str = ""
    version: int = 0


class BlockDelta(msgspec.Struct, frozen=True, array_like=True):
    """A resync copy that carries only the blocks that differ from the receiver's listed copy (``base_version``,
    ``base_crc``): ``data`` holds them as the update's ``extents``; the rest of the version is the receiver's own."""

    base_version: int
    base_crc: int
    length: int  # of the new version
    chunk_crc: int  # of the new version: what the receiver's result must come to


class UpdateReq(Msg, frozen=True, tag=True):
    """Member -> successor: make ``version`` the pending version of the chunk.

    ``full_replace`` carries the whole chunk (to a syncing target, or to repair a successor that refused);
    ``resync`` marks a resync copy of a committed version. ``requests`` is the sender's per-client
    idempotency table for the chunk, sent with full replaces so a repaired replica can later dedupe as head.
    ``delta``: a resync copy (``full_replace`` and ``resync``) of only the blocks that differ (:class:`BlockDelta`).
    """

    chunk_id: ChunkId
    from_target: int
    version: int
    offset: int
    crc: int
    full_replace: bool = False
    resync: bool = False
    client_id: int = 0
    request_id: int = 0
    requests: dict[int, int] | None = None
    data: bytes | None = None
    extents: list[tuple[int, int]] | None = None  # as in WriteReq
    delta: BlockDelta | None = None


class AckStatus(enum.Enum):
    OK = "ok"
    VERSION_GAP = "version_gap"  # not the next version (or a delta that does not fit): send the whole chunk
    BUSY = "busy"  # another pending version is still being persisted: retransmit later
    CHECKSUM = "checksum"  # data did not match its CRC32C: retransmit
    STALE = "stale"  # chain version differs: wait for the new chain config, then re-drive
    FAILED = "failed"  # the successor could not store the version (``errno``: ENOSPC, EIO...): abandon it


class UpdateAck(Msg, frozen=True, tag=True):
    """Successor -> predecessor: ``version`` is committed downstream (OK), or why it was refused.

    ``chunk_crc``/``chunk_len`` describe the sender's committed chunk; each predecessor compares them with its
    own to detect divergent replicas. On refusal ``committed_version`` tells the predecessor where the successor is.
    """

    chunk_id: ChunkId
    from_target: int
    version: int
    status: AckStatus
    committed_version: int = 0
    chunk_crc: int = 0
    chunk_len: int = 0
    resync: bool = False
    errno: int = 0
    message: str = ""


class ReadReq(Msg, frozen=True, tag=True):
    chunk_id: ChunkId
    offset: int
    length: int


class ReadResp(Msg, frozen=True, tag=True):
    chunk_id: ChunkId
    errno: int = 0
    message: str = ""
    version: int = 0
    data: bytes | None = None


class VersionQuery(Msg, frozen=True, tag=True):
    """Dirty member -> read tail: which version of this chunk is committed? (classic CRAQ)."""

    chunk_id: ChunkId
    from_target: int
    query_id: int


class VersionReply(Msg, frozen=True, tag=True):
    chunk_id: ChunkId
    query_id: int
    committed_version: int = 0
    errno: int = 0


class ChunkSummary(msgspec.Struct, frozen=True, array_like=True):
    """One chunk of a :class:`ResyncState`. ``blocks`` (the version's 64 KiB block CRC32Cs as little-endian
    uint32s) and ``length``, added by the driver from its engine, let the predecessor send only the blocks that
    differ; empty: it sends the chunk whole. On the wire ``blocks`` travel in the frame's data section, all the
    list's one after another (``length`` says how many are each chunk's), not in the body."""

    chunk_id: ChunkId
    version: int
    crc: int
    length: int = 0
    blocks: bytes = b""


class ResyncQuery(Msg, frozen=True, tag=True):
    """Last serving member -> syncing successor: list your committed chunks so I copy the ones that differ."""

    from_target: int


class ResyncState(Msg, frozen=True, tag=True):
    from_target: int
    chunks: tuple[ChunkSummary, ...]


class ResyncPull(Msg, frozen=True, tag=True):
    """Recovering member -> syncing successor: send me your committed version of these chunks (newer than mine)."""

    from_target: int
    chunks: tuple[ChunkId, ...]


class ResyncDrop(Msg, frozen=True, tag=True):
    """Predecessor -> syncing successor: drop these chunks, which you listed at these committed versions and the
    live chain no longer holds (their file was deleted or truncated while you were away: removals bypass the
    chain). Answered by :class:`ResyncDropped`."""

    from_target: int
    chunks: tuple[tuple[ChunkId, int], ...]


class ResyncDropped(Msg, frozen=True, tag=True):
    """Syncing successor -> predecessor: these chunks of a :class:`ResyncDrop` are gone (or were written anew by
    the live chain since: then the chain's version stands)."""

    from_target: int
    chunks: tuple[ChunkId, ...]


class ResyncDone(Msg, frozen=True, tag=True):
    """Predecessor -> mgmtd: the syncing target holds every committed chunk; make it serving. From a recovering
    member: it holds every chunk the syncing target had newer (the target syncs again once the chain serves)."""

    target_id: int


class ChecksumReport(Msg, frozen=True, tag=True):
    """Member -> mgmtd: a successor's committed chunk CRC differs from mine; the chunk needs repair."""

    chunk_id: ChunkId
    target_id: int
    successor: int
    version: int


# Decode any chain message with ``msgspec.msgpack.decode(buf, type=WireMessage)``.
WireMessage = (
    WriteReq | WriteResp | UpdateReq | UpdateAck | ReadReq | ReadResp | VersionQuery | VersionReply
    | ResyncQuery | ResyncState | ResyncPull | ResyncDone | ChecksumReport | ChainConfig
)
