"""What the mount and kvclient need from the storage tier, independent of how chunks travel.

:class:`FileStorage` is the contract between a client face (FUSE, kvclient) and the storage client that
talks to the chunk servers (``kvfs.chunkserver.client.StorageClient``). It speaks in file terms — an inode, its
layout, byte offsets — and hides chunks, chains, replicas, retries and transports. File length is not its
business: metadata owns it, so a read past a chunk's end yields zeros (a hole), and callers clamp to the length
they got from meta.
"""

from __future__ import annotations

from typing import Protocol, TypeAlias


Buffer: TypeAlias = bytes | bytearray | memoryview


class LayoutLike(Protocol):
    """The fields of ``kvfs.meta.store.Layout`` that placement needs."""

    chain_table: int
    chunk_size: int
    stripe: int
    seed: int


class FileStorage(Protocol):
    async def read(self, ino: int, layout: LayoutLike, offset: int, into: memoryview) -> int:
        """Fill ``into`` with the file's bytes at ``offset`` (zeros in holes); return ``len(into)``."""

    async def write(self, ino: int, layout: LayoutLike, offset: int, data: Buffer) -> None:
        """Write ``data`` at ``offset``; returns once every replica of every touched chunk committed it."""

    async def write_runs(self, ino: int, layout: LayoutLike, runs: list[tuple[int, Buffer]]) -> None:
        """Write ``(offset, bytes)`` runs of one file, sorted and apart, each chunk's as one update of it and the
        small updates of a chain as one round: scattered small writes cost a chain round per chain instead of one
        each, and the bytes between them stay. The bytes stay unchanged until this returns."""

    async def truncate(self, ino: int, layout: LayoutLike, old_length: int, new_length: int) -> None:
        """Drop or cut the chunks past ``new_length`` so a later extension reads zeros."""

    async def flush(self, ino: int) -> None:
        """Make the writes and truncations this client made to ``ino`` durable (fsync)."""

    async def remove_files(self, inodes: list[int]) -> None:
        """Free every chunk of these files (garbage collection of removed files: a batch per call)."""

    async def capacity(self) -> tuple[int, int]:
        """(total, free) bytes across the cluster, for statfs."""
