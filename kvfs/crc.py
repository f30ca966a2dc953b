"""CRC32C by 64 KiB blocks: what the chunk engine stores per version and what a chain member checks a write with.

A write's bytes are checked once per replica: the chain member (``kvfs.craq.member``) computes the CRCs of the
write's ``BLOCK``-sized pieces, folds them into the CRC of the whole write to check it against the client's, and
hands the block CRCs on to the engine, which stores them with the version instead of reading the bytes again.
"""

from __future__ import annotations

import sys
from array import array

from crc32c import crc32c

BLOCK = 64 * 1024
"""Bytes covered by one stored CRC32C."""
_ZEROS = memoryview(bytes(BLOCK))


def block_crcs(data: bytes | bytearray | memoryview) -> list[int]:
    """CRC32Cs of ``data``'s BLOCK-sized pieces (the last may be short).

    The GIL stays held: releasing it around each 4 us block let a thread and the event loop trade it 64 times
    per 4 MiB, a futex hand-off each time."""
    data = memoryview(data).cast("B")
    return [crc32c(data[i : i + BLOCK], gil_release_mode=0) for i in range(0, len(data), BLOCK)]


def bad_block(segments: list[tuple[int, memoryview]], lo: int, hi: int, crcs: array | list[int],
              first_block: int = 0) -> int | None:
    """The first block of bytes [lo, hi) whose CRC32C is not its stored one, or None. ``lo`` is a block boundary
    and ``hi`` one or the data's end; ``segments`` are ``(start, buffer)`` pieces that cover the range in order
    (a reader's scratch head, the caller's buffer, a scratch tail: the middle is read straight where it goes).
    ``crcs[i]`` is block ``first_block + i``'s stored CRC."""
    for b in range(lo // BLOCK, -(-hi // BLOCK)):
        blo, bhi = b * BLOCK, min(b * BLOCK + BLOCK, hi)
        crc = 0
        for start, buf in segments:
            s, t = max(blo, start), min(bhi, start + len(buf))
            if s < t:
                crc = crc32c(buf[s - start : t - start], value=crc)
        if crc != crcs[b - first_block]:
            return b
    return None


def _shift_tables(n: int) -> tuple[list[int], ...]:
    """Byte tables of the linear map ``a -> crc32c(zeros(n), value=a) ^ crc32c(zeros(n))``.

    CRC32C is affine in its input, so ``crc(A + B) == M(crc(A)) ^ crc(B)`` where ``M`` is this map for
    ``n = len(B)``: folding block CRCs costs four table lookups per block instead of a pass over zeros."""
    zero = crc32c(_ZEROS[:n])
    basis = [crc32c(_ZEROS[:n], value=1 << i) ^ zero for i in range(32)]
    tables = []
    for k in range(4):
        table = [0] * 256
        for b in range(1, 256):
            low = b & -b
            table[b] = table[b ^ low] ^ basis[8 * k + low.bit_length() - 1]
        tables.append(table)
    return tuple(tables)


_T0, _T1, _T2, _T3 = _shift_tables(BLOCK)


def fold_crc(blocks: array | list[int], length: int) -> int:
    """CRC32C of ``length`` bytes from the CRCs of their BLOCK-sized pieces (see :func:`_shift_tables`). Every
    write's version folds its chunk's block CRCs (64 for 4 MiB), so the loop over whole blocks is kept bare."""
    count = len(blocks)
    if not count:
        return 0
    t0, t1, t2, t3 = _T0, _T1, _T2, _T3
    total = blocks[0]
    whole = min(count, length // BLOCK)  # blocks of BLOCK bytes: all but a short last one
    for i in range(1, whole):
        total = t0[total & 0xFF] ^ t1[(total >> 8) & 0xFF] ^ t2[(total >> 16) & 0xFF] ^ t3[total >> 24] ^ blocks[i]
    if 0 < whole < count:  # the short last piece: shifted by its own length
        n = length - whole * BLOCK
        total = crc32c(_ZEROS[:n], value=total) ^ crc32c(_ZEROS[:n]) ^ blocks[whole]
    return total


def changed_blocks(ours: array | list[int], our_len: int, theirs: array | list[int], their_len: int,
                   block: int = BLOCK) -> list[int]:
    """Blocks of our version of ``our_len`` bytes that another copy (``theirs``, of ``their_len`` bytes) lacks: a
    block is the same only at the same index, with the same CRC and the same length (a short last block that grew
    is new). Only a comparison of CRCs: that their bytes are what their CRCs say is for their side to check.
    ``block``: the bytes a CRC covers (the simulator's chunks are smaller than one BLOCK)."""
    def size(length: int, b: int) -> int:
        return min(block, length - b * block)

    return [b for b, crc in enumerate(ours)
            if b >= len(theirs) or theirs[b] != crc or size(our_len, b) != size(their_len, b)]


def block_runs(blocks: list[int], length: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """``(offset, length)`` runs of bytes that the sorted ``blocks`` of a ``length``-byte version cover, adjacent
    blocks merged: the ``extents`` of a write that carries just those blocks."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        lo, hi = b * block, min(b * block + block, length)
        if runs and runs[-1][0] + runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi - runs[-1][0])
        else:
            runs.append((lo, hi - lo))
    return runs


def pack_crcs(crcs: array | list[int]) -> bytes:
    """Block CRCs as little-endian uint32s, for the wire."""
    packed = array("I", crcs)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_crcs(blob: bytes) -> array:
    """The inverse of :func:`pack_crcs`."""
    crcs = array("I", blob)
    if sys.byteorder == "big":
        crcs.byteswap()
    return crcs
