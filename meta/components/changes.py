"""The change feed's reader and trimmer (the records are written by :class:`kvfs.meta.feed.FeedDatabase`)."""

from __future__ import annotations

import itertools
from typing import Callable

from kvfs.kv import Database, Transaction
from kvfs.kv.base import STAMP_BYTES
from kvfs.kv.keys import key_after
from kvfs.meta import schema
from kvfs.meta.feed import decode_change, stamp_of
from kvfs.meta.types import ChangePage

#: How long change-feed records are kept: a mount cut off from meta for longer drops its caches when it is back.
FEED_SECONDS = 120.0


class ChangeFeed:
    """Pages through the feed after a cursor, and drops records older than a reader may be behind."""

    def __init__(self, db: Database, clock: Callable[[], int]) -> None:
        self._db = db
        self._clock = clock

    def read(self, since: bytes, limit: int, skip_client: bytes) -> ChangePage:
        """See :meth:`kvfs.meta.store.MetaStore.changes`."""
        return self._db.run(self._read, since, max(1, limit), skip_client)

    @staticmethod
    def _read(tr: Transaction, since: bytes, limit: int, skip_client: bytes) -> ChangePage:
        floor = tr.get(schema.FEED_FLOOR, snapshot=True) or bytes(STAMP_BYTES)
        if not since or since < floor:
            head = tr.get_range(*schema.FEED_RANGE, limit=1, reverse=True, snapshot=True)
            return ChangePage(max(floor, stamp_of(head[0][0])) if head else floor, [], gap=bool(since))
        rows = tr.get_range(key_after(schema.FEED + since), schema.FEED_RANGE[1], limit=limit, snapshot=True)
        changes = [c for c in map(decode_change, (raw for _, raw in rows)) if not skip_client or c.client != skip_client]
        cursor = stamp_of(rows[-1][0]) if rows else since
        return ChangePage(cursor, changes, more=len(rows) == limit)

    def trim(self, keep_seconds: float, limit: int) -> int:
        """See :meth:`kvfs.meta.store.MetaStore.trim_changes`."""
        cutoff = self._clock() - int(keep_seconds * 1e9)

        def fn(tr: Transaction) -> int:
            rows = tr.get_range(*schema.FEED_RANGE, limit=limit, snapshot=True)
            old = list(itertools.takewhile(lambda row: decode_change(row[1]).time_ns < cutoff, rows))
            if old:
                tr.clear_range(schema.FEED_RANGE[0], key_after(old[-1][0]))
                tr.set(schema.FEED_FLOOR, stamp_of(old[-1][0]))
            return len(old)

        return self._db.run(fn)
