"""The buffer pool hands a buffer out again only once nothing else references it."""

from __future__ import annotations

import gc
import mmap
import threading

from kvfs.pool import RECEIVED, BufferPool, page_aligned
from kvfs.transport.buffers import buffer_address

MIB = 1 << 20


def test_a_buffer_comes_back_only_when_every_reference_is_gone():
    pool = BufferPool(capacity=4 * MIB)
    a = pool.take(MIB)
    view = memoryview(a)[10:20]  # a slice still references the buffer
    del a
    b = pool.take(MIB)
    assert b is not view.obj  # in use: a second buffer
    b_id = id(b)
    del b
    assert id(pool.take(MIB)) == b_id  # free again: reused (and garbage, not zeroed)
    first_id = id(view.obj)
    view.release()
    del view
    gc.collect()
    assert id(pool.take(MIB)) == first_id


def test_odd_and_small_sizes_and_a_full_pool_give_fresh_buffers():
    pool = BufferPool(capacity=2 * MIB, min_size=256 << 10)
    assert len(pool.take(MIB + 1)) == MIB + 1 and len(pool.take(4096)) == 4096 and pool.held == 0
    held = [pool.take(MIB) for _ in range(3)]  # the third does not fit: handed out, not kept
    assert pool.held == 2 * MIB and len({id(b) for b in held}) == 3


def test_views_of_any_size_reuse_pooled_buffers():
    pool = BufferPool(capacity=4 * MIB, min_size=256 << 10)
    view = pool.view(100_000)  # smaller than the smallest pooled size, and no power of two
    assert len(view) == 100_000 and len(view.obj) == 256 << 10 and pool.held == 256 << 10
    first = id(view.obj)
    del view
    assert id(pool.view(200_000).obj) == first  # the same pooled buffer again, once nothing refers to it
    assert len(pool.view(0)) == 0


def test_threads_never_share_a_buffer():
    pool = BufferPool(capacity=64 * MIB)
    errors: list[str] = []

    def worker(tag: int) -> None:
        for i in range(200):
            buf = pool.take(256 << 10)
            buf[0] = tag
            buf[-1] = i % 256
            if buf[0] != tag or buf[-1] != i % 256:
                errors.append(f"buffer taken by two threads at once ({tag}, {i})")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_received_buffers_are_page_aligned_and_trim_gives_their_pages_back():
    """A chunk server writes received chunks to disk with O_DIRECT, which needs page-aligned memory."""
    pool = BufferPool(capacity=4 * MIB, allocate=page_aligned)
    buf = pool.take(MIB)
    assert isinstance(buf, mmap.mmap) and buffer_address(memoryview(buf)) % mmap.PAGESIZE == 0
    assert isinstance(RECEIVED.take(MIB), mmap.mmap)
    buf[:4] = b"full"
    del buf
    assert pool.trim(idle=0) == MIB  # private memory: given back with MADV_DONTNEED, reads as zeros again
    assert pool.take(MIB)[:4] == bytes(4)


def test_a_buffer_let_go_of_after_a_trim_is_given_back_by_the_next_one():
    """Held writes keep their buffers until a flush, which may come after the pool went idle and was trimmed."""
    pool = BufferPool(capacity=4 * MIB, allocate=page_aligned)
    held, free = pool.take(MIB), pool.take(MIB)
    del free
    assert pool.trim(idle=0) == MIB  # only the free one
    assert pool.trim(idle=0) == 0  # nothing new to give back
    del held  # a flush wrote it out
    assert pool.trim(idle=0) == MIB
    assert pool.trim(idle=60) == 0  # and never before the pool has been idle that long
