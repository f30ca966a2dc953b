"""kvfs.aio: the Workers thread pool the chunk server runs its engine calls in."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from kvfs.aio import Workers


async def test_workers_return_results_raise_errors_and_run_calls_side_by_side():
    workers = Workers("test", max_threads=4)
    assert await workers.run(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        await workers.run(lambda: 1 / 0)
    started = time.monotonic()
    names: set[str] = set()

    def slow() -> None:
        names.add(threading.current_thread().name)
        time.sleep(0.2)

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(workers.run, slow)
    assert 0.35 < time.monotonic() - started < 1.5  # four at a time: two rounds of 0.2 s
    assert len(names) == 4 and all(n.startswith("test-") for n in names)


async def test_a_cancelled_caller_still_waits_for_its_call():
    """As with trio.to_thread.run_sync: the thread may be using the caller's buffers until it returns."""
    workers = Workers("test")
    done = threading.Event()

    def slow() -> None:
        time.sleep(0.2)
        done.set()

    with trio.move_on_after(0.05):
        await workers.run(slow)
    assert done.is_set()
