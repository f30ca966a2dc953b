"""Key helpers over the FoundationDB tuple layer.

Every engine stores exactly these bytes, so a store can move between SQLite and FoundationDB
and tools can decode keys without knowing which engine wrote them.
"""

from __future__ import annotations

import struct
from typing import Any

import fdb.tuple as _tuple

_I64 = struct.Struct("<q")


def pack(*parts: Any) -> bytes:
    """Key for a tuple of parts: ``pack("meta", "i", 7)``."""
    return _tuple.pack(parts)


def unpack(key: bytes) -> tuple[Any, ...]:
    """Inverse of :func:`pack`."""
    return _tuple.unpack(key)


def prefix_range(*parts: Any) -> tuple[bytes, bytes]:
    """``(begin, end)`` covering every key that extends the tuple ``parts`` (not the key itself)."""
    r = _tuple.range(parts)
    return r.start, r.stop


def key_after(key: bytes) -> bytes:
    """The smallest key strictly greater than ``key``; used to resume a range read."""
    return key + b"\x00"


def encode_int(value: int) -> bytes:
    """8-byte little-endian signed integer, the operand format of atomic add/max."""
    return _I64.pack(value)


def decode_int(raw: bytes | None) -> int:
    """Inverse of :func:`encode_int`; a missing key reads as 0 like FoundationDB's atomic ops."""
    if not raw:
        return 0
    return _I64.unpack(raw.ljust(8, b"\x00")[:8])[0]
