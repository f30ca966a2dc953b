"""The mount's block cache on its own: bounded LRU, dropped ranges, close-to-open stamps (a model comparison)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs.fuse.cache import BLOCK, BlockCache

INODES = st.integers(1, 3)
INDEXES = st.integers(0, 5)
STAMPS = st.sampled_from([(1, 10), (2, 10)])
OPS = st.one_of(
    st.tuples(st.just("put"), INODES, INDEXES, st.integers(1, BLOCK), STAMPS),
    st.tuples(st.just("get"), INODES, INDEXES),
    st.tuples(st.just("drop_range"), INODES, st.integers(0, 6 * BLOCK), st.integers(0, 3 * BLOCK)),
    st.tuples(st.just("drop"), INODES),
    st.tuples(st.just("opened"), INODES, STAMPS),
)


@given(st.lists(OPS, max_size=60), st.integers(1, 4 * BLOCK))
@settings(max_examples=500, deadline=None)
def test_cache_never_answers_with_bytes_it_should_have_dropped(ops, capacity):
    cache = BlockCache(capacity)
    valid: dict[tuple[int, int], bytes] = {}  # what a hit may return: the latest put not since dropped
    stamps: dict[int, tuple[int, int]] = {}
    for n, op in enumerate(ops):
        kind, ino = op[0], op[1]
        if kind == "put":
            _, _, index, size, stamp = op
            if stamps.get(ino, stamp) != stamp:
                valid = {k: v for k, v in valid.items() if k[0] != ino}
            stamps[ino] = stamp
            data = bytes([n % 256]) * size
            cache.put(ino, index, data, stamp)
            valid[(ino, index)] = data
        elif kind == "get":
            got = cache.get(ino, op[2])
            assert got is None or got == valid.get((ino, op[2]))
        elif kind == "drop_range":
            _, _, offset, length = op
            cache.drop_range(ino, offset, length)
            if length:
                for index in range(offset // BLOCK, (offset + length - 1) // BLOCK + 1):
                    valid.pop((ino, index), None)
        elif kind == "drop":
            cache.drop(ino)
            valid = {k: v for k, v in valid.items() if k[0] != ino}
            stamps.pop(ino, None)
        else:
            if stamps.get(ino, op[2]) != op[2]:
                valid = {k: v for k, v in valid.items() if k[0] != ino}
                stamps.pop(ino, None)
            cache.opened(ino, op[2])
        assert cache.used <= capacity
        assert cache.used == sum(len(b) for b in cache._blocks.values())


def test_least_recently_used_blocks_go_first():
    cache = BlockCache(3 * BLOCK)
    for index in range(3):
        cache.put(7, index, bytes(BLOCK), (1, 1))
    assert cache.get(7, 0) is not None  # now the most recent
    cache.put(7, 3, bytes(BLOCK), (1, 1))
    assert cache.get(7, 1) is None and all(cache.get(7, i) is not None for i in (0, 2, 3))
    cache.opened(7, (2, 1))  # the file changed elsewhere: all of it goes
    assert cache.used == 0 and all(cache.get(7, i) is None for i in range(4))
