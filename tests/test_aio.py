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
    names: set[str] = set()
    lock = threading.Lock()
    calls = active = peak = 0
    together = threading.Barrier(4, timeout=30)  # the first four calls meet here: they run side by side

    def slow() -> None:
        nonlocal calls, active, peak
        with lock:
            calls, active = calls + 1, active + 1
            peak, first_four = max(peak, active), calls <= 4
            names.add(threading.current_thread().name)
        if first_four:
            together.wait()
        time.sleep(0.05)
        with lock:
            active -= 1

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(workers.run, slow)
    assert calls == 6 and peak == 4  # four at a time, never more (no bound on time: CI machines are slow)
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
