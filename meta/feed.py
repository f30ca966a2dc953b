"""The change feed: every committed metadata transaction leaves one record of what it changed.

Mounts cache entries and attributes in the kernel for as long as they can hear about other clients' changes
(``fuse/coherence.py``). For that, each transaction that writes an inode or a directory entry also writes a
:class:`~kvfs.meta.types.Change` under a commit-ordered stamped key (:meth:`~kvfs.kv.base.Transaction.set_stamped`):
a versionstamp on FoundationDB, so the feed adds no conflicts between metadata instances, and the next value of
a counter under SQLite's single writer. A reader that remembers the last stamp it saw and range-reads past it
sees every later change exactly once, from any metadata instance.

The records are written by :class:`FeedDatabase`, which wraps the store's database and watches what each
transaction function writes, so no operation can forget to report a change. Who made a change comes from
:data:`ORIGIN`, which the service sets around each call from the caller's client id.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Awaitable, Sequence
from typing import Callable, Concatenate, ParamSpec, TypeVar

import msgspec
import trio

from . import schema
from kvfs.kv import Database, KeyValue, Transaction
from .types import Change, ChangePage

P = ParamSpec("P")
R = TypeVar("R")

#: The client id of the call being served (``Caller.client``); empty for changes no client asked for.
ORIGIN: contextvars.ContextVar[bytes] = contextvars.ContextVar("kvfs_meta_origin", default=b"")

_encode = msgspec.msgpack.Encoder().encode


class _Tracked(Transaction):
    """A transaction that notes the inodes and directory entries it sets or clears."""

    __slots__ = ("tr", "inodes", "entries")

    def __init__(self, tr: Transaction) -> None:
        self.tr = tr
        self.inodes: set[int] = set()
        self.entries: set[tuple[int, bytes]] = set()

    def _note(self, key: bytes) -> None:
        if key.startswith(schema.INODE_PREFIX):
            self.inodes.add(schema.inode_of(key))
        elif key.startswith(schema.DENTRY_PREFIX):
            self.entries.add(schema.dentry_of(key))

    def get(self, key: bytes, snapshot: bool = False) -> bytes | None:
        return self.tr.get(key, snapshot)

    def get_many(self, keys: Sequence[bytes], snapshot: bool = False) -> list[bytes | None]:
        return self.tr.get_many(keys, snapshot)

    def get_range(
        self, begin: bytes, end: bytes, limit: int = 0, reverse: bool = False, snapshot: bool = False
    ) -> list[KeyValue]:
        return self.tr.get_range(begin, end, limit, reverse, snapshot)

    def set(self, key: bytes, value: bytes) -> None:
        self._note(key)
        self.tr.set(key, value)

    def clear(self, key: bytes) -> None:
        self._note(key)
        self.tr.clear(key)

    def clear_range(self, begin: bytes, end: bytes) -> None:
        # The store clears ranges of xattrs, sessions and answers only: an inode or entry goes one key at a time.
        self.tr.clear_range(begin, end)

    def add(self, key: bytes, delta: int) -> None:
        self.tr.add(key, delta)

    def max(self, key: bytes, value: int) -> None:
        self.tr.max(key, value)

    def set_stamped(self, prefix: bytes, value: bytes) -> None:
        self.tr.set_stamped(prefix, value)

    def commit(self) -> None:
        raise RuntimeError("the feed commits through Database.run")

    def reset(self) -> None:
        raise RuntimeError("the feed commits through Database.run")


class FeedDatabase(Database):
    """``db`` whose :meth:`run` appends a feed record to every transaction that changed inodes or entries."""

    def __init__(self, db: Database, clock: Callable[[], int] = time.time_ns) -> None:
        self.db = db
        self.inline = db.inline
        self._clock = clock
        self.appended = 0  # records this process has committed: the service wakes watchers when it moves

    def create_transaction(self) -> Transaction:
        return self.db.create_transaction()  # raw: for reads, and writes that are not metadata

    def close(self) -> None:
        self.db.close()

    def run(self, fn: Callable[Concatenate[Transaction, P], R], *args: P.args, **kw: P.kwargs) -> R:
        wrote = False

        def tracked(tr: Transaction) -> R:
            nonlocal wrote
            seen = _Tracked(tr)
            result = fn(seen, *args, **kw)
            wrote = bool(seen.inodes or seen.entries)
            if wrote:
                change = Change(ORIGIN.get(), self._clock(), sorted(seen.inodes), sorted(seen.entries))
                tr.set_stamped(schema.FEED, _encode(change))
            return result

        result = self.db.run(tracked)
        if wrote:
            self.appended += 1
        return result


    def publish(self, change: Change) -> None:
        """Append a record that no change of inodes or entries wrote (a recall: see meta/delegation.py)."""
        self.db.run(lambda tr: tr.set_stamped(schema.FEED, _encode(change)))
        self.appended += 1


def stamp_of(key: bytes) -> bytes:
    """The stamp of a feed record's key."""
    return key[len(schema.FEED):]


decode_change = msgspec.msgpack.Decoder(Change).decode


async def long_poll(
    read: Callable[[bytes], Awaitable[ChangePage]], since: bytes, wait: float, pause: Callable[[float], Awaitable[None]]
) -> ChangePage:
    """Read the feed after ``since`` until a page has news (changes, a gap, more to come) or ``wait`` seconds are
    up. ``pause(left)`` waits, at most ``left`` seconds, for a reason to read again. An empty ``since`` asks for the
    head and is answered at once."""
    deadline = trio.current_time() + wait
    while True:
        page = await read(since)
        left = deadline - trio.current_time()
        if page.changes or page.gap or page.more or not since or left <= 0:
            return page
        since = page.cursor
        await pause(left)
