"""The boundary between meta's garbage collector and the chunk servers."""

from __future__ import annotations

import threading
from typing import Protocol



class ChunkRemover(Protocol):
    """Deletes every chunk of removed files, a batch at a time (one call per chunk server, not per file).
    Must be idempotent: GC may call it again for the same inodes after a crash between removing chunks and
    deleting the inode records. Placement does not matter: every server drops whatever it holds of them."""

    def remove_chunks(self, inodes: list[int]) -> None: ...


class MemoryChunkRemover:
    """In-process stand-in for tests and single-process use: records what it was asked to remove."""

    def __init__(self) -> None:
        self.removed: list[int] = []
        self._lock = threading.Lock()

    def remove_chunks(self, inodes: list[int]) -> None:
        with self._lock:
            self.removed.extend(inodes)
