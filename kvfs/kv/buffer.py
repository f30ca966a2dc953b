"""A transaction's pending writes, for engines that apply them only at commit (SQLite).

The buffer gives read-your-writes: reads are the engine's snapshot with the buffer laid over
it.  It keeps the latest write per key plus the cleared ranges; a clear_range drops earlier
per-key writes inside it, so at commit "clear ranges first, then per-key writes" is exactly
the order the caller issued them in.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Callable, Iterable, Iterator

from .base import KeyValue

_MASK = (1 << 64) - 1


def apply_atomic(op: str, current: bytes | None, operand: int) -> bytes:
    """FoundationDB semantics on 8-byte little-endian values: add wraps, max compares unsigned."""
    cur = int.from_bytes((current or b"").ljust(8, b"\x00")[:8], "little")
    arg = operand & _MASK
    out = (cur + arg) & _MASK if op == "add" else max(cur, arg)
    return out.to_bytes(8, "little")


class Atomic:
    """Atomic ops on a key whose stored value this transaction has not fixed yet."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: list[tuple[str, int]] = []

    def apply(self, base: bytes | None) -> bytes:
        for op, arg in self.ops:
            base = apply_atomic(op, base, arg)
        assert base is not None
        return base


# A pending write: bytes = set, None = cleared, Atomic = ops over the stored value.
Pending = bytes | None | Atomic


class WriteBuffer:
    """Keys and cleared ranges are kept in order, so a lookup is a bisection: a transaction that clears and
    reads thousands of times (a batch of delegated creates and removals) costs n log n, not n squared."""

    def __init__(self) -> None:
        self.writes: dict[bytes, Pending] = {}
        self._keys: list[bytes] = []  # the keys of ``writes``, in order
        self._begins: list[bytes] = []  # the cleared ranges: disjoint, in order
        self._ends: list[bytes] = []
        self.size = 0

    def __bool__(self) -> bool:
        return bool(self.writes or self._begins)

    @property
    def cleared(self) -> list[tuple[bytes, bytes]]:
        """The cleared ranges, disjoint and in order (overlapping and touching ones merged)."""
        return list(zip(self._begins, self._ends))

    def in_cleared(self, key: bytes) -> bool:
        i = bisect.bisect_right(self._begins, key) - 1
        return i >= 0 and key < self._ends[i]

    def _put(self, key: bytes, pending: Pending) -> None:
        if key not in self.writes:
            bisect.insort(self._keys, key)
        self.writes[key] = pending

    def _key_span(self, begin: bytes, end: bytes) -> tuple[int, int]:
        return bisect.bisect_left(self._keys, begin), bisect.bisect_left(self._keys, end)

    def set(self, key: bytes, value: bytes) -> None:
        self._put(key, value)
        self.size += len(key) + len(value)

    def clear(self, key: bytes) -> None:
        self._put(key, None)
        self.size += len(key)

    def clear_range(self, begin: bytes, end: bytes) -> None:
        if begin >= end:
            return
        self.size += len(begin) + len(end)
        lo, hi = self._key_span(begin, end)
        for k in self._keys[lo:hi]:
            del self.writes[k]
        del self._keys[lo:hi]
        # ranges [first, last) overlap or touch [begin, end): each ends at or after begin, begins at or before end
        first, last = bisect.bisect_left(self._ends, begin), bisect.bisect_right(self._begins, end)
        if first < last:
            begin, end = min(begin, self._begins[first]), max(end, self._ends[last - 1])
        self._begins[first:last] = [begin]
        self._ends[first:last] = [end]

    def atomic(self, op: str, key: bytes, operand: int) -> None:
        self.size += len(key) + 8
        cur = self.writes.get(key, None if self.in_cleared(key) else Atomic())
        if isinstance(cur, Atomic):
            cur.ops.append((op, operand))
            self._put(key, cur)
        else:  # the base value is known inside this transaction: fold to a plain set
            self._put(key, apply_atomic(op, cur, operand))

    def overlay_get(self, key: bytes, stored: Callable[[], bytes | None]) -> bytes | None:
        """The value ``key`` has inside the transaction; ``stored`` reads the snapshot lazily."""
        if key in self.writes:
            w = self.writes[key]
            return w.apply(stored()) if isinstance(w, Atomic) else w
        if self.in_cleared(key):
            return None
        return stored()

    def overlay_range(
        self,
        begin: bytes,
        end: bytes,
        reverse: bool,
        stored_rows: Iterable[KeyValue],
        stored_get: Callable[[bytes], bytes | None],
    ) -> Iterator[KeyValue]:
        """Merge the snapshot's rows (in scan order) with the buffer; lazy so ``limit`` stops early."""
        lo, hi = self._key_span(begin, end)
        keys = self._keys[lo:hi]
        if reverse:
            keys.reverse()
        mine = ((k, True) for k in keys)
        theirs = ((k, v) for k, v in stored_rows if k not in self.writes and not self.in_cleared(k))
        merged = heapq.merge(
            ((k, 0, v) for k, v in theirs), ((k, 1, None) for k, _ in mine), reverse=reverse
        )
        for key, from_buffer, value in merged:
            if from_buffer:
                value = self.overlay_get(key, lambda k=key: stored_get(k))
                if value is None:
                    continue
            yield key, value


__all__ = ["WriteBuffer", "Atomic", "apply_atomic"]
