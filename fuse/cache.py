"""The mount's read cache: recently read blocks of files, kept in this process across opens.

Small reads (random 4 KiB reads of a database, an index, a model's tensors) each cost a round trip to a chunk
server, which reads and checks a whole 64 KiB CRC block to answer them. The cache asks for that whole block
instead and keeps it, so neighbouring reads are answered here; the kernel's page cache cannot do this for us,
since the mount drops it on every open (``keep_cache`` off) and programs drop it themselves (fadvise).

Coherence is close-to-open, as with NFS: a file's blocks are kept only while the file's (mtime, size) that
meta returns at open stays what it was when they were read; this mount's own writes and truncations drop the
blocks they touch at once. Another client's write is seen at the next open, as through the page cache.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK = 64 * 1024
"""Bytes per cached block: the chunk servers' CRC block, so a miss costs them no extra disk read."""

Stamp = tuple[int, int]
"""A file's (mtime_ns, size) as meta gave it at open: blocks are valid while it stays the same."""


class BlockCache:
    """An LRU of file blocks bounded by ``capacity`` bytes (not thread-safe: the mount's trio thread only)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._blocks: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._of_file: dict[int, set[int]] = {}  # ino -> indexes of its cached blocks
        self._stamps: dict[int, Stamp] = {}  # ino -> the stamp its cached blocks were read under

    def opened(self, ino: int, stamp: Stamp) -> None:
        """A file was opened and meta gave it ``stamp``: blocks read under another one are dropped."""
        if self._stamps.get(ino, stamp) != stamp:
            self.drop(ino)

    def get(self, ino: int, index: int) -> bytes | None:
        data = self._blocks.get((ino, index))
        if data is not None:
            self._blocks.move_to_end((ino, index))
        return data

    def put(self, ino: int, index: int, data: bytes, stamp: Stamp) -> None:
        """Keep a block read while the file had ``stamp`` (the one of its latest open)."""
        if self._stamps.get(ino, stamp) != stamp:
            self.drop(ino)  # the file changed since these blocks were read, whether or not this one is kept
        self.drop_range(ino, index * BLOCK, 1)  # an older copy of the block goes, whether or not this one stays
        if len(data) > self.capacity:
            return
        self._stamps[ino] = stamp
        self._blocks[(ino, index)] = data
        self._of_file.setdefault(ino, set()).add(index)
        self.used += len(data)
        while self.used > self.capacity:
            (victim_ino, victim_index), victim = self._blocks.popitem(last=False)
            self.used -= len(victim)
            self._forget_index(victim_ino, victim_index)

    def drop_range(self, ino: int, offset: int, length: int) -> None:
        """Forget the blocks overlapping ``[offset, offset + length)`` (this mount wrote there)."""
        indexes = self._of_file.get(ino)
        if not indexes or length <= 0:
            return
        for index in range(offset // BLOCK, (offset + length - 1) // BLOCK + 1):
            data = self._blocks.pop((ino, index), None)
            if data is not None:
                self.used -= len(data)
                self._forget_index(ino, index)

    def drop(self, ino: int) -> None:
        """Forget every block of a file (truncated here, or changed elsewhere)."""
        for index in self._of_file.pop(ino, ()):
            self.used -= len(self._blocks.pop((ino, index)))
        self._stamps.pop(ino, None)

    def _forget_index(self, ino: int, index: int) -> None:
        indexes = self._of_file[ino]
        indexes.discard(index)
        if not indexes:
            del self._of_file[ino]
            del self._stamps[ino]
