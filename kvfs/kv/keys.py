"""Key helpers over the FoundationDB tuple layer.

Every engine stores exactly these bytes, so a store can move between SQLite and FoundationDB
and tools can decode keys without knowing which engine wrote them.
"""

from __future__ import annotations

import struct
from typing import Any

import fdb.tuple as _tuple

_I64 = struct.Struct("<q")


_STR_CACHE: dict[str, bytes] = {}


def _encode_str(text: str) -> bytes:
    encoded = _STR_CACHE.get(text)
    if encoded is None:
        encoded = b"\x02" + text.encode().replace(b"\x00", b"\x00\xff") + b"\x00"
        if len(_STR_CACHE) < 4096:  # schema tags, not user names
            _STR_CACHE[text] = encoded
    return encoded


#: The tuple layer packs a non-negative int in at most 8 bytes below this (``fdb.tuple._size_limits[-1]``), and
#: 2**64 - 1 itself already as an arbitrary-length integer.
_MAX_SHORT_INT = (1 << 64) - 1


def pack(*parts: Any) -> bytes:
    """Key for a tuple of parts: ``pack("meta", "i", 7)``.

    Byte-identical to ``fdb.tuple.pack``, which costs ~10 us a key in pure Python, several keys per metadata
    operation; the shapes the schema uses (str, bytes, non-negative int) are encoded here, anything else by
    the tuple layer."""
    out = []
    for part in parts:
        kind = type(part)
        if kind is int and 0 <= part < _MAX_SHORT_INT:
            out.append(pack_uint(part))
        elif kind is str:
            out.append(_encode_str(part))
        elif kind is bytes:
            out.append(pack_bytes(part))
        else:
            return _tuple.pack(parts)
    return b"".join(out)


def pack_uint(value: int) -> bytes:
    """One tuple element: an integer (what :func:`pack` makes of it), for the keys built on every metadata
    operation (a prefix and an element or two) without ``pack``'s loop. Short for one below 2**64 - 1."""
    if value == 0:
        return b"\x14"
    if not 0 < value < _MAX_SHORT_INT:
        return _tuple.pack((value,))
    size = (value.bit_length() + 7) // 8
    return bytes((0x14 + size,)) + value.to_bytes(size, "big")


def pack_bytes(value: bytes) -> bytes:
    """One tuple element: a byte string."""
    return b"\x01" + value.replace(b"\x00", b"\x00\xff") + b"\x00"


def unpack(key: bytes) -> tuple[Any, ...]:
    """Inverse of :func:`pack`."""
    return _tuple.unpack(key)


def unpack_uint_bytes(key: bytes, at: int) -> tuple[int, bytes] | None:
    """The non-negative integer and the byte string without NULs that follow ``key[:at]`` and end it (a directory
    entry's parent and name), or None where the key is not of that shape: a hot path's shortcut past
    :func:`unpack`, which its callers fall back to."""
    code = key[at] - 0x14 if at < len(key) else -1
    end = at + 1 + code
    if not 0 <= code <= 8 or end >= len(key) or key[end] != 0x01 or key[-1] != 0:
        return None
    name = key[end + 1:-1]
    return None if b"\x00" in name else (int.from_bytes(key[at + 1:end], "big"), name)


def unpack_uint(key: bytes, at: int) -> int | None:
    """The non-negative integer that follows ``key[:at]`` and ends it (an inode number), or None where the key
    is not of that shape."""
    code = key[at] - 0x14 if at < len(key) else -1
    if not 0 <= code <= 8 or at + 1 + code != len(key):
        return None
    return int.from_bytes(key[at + 1:], "big")


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
