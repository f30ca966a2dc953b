"""Small trio helpers shared by the clients."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio


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
