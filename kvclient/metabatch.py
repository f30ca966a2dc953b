"""What kvclient's batches share with its evictor: the temporary-name rule of puts, and sending a batch
operation of meta in parts of at most MAX_BATCH names (one transaction each), so a batch of any size costs a
bounded number of round trips."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kvfs.meta.api import MAX_BATCH
from kvfs.meta.types import Caller

#: A put writes into ``.put-<random>`` and renames it onto its key once every replica holds every byte; such names
#: are never keys (kvclient refuses keys with this prefix), and ones left by a dead client are orphans.
TEMP_PREFIX = b".put-"

T = TypeVar("T")


async def per_batch(call: Callable[..., Awaitable[list[T]]], caller: Caller, directory: int,
                    items: Sequence[Any], *args: Any) -> list[T]:
    """``call(caller, directory, part, *args)`` for each part of ``items`` of at most MAX_BATCH, answers joined."""
    answers: list[T] = []
    for start in range(0, len(items), MAX_BATCH):
        answers += await call(caller, directory, list(items[start:start + MAX_BATCH]), *args)
    return answers
