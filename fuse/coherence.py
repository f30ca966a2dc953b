"""Kernel caches kept coherent with other clients through meta's change feed (meta/feed.py).

While the mount follows the feed it lets the kernel keep entries, negative entries (absent names) and attributes
for ``long_timeout`` (a repeated stat, path walk or probe for a missing file then never reaches the daemon) and
turns every change another client makes into a kernel invalidation. When the feed lapses (no answer within its
wait plus ``grace``) or reports a gap, the mount cannot know what changed: it invalidates every entry and inode
it handed to the kernel and replies with the short timeouts until the feed answers again.

The mount keeps listings of directories: every name with its inode, and the attributes meta listed with them
(readdirplus pages, read after lookups there kept reaching meta; or the names alone, from a delegation's grant
or for a directory this mount created). A listing answers the lookup of a name it holds with those attributes
(:meth:`Coherence.entry`), and a complete one also the lookup of an absent name (:meth:`Coherence.absent`): a
cold stat, or the kernel's lookup before ``open(O_CREAT)`` of a new name, then needs no meta call. Dropping the
kernel's caches does not drop these. A listing stays true only while this mount's own changes update it and no
other client touches the directory: a foreign change of any of its entries, a lapse, or a failed change of our
own (its outcome may be unknown) drops it; a foreign change of an inode drops its attributes, and so does any
change of ours (:meth:`Coherence.stale`), until a lookup brings meta's again (:meth:`Coherence.keep_entry`). An
inode may be listed under one name and lose another in a directory no listing holds: :meth:`Coherence.stale_linked`.
A create that raced another client's create of the same name reaches
meta, which decides. A page read from meta counts only if no other client touched the directory while it was on
its way (any entry change the feed applies meanwhile voids it); this mount's own changes meanwhile are replayed
on top of it, and attributes dropped meanwhile are not taken from it.

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
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import pyfuse3
import trio

from kvfs.meta.types import Attr, Caller, ChangePage, DirPage
from kvfs.service import Complaint

log = logging.getLogger(__name__)

#: ``Coherence.applied`` when the current request handler started (-1: outside a handler).
STARTED: contextvars.ContextVar[int] = contextvars.ContextVar("kvfs_fuse_started", default=-1)
KNOWN_NAMES = 1 << 20  # names handed to the kernel that a lapse invalidates; older ones are forgotten
LISTINGS = 1024  # directory listings kept (least recently used go first)
LISTED_NAMES = 1 << 18  # names in all of them together (each with its attributes: ~0.5 KiB)
LISTING_NAMES = 1 << 16  # a listing is not read further (nor kept complete) beyond this many names
LISTING_QUIET = 1.0  # seconds without another client's change in a directory before its listing is read
FIRST_PAGE = 256  # entries of a listing's first readdir page; each next page is twice as large, up to LAST_PAGE
LAST_PAGE = 4096  # (one meta transaction each; a lookup or two in a huge directory reads one small page)
XATTR_INODES = 1 << 16  # inodes whose security.* xattr answers are kept (least recently used go first)
#: What :meth:`Coherence.xattr` returns when it holds no answer (None means: known to be absent).
UNKNOWN = object()


@dataclass(eq=False)
class Listing:
    """What this mount knows of a directory's names: all of them (``complete``), or the first ones in meta's order,
    up to ``cookie`` (where the next page starts), plus those this mount made since."""

    names: dict[bytes, int] = field(default_factory=dict)  # name -> its inode (0: not known here)
    complete: bool = False
    cookie: bytes = b""
    pages: int = 0  # read so far: the next one is larger


@dataclass(eq=False)
class _Read:
    """A read of a listing under way: this mount's changes of the directory since it began, in order ((True, name,
    inode): made, (False, name, 0): removed), and the inodes whose attributes were dropped meanwhile."""

    own: list[tuple[bool, bytes, int]] = field(default_factory=list)
    stale: set[int] = field(default_factory=set)
    linked_stale: bool = False  # and so were those of every inode with more than one name (:meth:`stale_linked`)


class Coherence:
    """Follows the change feed and says how long the kernel may keep each reply."""

    def __init__(self, long_timeout: float, *, wait: float = 5.0, grace: float = 2.0) -> None:
        self.long_timeout = long_timeout
        self.wait = wait
        self.grace = grace
        self.live = False
        self.applied = 0  # foreign changes applied so far
        self.changes = 0  # stale() calls so far: attributes meta gave before one are not kept (keep_entry)
        self._names: OrderedDict[tuple[int, bytes], None] = OrderedDict()
        self._inodes: OrderedDict[int, None] = OrderedDict()
        self._listings: OrderedDict[int, Listing] = OrderedDict()
        self._listed = 0  # names in them
        self._attrs: dict[int, Attr] = {}  # inode -> the attributes meta listed, while nothing changed them
        self._linked: set[int] = set()  # those of them with more than one name (not directories): see stale_linked
        self._reading: dict[int, _Read] = {}  # directory -> the read of its listing under way (it is the token)
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

    # -------------------------------------------------------------- listings --------------------
    def absent(self, parent: int, name: bytes) -> bool:
        """True when ``name`` is certainly not in ``parent`` (as far as the feed has told us)."""
        listing = self._listings.get(parent)
        return (self.live and listing is not None and listing.complete and name not in listing.names
                and name not in (b".", b".."))

    def entry(self, parent: int, name: bytes) -> Attr | None:
        """The attributes of ``name`` in ``parent`` if a listing holds them; None: ask meta."""
        listing = self._listings.get(parent) if self.live else None
        ino = None if listing is None else listing.names.get(name)
        if not ino:
            return None
        self._listings.move_to_end(parent)
        return self._attrs.get(ino)

    def attr(self, ino: int) -> Attr | None:
        """The attributes of ``ino`` if a listing holds them; None: ask meta."""
        return self._attrs.get(ino) if self.live else None

    def inode_of(self, parent: int, name: bytes) -> int:
        """The inode a listing names ``name`` in ``parent`` with (0: not known here)."""
        listing = self._listings.get(parent)
        return 0 if listing is None else listing.names.get(name, 0)

    def stale(self, *inodes: int) -> None:
        """The attributes of ``inodes`` changed, or may have: by this mount (the feed leaves its changes out), or by
        another client. A listing's page or a lookup on its way does not bring them back."""
        self.changes += 1
        for ino in inodes:
            self._drop_attr(ino)
            for read in self._reading.values():
                read.stale.add(ino)

    def stale_linked(self) -> None:
        """This mount removed or replaced a name whose inode no listing knows (its directory is not listed): that
        inode's attributes changed (nlink, ctime), and a listing of a directory with another of its names may hold
        them. Only an inode with more than one name can be listed elsewhere, so those are dropped."""
        self.stale(*self._linked)
        for read in self._reading.values():
            read.linked_stale = True

    def keep_entry(self, parent: int, name: bytes, attr: Attr, seen: int) -> None:
        """Meta answered a lookup of ``name`` in ``parent`` with ``attr``; ``seen`` was :attr:`changes` when it was
        asked. Where a listing holds that name for that inode (its attributes were dropped by a change), keep them
        again, unless a change was applied since: a file another client changed would else cost a meta call at
        every cold stat until the listing is read again."""
        listing = self._listings.get(parent)
        if (self.live and seen == self.changes and STARTED.get() == self.applied and listing is not None
                and listing.names.get(name) == attr.ino):
            self._keep_attr(attr)

    def _keep_attr(self, attr: Attr) -> None:
        self._attrs[attr.ino] = attr
        if _has_other_names(attr):
            self._linked.add(attr.ino)

    def _drop_attr(self, ino: int) -> None:
        self._attrs.pop(ino, None)
        self._linked.discard(ino)

    def listing_made(self, ino: int) -> None:
        """This mount created directory ``ino``: its (empty) listing is complete."""
        self._keep(ino, Listing(complete=True))

    def begin_listing(self, ino: int, *, force: bool = False) -> object | None:
        """Start reading (more of) ``ino``'s listing from meta: the token for :meth:`end_page` or
        :meth:`end_listing`. None if it is complete or as large as is read already, if it is being read, if the
        feed is not live, or if another client changed the directory in the last ``LISTING_QUIET`` seconds (a
        directory several clients fill would have its listing dropped again at once). ``force``: read it anyway
        unless the feed is not live (a delegation's grant carries the listing: fuse/dirops.py); it replaces the one
        held."""
        listing = self._listings.get(ino)
        changed = self._foreign.get(ino)
        if not self.live or not force and (
                ino in self._reading
                or listing is not None and (listing.complete or len(listing.names) >= LISTING_NAMES)
                or changed is not None and time.monotonic() - changed < LISTING_QUIET):
            return None
        read = self._reading[ino] = _Read()
        return read

    def next_page(self, ino: int) -> tuple[bytes, int]:
        """Where the next page of ``ino``'s listing starts, and how many entries to ask for."""
        listing = self._listings.get(ino)
        if listing is None:
            return b"", FIRST_PAGE
        return listing.cookie, min(LAST_PAGE, FIRST_PAGE << listing.pages)

    def end_page(self, ino: int, token: object, page: DirPage | None) -> Listing | None:
        """Add a page read since :meth:`begin_listing` (None: the read failed) to ``ino``'s listing, unless
        something voided it; the listing if it is kept."""
        read = self._end(ino, token)
        if read is None or page is None:
            return None
        listing = self._listings.get(ino)
        if listing is None:
            listing = self._listings[ino] = Listing()
        self._listings.move_to_end(ino)
        for entry in page.entries:
            self._name(listing, entry.name, entry.attr.ino)
            if entry.attr.ino not in read.stale and not (read.linked_stale and _has_other_names(entry.attr)):
                self._keep_attr(entry.attr)
        self._replay(listing, read)
        listing.cookie, listing.complete = page.cookie, page.eof
        listing.pages += 1
        self._trim()
        return listing if ino in self._listings else None

    def end_listing(self, ino: int, token: object, names: list[bytes] | None) -> bool:
        """Keep the complete listing ``names`` (None: the read failed) read since :meth:`begin_listing`, unless
        something voided it. The inodes a listing held already are kept for the names it keeps."""
        read = self._end(ino, token)
        if read is None or names is None or len(names) > LISTING_NAMES:
            return False
        old = self._listings.get(ino)
        known = {} if old is None else old.names
        listing = Listing({name: known.get(name, 0) for name in names}, complete=True)
        self._replay(listing, read)
        self._keep(ino, listing)
        return True

    def _end(self, ino: int, token: object) -> _Read | None:
        """The read ``token`` of ``ino``'s listing, ended; None if it was voided."""
        read = self._reading.get(ino)
        if read is None or read is not token:
            return None
        del self._reading[ino]
        return read if self.live else None

    def _replay(self, listing: Listing, read: _Read) -> None:
        """The pages may or may not show this mount's own changes made while they were read: for a name only we
        touched, our last change decides."""
        for made, name, ino in read.own:
            if made:
                self._name(listing, name, ino)
            else:
                self._unname(listing, name)

    def _name(self, listing: Listing, name: bytes, ino: int) -> None:
        replaced = listing.names.get(name)
        if replaced is None:
            self._listed += 1
        elif replaced != ino:  # a rename over it: the replaced inode lost a link (its nlink and ctime changed)
            self._drop_attr(replaced)
        listing.names[name] = ino

    def _unname(self, listing: Listing, name: bytes) -> None:
        ino = listing.names.pop(name, None)
        if ino is not None:
            self._listed -= 1
            self._drop_attr(ino)

    def _keep(self, ino: int, listing: Listing) -> None:
        old = self._listings.pop(ino, None)
        if old is not None:
            self._listed -= len(old.names)
            kept = set(listing.names.values())
            for gone in old.names.values():
                if gone not in kept:
                    self._drop_attr(gone)
        self._listings[ino] = listing
        self._listed += len(listing.names)
        self._trim()

    def _trim(self) -> None:
        while self._listed > LISTED_NAMES or len(self._listings) > LISTINGS:
            self._forget(self._listings.popitem(last=False)[1])

    def _forget(self, listing: Listing) -> None:
        self._listed -= len(listing.names)
        for ino in listing.names.values():
            self._drop_attr(ino)

    def named(self, parent: int, name: bytes, ino: int = 0) -> None:
        """A change of ours gave ``name`` in ``parent`` to inode ``ino`` (0: not known here)."""
        read = self._reading.get(parent)
        if read is not None:
            read.own.append((True, name, ino))
        listing = self._listings.get(parent)
        if listing is not None:
            self._name(listing, name, ino)
            self._listings.move_to_end(parent)
            self._trim()

    def unnamed(self, parent: int, name: bytes) -> None:
        """A change of ours removed ``name`` from ``parent``."""
        read = self._reading.get(parent)
        if read is not None:
            read.own.append((False, name, 0))
        listing = self._listings.get(parent)
        if listing is not None:
            self._unname(listing, name)

    def drop_listing(self, ino: int) -> None:
        """What this mount knows of ``ino``'s names is not exact any more (a read of it under way is voided)."""
        listing = self._listings.pop(ino, None)
        if listing is not None:
            self._forget(listing)
        self._reading.pop(ino, None)

    def forget_listings(self) -> None:
        self._listings.clear()
        self._listed = 0
        self._attrs.clear()
        self._linked.clear()
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
                self.stale(ino)
                invalidate_attributes(ino)
            for parent, name in change.entries:
                self.drop_listing(parent)
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


def _has_other_names(attr: Attr) -> bool:
    """Whether a name elsewhere may lead to this inode: a file with more than one link (a directory's nlink
    counts its subdirectories)."""
    return attr.nlink > 1 and not stat.S_ISDIR(attr.mode)


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
