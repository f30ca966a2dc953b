"""Small trio helpers shared by the clients and services."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")


@contextlib.asynccontextmanager
async def one_error() -> AsyncIterator[None]:
    """Parallel pieces of one operation fail as that operation: re-raise the first real error a nursery collected
    (its type and errno intact) instead of trio's exception group, which callers expecting an OSError miss."""
    try:
        yield
    except BaseExceptionGroup as group:
        _, rest = group.split(trio.Cancelled)
        if rest is None:
            raise
        first: BaseException = rest
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from group


class Workers:
    """Long-lived threads for blocking calls on a hot path: ``await workers.run(fn)`` does what
    ``trio.to_thread.run_sync(fn)`` does (the calling task cannot be cancelled while ``fn`` runs) without its
    per-call work (a capacity limiter, naming the OS thread twice, a thread-cache hand-off), CPU that a hot path
    pays on every call. Threads start on demand, up to ``max_threads``; more calls wait."""

    def __init__(self, name: str, max_threads: int = 16) -> None:
        self._name = name
        self._max = max_threads
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Any, trio.lowlevel.TrioToken]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = self._queued = 0

    async def run(self, fn: Callable[[], T]) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._jobs.put((fn, trio.lowlevel.current_task(), trio.lowlevel.current_trio_token()))
        with self._lock:
            self._queued += 1
            start = self._queued > self._idle and self._threads < self._max
            if start:
                self._threads += 1
        if start:
            threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            fn, task, token = self._jobs.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            result = outcome.capture(fn)
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # the caller's run ended meanwhile: nobody waits for the result
                pass
