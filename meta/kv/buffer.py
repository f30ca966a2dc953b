"""A transaction's pending writes, for engines that apply them only at commit (SQLite).

The buffer gives read-your-writes: reads are the engine's snapshot with the buffer laid over
it.  It keeps the latest write per key plus the cleared ranges; a clear_range drops earlier
per-key writes inside it, so at commit "clear ranges first, then per-key writes" is exactly
the order the caller issued them in.
"""

from __future__ import annotations

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
    def __init__(self) -> None:
        self.writes: dict[bytes, Pending] = {}
        self.cleared: list[tuple[bytes, bytes]] = []
        self.size = 0

    def __bool__(self) -> bool:
        return bool(self.writes or self.cleared)

    def in_cleared(self, key: bytes) -> bool:
        return any(b <= key < e for b, e in self.cleared)

    def set(self, key: bytes, value: bytes) -> None:
        self.writes[key] = value
        self.size += len(key) + len(value)

    def clear(self, key: bytes) -> None:
        self.writes[key] = None
        self.size += len(key)

    def clear_range(self, begin: bytes, end: bytes) -> None:
        if begin >= end:
            return
        for k in [k for k in self.writes if begin <= k < end]:
            del self.writes[k]
        self.cleared.append((begin, end))
        self.size += len(begin) + len(end)

    def atomic(self, op: str, key: bytes, operand: int) -> None:
        self.size += len(key) + 8
        cur = self.writes.get(key, None if self.in_cleared(key) else Atomic())
        if isinstance(cur, Atomic):
            cur.ops.append((op, operand))
            self.writes[key] = cur
        else:  # the base value is known inside this transaction: fold to a plain set
            self.writes[key] = apply_atomic(op, cur, operand)

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
        keys = sorted(k for k in self.writes if begin <= k < end)
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
