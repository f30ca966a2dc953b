"""The boundary between meta's garbage collector and the chunk servers."""

from __future__ import annotations

import threading
from typing import Protocol

from .types import Layout


class ChunkRemover(Protocol):
    """Deletes every chunk of a removed file.  Must be idempotent: GC may call it again for the
    same inode after a crash between removing chunks and deleting the inode record."""

    def remove_file_chunks(self, ino: int, layout: Layout, length: int) -> None: ...


class MemoryChunkRemover:
    """In-process stand-in for tests and single-process use: records what it was asked to remove."""

    def __init__(self) -> None:
        self.removed: list[tuple[int, Layout, int]] = []
        self._lock = threading.Lock()

    def remove_file_chunks(self, ino: int, layout: Layout, length: int) -> None:
        with self._lock:
            self.removed.append((ino, layout, length))
