"""Held writes: whole new chunk versions kept in memory until the next flush (see the engine's "Held writes").

A held version's slot is allocated and its row staged; only its bytes wait here, keyed by slot ``(cls, slot)``,
oldest first. :class:`HeldWrites` keeps the map, its byte count and the gauge together, and writes a held
version out into its slot when something needs the bytes there (a flush, a read, staying within ``hold_bytes``).
It shares the engine's lock: its callers hold it where a method says so.

Past half of ``hold_bytes`` a background thread writes out the oldest held versions, as the kernel's flusher
threads start on dirty pages at ``dirty_background_ratio``: a stream larger than the limit then reaches the disk
beside the writers instead of in their path, and a writer waits for the disk itself only when the thread falls
behind by the other half. Where a reader on this host reads back what is put (``reads_back()``), the thread
writes every held version out at once, through the page cache: the put's path still does not wait for the
write, and the reader's locate, which would otherwise write the version out itself, finds it written.
"""

from __future__ import annotations

import errno
import logging
import mmap
import threading
from collections.abc import Callable, Iterator

import prometheus_client

HELD_BYTES = prometheus_client.Counter(
    "kvfs_chunk_held_bytes", "Bytes of whole-chunk writes held in memory for a flush, by what became of them: "
    "written (by a flush, a read, or to stay within hold_bytes) or dropped (superseded or removed first)", ["fate"])
HELD_NOW = prometheus_client.Gauge("kvfs_chunk_held_bytes_now", "Bytes of chunk writes held in memory now")

Slot = tuple[int, int]  # (size class, slot)

log = logging.getLogger(__name__)
#: After a background write-out failed (ENOSPC, EIO), wait this long before the next: a flush or a writer past
#: the limit meets the error itself meanwhile.
RETRY_AFTER = 1.0


class HeldWrites:
    """Up to ``limit`` bytes of held versions. ``write(cls, data, offset, cached)`` writes bytes into a slot file
    (``cached``: through the page cache, for a reader about to read them); ``free(cls, slot)`` frees a slot whose
    version went away while its bytes were being written out; ``reads_back()`` says whether every write-out
    should go through the page cache (a reader on this host reads back what is put)."""

    def __init__(self, limit: int, lock: threading.Lock, write: Callable[[int, memoryview, int, bool], None],
                 free: Callable[[int, int], None], reads_back: Callable[[], bool]) -> None:
        self.limit = limit
        self._reads_back = reads_back
        self.bytes = 0
        self._lock = lock
        self._write = write
        self._free = free
        self._held: dict[Slot, memoryview] = {}  # slot -> its version's unwritten bytes, oldest first
        self._writing: dict[Slot, bool] = {}  # slot being written out from _held -> freed meanwhile
        self._written = threading.Condition(lock)  # a write-out ended
        self._background = limit // 2  # past this many bytes held, the write-behind thread writes out the oldest
        self._over_background = threading.Condition(lock)
        self._stopping = threading.Event()
        self._write_behind: threading.Thread | None = None

    def hold(self, cls: int, slot: int, data: memoryview) -> bool:
        """Keep ``data``, a whole new version for ``slot``, in memory instead of writing it now; False where it must
        be written at once. Only bytes nobody can change are held: an immutable ``bytes``, or a buffer mapped for a
        received data section (the pool reuses it only once this view is gone). Past the limit the oldest held
        versions are written out, by the thread that went past it."""
        if not self.limit or len(data) > self.limit or not isinstance(data.obj, (bytes, mmap.mmap)):
            return False
        with self._lock:
            self._put((cls, slot), data)
            if self._behind():
                self._wake_write_behind()
        while self.bytes > self.limit:
            with self._lock:
                oldest = next(iter(self._held), None)
            if oldest is None:
                break
            self.write_out(oldest)
        return True

    def _behind(self) -> bool:
        """(Caller holds the lock.) Whether the write-behind thread has held versions to write out: past half the
        limit; or any at all where a reader on this host reads back what is put, so that they are in the page
        cache by the time it comes (written out by its locate instead, it would wait for that write)."""
        return self.bytes > self._background or (self.bytes > 0 and self._reads_back())

    def _wake_write_behind(self) -> None:
        """(Caller holds the lock.) Start the write-behind thread on first need; wake it."""
        if self._write_behind is None and not self._stopping.is_set():
            self._write_behind = threading.Thread(target=self._write_behind_loop, name="held-write-behind",
                                                  daemon=True)
            self._write_behind.start()
        self._over_background.notify()

    def _write_behind_loop(self) -> None:
        while True:
            with self._lock:
                while not self._behind() and not self._stopping.is_set():
                    self._over_background.wait()
                if self._stopping.is_set():
                    return
                oldest = next(iter(self._held))
            try:
                self.write_out(oldest)
            except OSError as e:  # kept held (write_out puts it back): a flush reports it to its caller
                log.warning("writing out held chunk data failed, trying again in %.0f s: %s", RETRY_AFTER, e)
                self._stopping.wait(RETRY_AFTER)

    def stop(self) -> None:
        """End the write-behind thread (before the engine's last flush); held bytes stay for that flush."""
        self._stopping.set()
        with self._lock:
            self._over_background.notify()
            thread = self._write_behind
        if thread is not None:
            thread.join()

    def _put(self, key: Slot, data: memoryview) -> None:
        """(Caller holds the lock.)"""
        self._held[key] = data
        self.bytes += len(data)
        HELD_NOW.inc(len(data))

    def _pop(self, key: Slot) -> memoryview | None:
        """Slot ``key``'s held bytes, no longer held; None if it has none. (Caller holds the lock.)"""
        data = self._held.pop(key, None)
        if data is not None:
            self.bytes -= len(data)
            HELD_NOW.dec(len(data))
        return data

    def drop(self, key: Slot) -> bool:
        """Slot ``key`` is being freed: its held bytes, if any, never reach the disk. True if a write-out is under
        way: the slot is freed (through ``free``) once it has ended, not now. (Caller holds the lock.)"""
        held = self._pop(key)
        if held is not None:  # superseded or removed before a flush wrote it: it never reaches the disk
            HELD_BYTES.labels("dropped").inc(len(held))
        if key in self._writing:  # reused only once the write-out under way has ended
            self._writing[key] = True
            return True
        return False

    def peek(self, key: Slot) -> memoryview | None:
        """Slot ``key``'s held bytes (a whole version, immutable), still held; None if none are, or their write-out
        is under way. (Caller holds the lock.)"""
        return self._held.get(key)

    def slots(self) -> Iterator[Slot]:
        """The slots held or being written out now (caller holds the lock; iterate a copy)."""
        return iter([*self._held, *self._writing])

    def settle(self, key: Slot, nowait: bool = False) -> None:
        """Make sure slot ``key``'s bytes are in the slot (written out if held) before they are read from it.
        ``nowait``: BlockingIOError instead of writing them out (a read that must not wait for the disk). They go
        through the page cache, where the read that asked finds them: written around it, that read (a
        short-circuit reader's, right after its locate) would wait for the disk, behind a flush's writes."""
        if key in self._held or key in self._writing:
            if nowait:
                raise BlockingIOError(errno.EAGAIN, "held in memory, not written yet")
            self.write_out(key, cached=True)

    def write_out(self, key: Slot, cached: bool = False) -> None:
        """Write out slot ``key``'s held bytes, if it still has any; or wait for the write-out under way. A slot
        freed meanwhile goes back to the free list once the bytes have landed, so no new version is written into
        it under them. Through the page cache if ``cached`` (see :meth:`settle`) or ``reads_back()``."""
        with self._lock:
            while key in self._writing:
                self._written.wait()
            data = self._pop(key)
            if data is None:
                return
            self._writing[key] = False
        cls, slot = key
        written = False
        try:
            self._write(cls, data, slot << cls, cached or self._reads_back())
            written = True
        finally:
            with self._lock:
                freed = self._writing.pop(key)
                if freed:
                    self._free(cls, slot)
                elif not written:  # kept for the next try (a flush that failed tries again)
                    self._put(key, data)
                self._written.notify_all()
            if written:
                HELD_BYTES.labels("written").inc(len(data))
