"""What every group of operations shares: the store's parts, and the helpers that need them."""

from __future__ import annotations

import contextvars
import errno
from typing import Any, Callable

from kvfs.kv import Transaction
from kvfs.meta.components.answers import Answers
from kvfs.meta.components.delegations import Delegations
from kvfs.meta.components.ids import InodeIds
from kvfs.meta.components.sessions import Sessions
from kvfs.meta.feed import FeedDatabase
from kvfs.meta.posix import X_OK, errno_error, is_dir, require_access
from kvfs.meta.records import get_live, touch
from kvfs.meta.types import Caller, Inode, Layout

#: The time a delegated change was made at (its holder's clock): what meta applies it with, instead of its own.
HOLDER_TIME: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvfs_meta_now", default=None)


class OpsBase:
    """The parts :class:`kvfs.meta.store.MetaStore` sets up, and helpers over them."""

    db: FeedDatabase
    _clock: Callable[[], int]
    _root_layout: Layout
    _space: Callable[[], tuple[int, int]] | None
    _answers: Answers
    _ids: InodeIds
    _sessions: Sessions
    _delegations: Delegations

    def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``db.run`` for the transaction of a non-idempotent operation (see :meth:`answering_once`)."""
        return self._answers.run(fn, *args)

    def _now(self) -> int:
        """The time a change happens at: the holder's, for a delegated change (see :meth:`apply_delegated`)."""
        held = HOLDER_TIME.get()
        return self._clock() if held is None else held

    def _touch(self, *inodes: Inode, mtime: bool = True) -> None:
        touch(self._now(), *inodes, mtime=mtime)

    def _layout(self, inode: Inode) -> Layout:
        """The layout of a file, or the one a directory gives its new children."""
        return inode.layout or self._root_layout

    def _dir(self, tr: Transaction, caller: Caller, ino: int, want: int = X_OK, *,
             removing: bytes | None = None) -> Inode:
        """A live directory the caller has ``want`` access to (search by default), not delegated to another client
        (unless the caller is ``removing`` a name the holder cannot have touched: Delegations.check)."""
        inode = get_live(tr, ino)
        if not is_dir(inode):
            raise errno_error(errno.ENOTDIR, f"inode {ino}")
        self._delegations.check(tr, caller, ino, removing=removing)
        require_access(caller, inode.attr, want)
        return inode
