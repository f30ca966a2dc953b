"""RPC methods of ``kvfs chunkserver``: what clients and peer replicas may ask of a chunk server.

Chunk bytes never travel inside a body: a write's data, a read's results and a replica's update ride in the
frame's data section, and the structs here carry only their lengths and checksums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec

from kvfs.craq.messages import (
    ChunkId, ResyncDrop, ResyncDropped, ResyncPull, ResyncQuery, ResyncState, UpdateAck, UpdateReq, VersionQuery,
    VersionReply, WriteReq, WriteResp,
)
from kvfs.wire import Empty, Limits, Method

#: Largest chunk a layout may ask for (DESIGN.md: 64 KiB .. 64 MiB).
MAX_CHUNK_SIZE = 64 << 20
MIN_CHUNK_SIZE = 64 << 10

#: Frame limits of every connection that carries chunks: a chunk write carries up to a whole chunk in its data
#: section (chunk servers, their clients and peers all use these).
CHUNK_LIMITS = Limits(max_body=1 << 20, max_data=80 << 20)


class PeerEnvelope(msgspec.Struct, array_like=True):
    """One replication message between members of a chain; one-way, answered by a later message."""

    msg: UpdateReq | UpdateAck | ResyncQuery | ResyncState | ResyncPull | ResyncDrop | ResyncDropped


class PeerBatch(msgspec.Struct, array_like=True):
    """Several replication messages to one member, sent together because one batch of writes made them (one
    frame instead of one per chunk). The data section holds each update's bytes in order, ``sizes[i]`` of them
    (0 for an ack)."""

    msgs: list[UpdateReq | UpdateAck]
    sizes: list[int]


class WriteBatch(msgspec.Struct, array_like=True):
    """Client -> head: writes of several chunks, each at most once (one chain round for all of them instead of
    one each). The data section holds each write's bytes in order, ``sizes[i]`` of them."""

    writes: list[WriteReq]
    sizes: list[int]


class WriteBatchResult(msgspec.Struct, array_like=True):
    """One answer per write of a :class:`WriteBatch`, in its order: each chunk succeeds or fails on its own."""

    results: list[WriteResp]


class ReadRange(msgspec.Struct, array_like=True):
    chain_id: int
    chain_version: int
    chunk_id: ChunkId
    offset: int
    length: int


class ReadBatch(msgspec.Struct, array_like=True):
    reads: list[ReadRange]


class ReadResult(msgspec.Struct, array_like=True):
    """``length`` bytes of the batch's data section belong to this read (fewer than asked past a chunk's end)."""

    errno: int = 0
    message: str = ""
    version: int = 0
    length: int = 0


class ReadBatchResult(msgspec.Struct, array_like=True):
    results: list[ReadResult]


class FetchChunk(msgspec.Struct, array_like=True):
    """Peer -> peer: send me your committed copy of a chunk (repairing a corrupt replica): the whole chunk, or
    only ``blocks`` (64 KiB block indexes, sorted), one after another, if its committed version is ``version``."""

    target_id: int
    chunk_id: ChunkId
    blocks: list[int] | None = None
    version: int = 0


class FetchedChunk(msgspec.Struct, array_like=True):
    """The committed version sent (its ``crc`` and ``length``); with ``blocks`` asked at another version, no data."""

    version: int
    crc: int
    length: int = 0


class RemoveChunks(msgspec.Struct, array_like=True):
    """Remove every chunk of ``inode`` with index >= ``from_index`` on every target of this server."""

    inode: int
    from_index: int = 0


class RemoveFiles(msgspec.Struct, array_like=True):
    """Remove every chunk of each of ``inodes`` on every target of this server (garbage collection)."""

    inodes: list[int]


class Removed(msgspec.Struct, array_like=True):
    count: int


class LastChunkQuery(msgspec.Struct, array_like=True):
    inode: int


class LastChunk(msgspec.Struct, array_like=True):
    """The highest-index chunk of an inode on this server (index -1: none), for exact file length recovery."""

    index: int
    length: int


class ChunkStatQuery(msgspec.Struct, array_like=True):
    target_id: int
    chunk_id: ChunkId


class ChunkStat(msgspec.Struct, array_like=True):
    """One replica's view of a chunk (version 0: it has none), for ``kvfs admin check-file``."""

    version: int
    length: int
    crc: int
    pending_version: int = 0


class FlushTargets(msgspec.Struct, array_like=True):
    """Make everything these targets acknowledged so far durable (a client's fsync): chunk servers acknowledge
    writes from the page cache unless ``write_through`` is set."""

    target_ids: list[int]


class LocateChunks(msgspec.Struct, array_like=True):
    """Client on this host -> chunk server: where do the readable versions of these chunk ranges lie on your disk?
    One call for every chunk of a batch that this server holds. ``boot_id`` is the client's
    (``/proc/sys/kernel/random/boot_id``): only a client that shares the server's kernel may read its files
    (chunkserver/README.md, "Short-circuit reads")."""

    ranges: list[ReadRange]
    boot_id: str
    #: The caller reads back soon what is put on this host (kvclient beside an inference engine): the server writes
    #: whole versions through the page cache for a while (chunkserver/README.md, "Direct I/O").
    reads_back: bool = False


class ChunkLocation(msgspec.Struct, array_like=True):
    """The version a read at this replica would serve, pinned in place until ``deadline_ns``
    (``CLOCK_MONOTONIC``, shared by every process of one host): bytes ``[file_offset, file_offset + length)`` of
    ``path``. ``block_crcs`` are the CRC32Cs of the 64 KiB blocks the asked range touches, from ``first_block`` on.
    ``version`` 0: the chunk has no data here (a hole, read as zeros)."""

    version: int
    path: str = ""
    file_offset: int = 0
    length: int = 0
    first_block: int = 0
    block_crcs: list[int] = []
    deadline_ns: int = 0


class Located(msgspec.Struct, array_like=True):
    """One per range asked, in order: its location, or None where this server would not locate it now (a version
    it may not serve, a stale chain version, a version in several places): read that chunk over the network."""

    locations: list[ChunkLocation | None]


class Space(msgspec.Struct, array_like=True):
    capacity: int
    used: int
    free: int


WRITE = Method(300, "chunk.write", WriteReq, WriteResp)
PEER = Method(301, "chunk.peer", PeerEnvelope, Empty)
READ = Method(302, "chunk.read", ReadBatch, ReadBatchResult, idempotent=True)
VERSION_QUERY = Method(303, "chunk.version_query", VersionQuery, VersionReply, idempotent=True)
FETCH = Method(304, "chunk.fetch", FetchChunk, FetchedChunk, idempotent=True)
REMOVE = Method(305, "chunk.remove", RemoveChunks, Removed, idempotent=True)
LAST_CHUNK = Method(306, "chunk.last_chunk", LastChunkQuery, LastChunk, idempotent=True)
SPACE = Method(307, "chunk.space", Empty, Space, idempotent=True)
CHUNK_STAT = Method(308, "chunk.stat", ChunkStatQuery, ChunkStat, idempotent=True)
REMOVE_FILES = Method(309, "chunk.remove_files", RemoveFiles, Removed, idempotent=True)
FLUSH = Method(310, "chunk.flush", FlushTargets, Empty, idempotent=True)
# 311 was chunk.locate (one chunk a call), retired for 312: never reuse it
LOCATE_MANY = Method(312, "chunk.locate_many", LocateChunks, Located, idempotent=True)
WRITE_BATCH = Method(313, "chunk.write_batch", WriteBatch, WriteBatchResult)
PEER_BATCH = Method(314, "chunk.peer_batch", PeerBatch, Empty)


#: Chunk updates smaller than this travel together (``chunk.write_batch`` to a head, ``chunk.peer_batch`` between
#: members); larger ones (sequential writers' whole or quarter chunks) one a message, pipelined across the chain.
BATCH_BELOW = 256 << 10
BATCH_BYTES = 8 << 20  # data of one batch at most (a frame carries up to 80 MiB, a body up to 1 MiB)
BATCH_WRITES = 256  # updates in one batch at most

T = TypeVar("T")


def batches(items: Sequence[T], size: Callable[[T], int]) -> list[list[T]]:
    """``items`` grouped into messages: each large one alone, the small ones together within a frame's bounds.
    A member that resends every pending update of a chain at once (its successor changed) must not build one
    frame of them all: past ``CHUNK_LIMITS`` the receiver refuses it, and would again at every retransmit."""
    small = [item for item in items if size(item) < BATCH_BELOW]
    if len(small) < 2:
        return [[item] for item in items]
    out = [[item] for item in items if size(item) >= BATCH_BELOW]
    batch: list[T] = []
    held = 0
    for item in small:
        if batch and (len(batch) == BATCH_WRITES or held + size(item) > BATCH_BYTES):
            out.append(batch)
            batch, held = [], 0
        batch.append(item)
        held += size(item)
    out.append(batch)
    return out
