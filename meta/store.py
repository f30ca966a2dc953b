"""The metadata service's logic: POSIX metadata over the transactional KV store, one KV transaction per operation.

Methods are synchronous: the RPC service runs them on its event loop (SQLite) or in a worker thread
(FoundationDB).  Each takes the :class:`Caller` first, checks POSIX permissions for it and raises
:class:`KvfsError` with the errno a kernel would give.  Operations are inode based like FUSE's low-level API
(``parent`` inode + ``name``); :meth:`MetaStore.resolve` walks whole paths for callers that bypass the kernel.
Names are bytes (any byte but ``/`` and NUL); ``str`` is accepted and encoded with UTF-8/surrogateescape like
``os.fsencode``. readdir returns real entries only: "." and ".." are the FUSE layer's business.

:class:`MetaStore` is where every operation is declared (the RPC surface is derived from its methods,
:mod:`kvfs.meta.rpc`). The operations themselves are grouped by what they touch in :mod:`kvfs.meta.ops`; the parts
with records of their own (inode ids, exactly-once answers, write sessions, client leases, delegations, the chunk
collector, the change feed) are components in :mod:`kvfs.meta.components`, which the store composes.
"""

from __future__ import annotations

import stat
import time
from typing import Callable

from kvfs.kv import Database, Transaction
from kvfs.meta import schema
from kvfs.meta.chunks import ChunkRemover
from kvfs.meta.components import answers
from kvfs.meta.components.answers import ANSWER_MINUTES, Answers
from kvfs.meta.components.changes import FEED_SECONDS, ChangeFeed
from kvfs.meta.components.delegations import Delegations
from kvfs.meta.components.gc import Collector
from kvfs.meta.components.ids import InodeIds
from kvfs.meta.components.leases import ClientLeases
from kvfs.meta.components.sessions import Sessions
from kvfs.meta.delegation import DELEGATION_SECONDS, DelegationHeld
from kvfs.meta.feed import FeedDatabase
from kvfs.meta.ops.batches import BatchOps
from kvfs.meta.ops.delegated import DelegationOps
from kvfs.meta.ops.xattrs import XattrOps
from kvfs.meta.posix import (  # the POSIX constants callers of the store use, importable with it
    LAYOUT_XATTR, RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO, XATTR_CREATE, XATTR_REPLACE,
)
from kvfs.meta.records import decode_inode, put_inode
from kvfs.meta.types import Attr, Caller, ChangePage, Inode, Layout

__all__ = [
    "ANSWER_MINUTES", "FEED_SECONDS", "LAYOUT_XATTR", "RENAME_EXCHANGE", "RENAME_NOREPLACE", "ROOT_INO",
    "XATTR_CREATE", "XATTR_REPLACE", "MetaStore", "SpaceFn",
]

SpaceFn = Callable[[], tuple[int, int]]


class MetaStore(BatchOps, XattrOps, DelegationOps):
    """The metadata service's logic; any number of instances may share one KV store."""

    def __init__(
        self,
        db: Database,
        *,
        chunk_remover: ChunkRemover | None = None,
        space: SpaceFn | None = None,
        root_layout: Layout = Layout(),
        clock: Callable[[], int] = time.time_ns,
        client_lease: float = 60.0,
        delegation_lease: float = DELEGATION_SECONDS,
    ) -> None:
        """``space`` returns ``(total_bytes, free_bytes)`` for statfs (the chunk servers' capacity);
        without it statfs reports a nominal 1 PiB, all free.  ``chunk_remover`` is needed by :meth:`gc_once`.
        ``client_lease``: seconds a client may go without :meth:`renew_client` before :meth:`expire_clients`
        ends its write sessions. ``delegation_lease``: how long a directory delegation lasts unrenewed."""
        self.db = FeedDatabase(db, clock)
        self._clock = clock
        self._root_layout = root_layout
        self._space = space
        self._answers = Answers(self.db)
        self._ids = InodeIds(self.db)
        self._sessions = Sessions(clock, self._now)
        self._leases = ClientLeases(self.db, clock, int(client_lease * 1e9))
        self._delegations = Delegations(self.db, clock, int(delegation_lease * 1e9))
        self._collector = Collector(self.db, chunk_remover)
        self._feed = ChangeFeed(self.db, clock)

    # ------------------------------------------------------------------ format ------------
    def format(self, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Attr:
        """Create the root directory (inode 1) unless it exists; safe to call from every instance."""
        return self.db.run(self._format, mode, uid, gid)

    ensure_root = format

    def _format(self, tr: Transaction, mode: int, uid: int, gid: int) -> Attr:
        raw = tr.get(schema.inode(ROOT_INO))
        if raw is not None:
            return decode_inode(raw).attr
        now = self._clock()
        attr = Attr(ROOT_INO, stat.S_IFDIR | (mode & 0o7777), 2, uid, gid, 0, now, now, now,
                    blksize=self._root_layout.chunk_size)
        root = Inode(attr, parent=ROOT_INO, layout=self._root_layout)
        put_inode(tr, root)
        tr.set(schema.FORMAT, b"1")
        tr.add(schema.INODE_COUNT, 1)
        return attr

    # ------------------------------------------------------------------ exactly once --------
    answering_once = staticmethod(answers.answering_once)

    def expire_answers(self) -> None:
        """Drop answers recorded more than ANSWER_MINUTES ago (one range clear)."""
        self._answers.expire()

    # ------------------------------------------------------------------ delegations -------
    def recall(self, directory: int) -> None:
        """Ask the holder of ``directory`` to give it back: a feed record it follows (meta/delegation.py)."""
        self._delegations.recall(directory)

    def break_lapsed(self, directory: int) -> None:
        """End ``directory``'s grant if it has lapsed: from now on its holder can apply nothing more under it."""
        self._delegations.break_lapsed(directory)

    def answer_held(self, held: DelegationHeld) -> None:
        """What meta does for a caller that found ``held``: break a lapsed grant, or recall a live one."""
        self._delegations.answer(held)

    # ------------------------------------------------------------------ client leases -----
    def renew_client(self, caller: Caller) -> float:
        """The calling client is alive: its write sessions stay. Returns the lease in seconds: the client renews
        well within it (so it need not be configured on both sides)."""
        return self._leases.renew(caller.client)

    def expire_clients(self, limit: int = 256) -> int:
        """End the write sessions of clients that have not renewed for the lease (crashed or cut off), so
        files they held open can be collected. Ends at most ``limit`` sessions per call; returns how many.

        A client cut off for longer than its lease finds its sessions gone when it comes back: its writes
        then fail (EBADF at the next length report) instead of holding removed files' space forever."""
        return self._leases.expire(limit)

    # ------------------------------------------------------------------ GC ----------------
    @property
    def collects_chunks(self) -> bool:
        """Whether :meth:`gc_once` can run (the store was given a chunk remover)."""
        return self._collector.remover is not None

    def gc_once(self, limit: int = 64) -> int:
        """Collect up to ``limit`` queued inodes without write sessions: remove their chunks, then
        their records.  Returns how many were collected.  Chunk removal runs outside any
        transaction (it is not retryable) and before the record goes, so a crash in between only
        repeats an idempotent removal; a queued inode cannot gain a new session (open refuses
        nlink 0), so nothing can start writing after the check."""
        return self._collector.collect(limit)

    # ------------------------------------------------------------------ change feed -------
    def changes(self, since: bytes = b"", *, limit: int = 1024, skip_client: bytes = b"") -> ChangePage:
        """The changes committed after cursor ``since`` (see :mod:`kvfs.meta.feed`), in commit order, at most ``limit``.

        An empty ``since`` starts at the feed's head: no changes, just the cursor to follow from. Changes made by
        ``skip_client`` are left out (a mount knows its own), but the cursor still moves past them."""
        return self._feed.read(since, limit, skip_client)

    def trim_changes(self, keep_seconds: float = FEED_SECONDS, limit: int = 4096) -> int:
        """Drop up to ``limit`` feed records older than ``keep_seconds``; returns how many. A reader whose cursor
        is behind the newest dropped record then learns it has a gap (:meth:`changes`)."""
        return self._feed.trim(keep_seconds, limit)
