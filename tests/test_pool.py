"""The buffer pool hands a buffer out again only once nothing else references it."""

from __future__ import annotations

import gc
import threading

from kvfs.pool import BufferPool

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
