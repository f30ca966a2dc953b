"""Kernel caches kept coherent with other clients through meta's change feed (meta/feed.py).

While the mount follows the feed it lets the kernel keep entries and attributes for ``long_timeout`` (a repeated
stat or path walk then never reaches the daemon) and turns every change another client makes into a kernel
invalidation. When the feed lapses (no answer within its wait plus ``grace``) or reports a gap, the mount cannot
know what changed: it invalidates every entry and inode it handed to the kernel and replies with the short
timeouts until the feed answers again.

A reply races an invalidation when meta read the state before another client's change but the reply reaches
the kernel after the mount applied that change. Handlers note :attr:`Coherence.applied` when they start
(:data:`STARTED`); a reply gets the long timeout only if no foreign change was applied since.
"""

from __future__ import annotations

import contextvars
import logging
from collections import OrderedDict
from typing import Any

import pyfuse3
import trio

from meta.types import Caller, ChangePage

log = logging.getLogger(__name__)

#: ``Coherence.applied`` when the current request handler started (-1: outside a handler).
STARTED: contextvars.ContextVar[int] = contextvars.ContextVar("kvfs_fuse_started", default=-1)
KNOWN_NAMES = 1 << 20  # names handed to the kernel that a lapse invalidates; older ones are forgotten


class Coherence:
    """Follows the change feed and says how long the kernel may keep each reply."""

    def __init__(self, long_timeout: float, *, wait: float = 5.0, grace: float = 2.0) -> None:
        self.long_timeout = long_timeout
        self.wait = wait
        self.grace = grace
        self.live = False
        self.applied = 0  # foreign changes applied so far
        self._names: OrderedDict[tuple[int, bytes], None] = OrderedDict()
        self._inodes: OrderedDict[int, None] = OrderedDict()

    def timeout(self, short: float) -> float:
        """The timeout for a reply made now by the current handler."""
        started = STARTED.get()
        if self.live and started == self.applied:
            return max(short, self.long_timeout)
        return short

    def handed(self, ino: int, parent: int | None = None, name: bytes | None = None) -> None:
        """The kernel was given ``ino``'s attributes (and told ``name`` in ``parent`` is it), perhaps for long."""
        _remember(self._inodes, ino)
        if parent is not None and name is not None:
            _remember(self._names, (parent, name))

    async def follow(self, meta: Any, caller: Caller) -> None:
        """Follow the feed forever (run it in the mount's nursery)."""
        cursor = b""
        while True:
            page: ChangePage | None = None
            try:
                with trio.move_on_after(self.wait + self.grace):
                    page = await meta.watch(caller, cursor, self.wait)
            except OSError as exc:
                log.warning("change feed: %s", exc)
            if page is None or page.gap:
                if self.live or page is not None:
                    log.warning("change feed %s: dropping cached entries and attributes",
                                "has a gap" if page is not None else "lapsed")
                self._lapse()
                if page is None:
                    await trio.sleep(0.5)
                    continue
            self.apply(page)
            cursor = page.cursor
            self.live = not page.more

    def apply(self, page: ChangePage) -> None:
        for change in page.changes:
            self.applied += 1
            for ino in change.inodes:
                invalidate_attributes(ino)
            for parent, name in change.entries:
                pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)

    def _lapse(self) -> None:
        self.live = False
        self.applied += 1
        names, self._names = self._names, OrderedDict()
        inodes, self._inodes = self._inodes, OrderedDict()
        for ino in inodes:
            invalidate_attributes(ino)
        for parent, name in names:
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)


def _remember(cache: OrderedDict, key: Any) -> None:
    cache[key] = None
    cache.move_to_end(key)
    if len(cache) > KNOWN_NAMES:
        cache.popitem(last=False)


def invalidate_attributes(ino: int) -> None:
    """Attributes only: dropping pages could wait on a read this daemon is serving (close-to-open keeps data)."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only=True)
    except OSError:  # ENOENT: the kernel does not hold it
        pass
