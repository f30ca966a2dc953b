"""Chunk placement: which chain holds chunk ``i`` of a file.

Chunk ``i`` of a file lives on chain index ``(base + perm(seed, stripe)[i % stripe]) % n_chains``
with ``base = splitmix64(seed ^ ino) % n_chains`` (the inode mixed in so that files whose seeds
collide still start on different chains).  ``perm`` is this project's own Fisher-Yates shuffle driven by
splitmix64: a few lines of integer arithmetic that can never change under us, unlike a library
shuffle (3FS lost placement when std::shuffle changed between compilers).  Golden-value tests
pin it; changing this file would make existing data unreachable.
"""

from __future__ import annotations

from functools import lru_cache

from kvfs.storage import LayoutLike

_M64 = (1 << 64) - 1


def splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64 (Steele, Lea, Flood 2014): ``(next_state, output)``."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


@lru_cache(maxsize=4096)
def permutation(seed: int, n: int) -> tuple[int, ...]:
    """A permutation of ``range(n)``: Fisher-Yates from the top, ``j = r % (i + 1)`` (the modulo
    bias is negligible for stripe-sized ``n`` and is part of the fixed definition)."""
    perm = list(range(n))
    state = seed & _M64
    for i in range(n - 1, 0, -1):
        state, r = splitmix64(state)
        j = r % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return tuple(perm)


def chunk_chain(layout: LayoutLike, ino: int, chunk_index: int, n_chains: int) -> int:
    """Index into the layout's chain table of the chain holding chunk ``chunk_index`` of ``ino``."""
    if n_chains <= 0:
        raise ValueError("n_chains must be positive")
    stripe = max(1, layout.stripe)
    base = splitmix64((layout.seed ^ ino) & _M64)[1] % n_chains
    return (base + permutation(layout.seed, stripe)[chunk_index % stripe]) % n_chains
