"""The metadata client's surface over a store in this process: what tests and benchmarks mount without a service.

It behaves as :class:`kvfs.meta.client.RemoteMeta` does against ``kvfs meta``: operations run in worker threads
under the caller's client id, a held delegation is recalled and the call retried, and the change feed is
long-polled.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from kvfs.meta.delegation import DelegationHeld, retry_while_recalled
from kvfs.meta.feed import ORIGIN, long_poll
from kvfs.meta.rpc import OPS
from kvfs.meta.store import MetaStore
from kvfs.meta.types import Caller, ChangePage


class LocalMeta:
    """The same surface over a store in this process; operations run in worker threads."""

    def __init__(self, store: MetaStore, *, feed_poll: float = 0.05) -> None:
        self.store = store
        self.feed_poll = feed_poll

    async def watch(self, caller: Caller, since: bytes, wait: float, limit: int = 1024) -> ChangePage:
        """The change feed after ``since``: polled every ``feed_poll`` seconds for up to ``wait``."""

        async def read(cursor: bytes) -> ChangePage:
            call = functools.partial(self.store.changes, cursor, limit=limit, skip_client=caller.client)
            return await trio.to_thread.run_sync(call)

        return await long_poll(read, since, wait, lambda left: trio.sleep(min(left, self.feed_poll)))

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name not in OPS:
            raise AttributeError(name)
        fn = getattr(self.store, name)

        async def once(caller: Caller, *args: Any, **kwargs: Any) -> Any:
            token = ORIGIN.set(caller.client)  # the worker thread runs in a copy of this context
            try:
                return await trio.to_thread.run_sync(functools.partial(fn, caller, *args, **kwargs))
            except DelegationHeld as held:  # as the service does: ask the holder to give it back, then retry
                await trio.to_thread.run_sync(self.store.answer_held, held)
                raise
            finally:
                ORIGIN.reset(token)

        async def call(caller: Caller, *args: Any, **kwargs: Any) -> Any:
            return await retry_while_recalled(functools.partial(once, caller, *args, **kwargs))

        call.__name__ = name
        return call
