"""Kernel caches kept coherent with other clients through meta's change feed (meta/feed.py).

While the mount follows the feed it lets the kernel keep entries, negative entries (absent names) and attributes
for ``long_timeout`` (a repeated stat, path walk or probe for a missing file then never reaches the daemon) and
turns every change another client makes into a kernel invalidation. When the feed lapses (no answer within its
wait plus ``grace``) or reports a gap, the mount cannot know what changed: it invalidates every entry and inode
it handed to the kernel and replies with the short timeouts until the feed answers again.

For directories whose whole listing it holds (it created them, or read them after lookups kept missing there)
the mount also answers the lookup of an absent name itself (:meth:`Coherence.absent`), so ``open(O_CREAT)`` of
a new name costs one meta call, not two. Such a listing stays complete only while this mount's own changes
update it and no other client touches the directory: a foreign change of any of its entries, a lapse, or a
failed change of our own (its outcome may be unknown) drops it. A create that raced another client's create of
the same name reaches meta, which decides. A listing read from meta (several pages, each its own snapshot)
counts only if no other client touched the directory from before its first page until its last (any change the
feed applies in between voids it); this mount's own changes meanwhile are replayed on top of it.

The mount also keeps ``security.*`` xattr answers (present or absent) while the feed is live. The kernel asks for
``security.capability`` before every write to see whether the write must drop file capabilities, and a meta round
trip per write request was a tenth of a 1 MiB write's time. Reading ``security.*`` needs no permission, so one
answer serves every caller; an xattr change touches its inode, so the feed reports it like any other change.

A reply races an invalidation when meta read the state before another client's change but the reply reaches
the kernel after the mount applied that change. Handlers note :attr:`Coherence.applied` when they start
(:data:`STARTED`); a reply gets the long timeout only if no foreign change was applied since.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections import OrderedDict
from typing import Any, Callable

import pyfuse3
import trio

from kvfs.meta.types import Caller, ChangePage
from kvfs.service import Complaint

log = logging.getLogger(__name__)

#: ``Coherence.applied`` when the current request handler started (-1: outside a handler).
STARTED: contextvars.ContextVar[int] = contextvars.ContextVar("kvfs_fuse_started", default=-1)
KNOWN_NAMES = 1 << 20  # names handed to the kernel that a lapse invalidates; older ones are forgotten
LISTINGS = 1024  # complete directory listings kept (least recently used go first)
LISTING_NAMES = 1 << 16  # a directory with more names is not kept
LISTING_QUIET = 10.0  # seconds without another client's change in a directory before its listing is read
XATTR_INODES = 1 << 16  # inodes whose security.* xattr answers are kept (least recently used go first)
#: What :meth:`Coherence.xattr` returns when it holds no answer (None means: known to be absent).
UNKNOWN = object()


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
        self._listings: OrderedDict[int, set[bytes]] = OrderedDict()  # directory -> every name in it
        # directory -> the listing being read from meta: the read's token, and this mount's changes of the
        # directory since it began, in order ((True, name): made, (False, name): removed)
        self._reading: dict[int, tuple[object, list[tuple[bool, bytes]]]] = {}
        self._foreign: OrderedDict[int, float] = OrderedDict()  # directory -> when another client last changed it
        self._xattrs: OrderedDict[int, dict[bytes, bytes | None]] = OrderedDict()  # ino -> security.* answers
        self.xattr_changes = 0  # this mount's own xattr changes so far (the feed leaves them out)
        # what else follows the feed (fuse/dirops.py): a recalled directory, a lapse, another client's entry change
        self.on_recall: Callable[[int], None] = _ignore
        self.on_lapse: Callable[[], None] = _nothing
        self.on_foreign: Callable[[int], None] = _ignore

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

    def handed_absent(self, parent: int, name: bytes) -> None:
        """The kernel was told ``name`` is not in ``parent``, perhaps for long."""
        _remember(self._names, (parent, name))

    # -------------------------------------------------------------- complete listings --------
    def absent(self, parent: int, name: bytes) -> bool:
        """True when ``name`` is certainly not in ``parent`` (as far as the feed has told us)."""
        names = self._listings.get(parent)
        return self.live and names is not None and name not in names and name not in (b".", b"..")

    def listing_made(self, ino: int) -> None:
        """This mount created directory ``ino``: its (empty) listing is complete."""
        self._keep_listing(ino, set())

    def _keep_listing(self, ino: int, names: set[bytes]) -> None:
        self._listings[ino] = names
        while len(self._listings) > LISTINGS:
            self._listings.popitem(last=False)

    def begin_listing(self, ino: int, *, force: bool = False) -> object | None:
        """Start reading ``ino``'s listing from meta; None if it is held or being read already, if the feed is not
        live, or if another client changed the directory in the last ``LISTING_QUIET`` seconds (a directory
        several clients fill would have its listing dropped again at once). ``force``: read it anyway unless the
        feed is not live (a delegation's grant carries the listing: fuse/dirops.py); it replaces the one held."""
        changed = self._foreign.get(ino)
        if not self.live or not force and (ino in self._listings or ino in self._reading or (
                changed is not None and time.monotonic() - changed < LISTING_QUIET)):
            return None
        token = object()
        self._reading[ino] = (token, [])
        return token

    def end_listing(self, ino: int, token: object, names: list[bytes] | None) -> bool:
        """Keep the listing read since :meth:`begin_listing` (None: the read failed) unless something voided it.
        The pages may or may not show this mount's own changes made meanwhile, so those are replayed on top: for
        a name only we touched, our last change decides."""
        reading = self._reading.get(ino)
        if reading is None or reading[0] is not token:
            return False
        del self._reading[ino]
        if names is None or not self.live or len(names) > LISTING_NAMES:
            return False
        listing = set(names)
        for made, name in reading[1]:
            (listing.add if made else listing.discard)(name)
        self._keep_listing(ino, listing)
        return True

    def named(self, parent: int, name: bytes) -> None:
        self._note_own(parent, True, name)
        names = self._listings.get(parent)
        if names is not None:
            names.add(name)
            self._listings.move_to_end(parent)
            if len(names) > LISTING_NAMES:
                del self._listings[parent]

    def unnamed(self, parent: int, name: bytes) -> None:
        self._note_own(parent, False, name)
        names = self._listings.get(parent)
        if names is not None:
            names.discard(name)

    def _note_own(self, parent: int, made: bool, name: bytes) -> None:
        reading = self._reading.get(parent)
        if reading is not None:
            reading[1].append((made, name))

    def forget_listings(self) -> None:
        self._listings.clear()
        self._reading.clear()

    # -------------------------------------------------------------- security.* xattrs -------
    def xattr(self, ino: int, name: bytes) -> bytes | None | object:
        """The kept value of ``name`` on ``ino`` (None: it has none), or :data:`UNKNOWN`."""
        if not self.live:
            return UNKNOWN
        names = self._xattrs.get(ino)
        return UNKNOWN if names is None else names.get(name, UNKNOWN)

    def keep_xattr(self, ino: int, name: bytes, value: bytes | None, asked_at: int) -> None:
        """Keep meta's answer, unless a change (foreign, or an xattr change of our own: ``asked_at`` is
        :attr:`xattr_changes` when it was asked) was applied since the current handler asked for it."""
        if not (self.live and STARTED.get() == self.applied and asked_at == self.xattr_changes
                and name.startswith(b"security.")):
            return
        names = self._xattrs.get(ino)
        if names is None:
            names = self._xattrs[ino] = {}
            if len(self._xattrs) > XATTR_INODES:
                self._xattrs.popitem(last=False)
        self._xattrs.move_to_end(ino)
        names[name] = value

    def drop_xattrs(self, ino: int) -> None:
        """This mount changed ``ino``'s xattrs, or tried to (its own changes do not come back through the feed)."""
        self.xattr_changes += 1
        self._xattrs.pop(ino, None)

    async def follow(self, meta: Any, caller: Caller) -> None:
        """Follow the feed forever (run it in the mount's nursery)."""
        cursor = b""
        complaint = Complaint(log, "change feed")
        while True:
            page: ChangePage | None = None
            try:
                with trio.move_on_after(self.wait + self.grace):
                    page = await meta.watch(caller, cursor, self.wait)
                complaint.succeeded()
            except OSError as exc:
                complaint.failed(exc)
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
        now = time.monotonic()
        for change in page.changes:
            self.applied += 1
            for ino in change.inodes:
                self._xattrs.pop(ino, None)
                invalidate_attributes(ino)
            for parent, name in change.entries:
                self._listings.pop(parent, None)
                self._reading.pop(parent, None)
                self._foreign[parent] = now
                self._foreign.move_to_end(parent)
                self.on_foreign(parent)
                pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
            for directory in change.recalls:
                self.on_recall(directory)
        while len(self._foreign) > LISTINGS:
            self._foreign.popitem(last=False)

    def _lapse(self) -> None:
        self.live = False
        self.on_lapse()
        self.applied += 1
        self.forget_listings()
        self._xattrs.clear()
        names, self._names = self._names, OrderedDict()
        inodes, self._inodes = self._inodes, OrderedDict()
        for ino in inodes:
            invalidate_attributes(ino)
        for parent, name in names:
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)


def _ignore(_: int) -> None:
    pass


def _nothing() -> None:
    pass


def _remember(cache: OrderedDict, key: Any) -> None:
    cache[key] = None
    cache.move_to_end(key)
    if len(cache) > KNOWN_NAMES:
        cache.popitem(last=False)


def invalidate_attributes(ino: int) -> None:
    """Attributes only: dropping pages could wait on a read this daemon is serving (close-to-open keeps data)."""
    invalidate_kernel_cache(ino, attr_only=True)


def invalidate_kernel_cache(ino: int, *, attr_only: bool) -> None:
    """Drop what the kernel caches of ``ino``. With its pages (``attr_only=False``) this waits for any read or
    write-back of them, which this daemon serves: call it from a thread then."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only=attr_only)
    except OSError:  # ENOENT: the kernel does not hold it
        pass
