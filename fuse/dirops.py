"""Creates and removals the mount answers itself, in directories meta delegated to it (meta/delegation.py).

A program that makes files one after another waits a metadata round trip per file; in a directory this mount
holds, it does not. The mount asks for a directory's delegation after a few synchronous creates there
(:meth:`DirOps.want`), then answers ``create`` of a free name and ``unlink`` of a file it made under the grant
from what it knows: the grant's complete listing (kept, and kept current by the mount's own changes, as any
complete listing is: fuse/coherence.py), the directory's attributes, and inode ids meta handed to it. After a few
synchronous removals of files it did not make it asks for a grant for removals instead, which carries each name's
inode and type and keeps other clients' removals out too (meta/delegation.py, rule 5), and then answers the
unlink of any non-directory there (``rm`` of another client's files). The changes queue in order and one task sends them in batches
(``kvfs.meta.apply_delegated``), so a burst of creates costs meta one transaction per batch.

Ordering and visibility:

* Every other metadata call of this mount waits until the changes it answered earlier are applied
  (:meth:`DirOps.settled`, :class:`Ordered`): its own view of the namespace is in program order.
* Another client that looks into a held directory makes meta publish a recall; :meth:`DirOps.recall` sends what is
  queued and gives the directory back, and the other client's retried call sees it all.
* The mount stops answering locally well before a grant could lapse (``USE_FRACTION`` of the lease, counted from
  when the call that granted or renewed it was sent), when the feed lapses (a recall could not reach it), and
  after a change of ours there whose outcome is unknown.
* Durability: a change answered here is durable once it is applied, within milliseconds, or when a later call of
  this mount (``fsync``, ``fsyncdir``, any metadata call) returns, as with a local filesystem's un-fsynced
  directory changes. A mount cut off from meta for longer than its grant loses what it had not sent and says so
  in its log, naming each change (meta refuses a lapsed grant's batch: meta/delegation.py, rule 3).
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pyfuse3
import trio

from kvfs.errors import ConnectionLost, RpcTimeout, ServiceUnavailable
from kvfs.meta.posix import NAME_MAX, W_OK, X_OK, check_access, child_attr, sticky_allows
from kvfs.meta.types import ID_BLOCK
from kvfs.meta.types import Attr, Caller, CreateOp, Delegated, DirEntry, DirOp, Layout, Opened, UnlinkOp

from .coherence import Coherence, invalidate_attributes

log = logging.getLogger(__name__)

WANT_AFTER = 2  # synchronous creates (or removals) in a directory before its delegation is asked for
USE_FRACTION = 0.6  # of a grant's lease, from the sending of the call that granted or renewed it
REFILL_AT = ID_BLOCK // 4  # free inode ids left when another block is asked for
BATCH = 512  # changes per apply_delegated call
LINGER = 0.02  # seconds the first change of a batch waits for company, unless a call waits for it
SEND_FOR = 60.0  # seconds a batch is sent again while meta cannot be reached (meta restarts)
BACKOFF = (2.0, 60.0)  # seconds before a recalled or refused directory is asked for again: first, most
COUNTED = 4096  # directories whose synchronous changes are counted (all are forgotten when more come)


@dataclass(eq=False)
class _Held:
    """A directory this mount holds under grant ``epoch``."""

    ino: int
    epoch: int
    lease: float
    deadline: float  # trio time after which nothing is answered here any more
    own: dict[bytes, tuple[int, int]]  # name -> (inode, owner uid) of files made under this grant
    attr: Attr | None  # the directory's attributes after our changes; None while unknown
    layout: Layout  # what its new files get
    # a grant for removals: name -> entry of the names it carried that no change of ours touched since
    others: dict[bytes, DirEntry] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)  # free inode ids, used from the end
    refilling: bool = False
    dropped: bool = False  # given back or lost: queued changes still go out, nothing new is answered


@dataclass(eq=False)
class _Asking:
    """A delegation this mount asked for and has no answer to yet."""

    token: Any  # the listing read's (Coherence.begin_listing): the grant's names become that listing
    removes: bool  # a grant for removals
    wanted: bool = True  # False once something made it useless (a recall, a lapse, an unknown outcome)
    touched: set[bytes] = field(default_factory=set)  # names our changes there touched meanwhile


class DirOps:
    """The mount's delegated directories and the queue of changes answered in them."""

    def __init__(self, meta: Any, coherence: Coherence, client_id: bytes) -> None:
        self.meta = meta
        self.coherence = coherence
        self.client_id = client_id
        self.nursery: trio.Nursery | None = None
        self._me = Caller(os.getuid(), os.getgid(), client=client_id)
        self._held: dict[int, _Held] = {}
        self._asking: dict[int, _Asking] = {}
        self._counts: dict[int, int] = {}
        self._backoff: dict[int, tuple[float, float]] = {}  # directory -> (not before, next backoff)
        self._queue: collections.deque[tuple[_Held, DirOp]] = collections.deque()
        self._unsent: dict[tuple[int, int], CreateOp] = {}  # (inode, session) -> its queued create
        self._queued = 0  # changes ever queued
        self._taken = 0  # of those, taken into a batch (in queue order)
        self._done = 0  # of those, applied or given up (in queue order)
        self._progress = trio.Event()
        self._wake = trio.Event()  # something is queued
        self._urgent = trio.Event()  # someone waits for the queue, or a batch is full: no lingering

    # ------------------------------------------------------------------ answering ----------
    def _usable(self, parent: int) -> _Held | None:
        held = self._held.get(parent)
        if held is None:
            return None
        if not self.coherence.live or trio.current_time() >= held.deadline:
            self._drop(held, "lapsed here" if self.coherence.live else "the change feed lapsed")
            return None
        return held

    def creatable(self, parent: int, name: bytes, caller: Caller) -> _Held | None:
        """The held directory if a create of ``name`` there by ``caller`` can be answered here: a name the
        directory's listing (the grant's, kept by fuse/coherence.py) does not have."""
        held = self._usable(parent)
        if (held is None or held.attr is None or not held.ids or len(name) > NAME_MAX
                or not self.coherence.absent(parent, name) or not check_access(caller, held.attr, W_OK | X_OK)):
            return None
        return held

    def create(self, held: _Held, caller: Caller, name: bytes, mode: int, flags: int) -> Opened:
        """Answer a create (after :meth:`creatable`); meta gets it with the next batch."""
        assert held.attr is not None
        ino = held.ids.pop()
        now = time.time_ns()
        attr, layout = child_attr(caller, held.attr, held.layout, stat.S_IFREG | (mode & 0o7777), ino, now)
        assert layout is not None
        session = secrets.randbits(63) if flags & os.O_ACCMODE != os.O_RDONLY else None
        self.coherence.named(held.ino, name, ino)
        held.own[name] = (ino, attr.uid)
        op = CreateOp(caller, name, ino, mode & 0o7777, flags, now, layout, session)
        if session is not None:
            self._unsent[(ino, session)] = op
        self._enqueue(held, op)
        if len(held.ids) < REFILL_AT and not held.refilling:
            held.refilling = True
            self._start(self._refill, held)
        return Opened(attr, session, layout, self._touched(held, now))

    def removable(self, parent: int, name: bytes, caller: Caller) -> _Held | None:
        """The held directory if an unlink of ``name`` there by ``caller`` can be answered here: a file this mount
        made under the grant (nobody else can know its inode), or under a grant for removals any non-directory
        the grant named (nobody else can remove it), which the caller may remove. Where the sticky bit asks for
        the owner of a file we did not make, meta answers."""
        held = self._usable(parent)
        if held is None or held.attr is None or not check_access(caller, held.attr, W_OK | X_OK):
            return None
        own = held.own.get(name)
        if own is not None:
            return held if sticky_allows(caller, held.attr, own[1]) else None
        entry = held.others.get(name)
        if entry is None or stat.S_ISDIR(entry.type) or not sticky_allows(caller, held.attr, -1):
            return None
        return held

    def unlink(self, held: _Held, caller: Caller, name: bytes) -> Attr:
        """Answer an unlink (after :meth:`removable`); returns the directory's new attributes."""
        own = held.own.pop(name, None)
        ino = own[0] if own is not None else held.others.pop(name).ino
        self.coherence.unnamed(held.ino, name)
        now = time.time_ns()
        self._enqueue(held, UnlinkOp(caller, name, ino, now))
        return self._touched(held, now)

    def end_session(self, ino: int, session: int) -> bool:
        """End the write session of a file whose create is still queued: it then goes without one (True), and needs
        no ``close_sessions``. Nothing was written to it yet: writes report their end to meta, which waits for the
        queue."""
        op = self._unsent.pop((ino, session), None)
        if op is None:
            return False
        op.session = None
        return True

    @staticmethod
    def _touched(held: _Held, now: int) -> Attr:
        assert held.attr is not None
        held.attr.mtime_ns = held.attr.ctime_ns = max(now, held.attr.mtime_ns)
        return msgspec.structs.replace(held.attr)

    # ------------------------------------------------------------------ our other changes --
    def named(self, parent: int, name: bytes) -> None:
        """A synchronous change of this mount gave ``name`` in ``parent`` to some inode."""
        self._note(parent, True, name)

    def unnamed(self, parent: int, name: bytes) -> None:
        """A synchronous change of this mount removed ``name`` from ``parent``."""
        self._note(parent, False, name)

    def _note(self, parent: int, made: bool, name: bytes) -> None:
        """(The listing follows it in fuse/coherence.py.)"""
        held = self._held.get(parent)
        if held is not None:
            held.own.pop(name, None)
            held.others.pop(name, None)
            held.attr = None  # meta's answer says what it is now: see dir_attr
        asking = self._asking.get(parent)
        if asking is not None:
            asking.touched.add(name)

    def dir_attr(self, ino: int, attr: Attr) -> None:
        """Meta's attributes of directory ``ino`` (after all our changes so far: calls wait for the queue)."""
        held = self._held.get(ino)
        if held is not None:
            mtime = held.attr.mtime_ns if held.attr is not None else 0
            held.attr = msgspec.structs.replace(attr, mtime_ns=max(attr.mtime_ns, mtime))

    def forget_inode(self, ino: int) -> None:
        """A file made under a grant got another name or owner: its removals go to meta from now on."""
        for held in self._held.values():
            for name in [n for n, (i, _) in held.own.items() if i == ino]:
                del held.own[name]

    def forgotten(self, ino: int) -> None:
        """The kernel forgot inode ``ino`` (a removed directory, say): nothing will be made in it here soon."""
        held = self._held.get(ino)
        if held is not None:
            self._drop(held, "the kernel forgot it")

    def unsure(self, parent: int) -> None:
        """A change of ours in ``parent`` may or may not have happened: what we know of it is not exact any more."""
        held = self._held.get(parent)
        if held is not None:
            self._drop(held, "a change of ours there has an unknown outcome")
        self._void_ask(parent)

    def _void_ask(self, parent: int) -> None:
        asking = self._asking.get(parent)
        if asking is not None:
            asking.wanted = False

    def want(self, parent: int, caller: Caller, *, removes: bool = False) -> None:
        """This mount made (or, ``removes``, removed) a name in ``parent`` synchronously; after a few, ask for its
        delegation. The one asked for after a removal is a grant for removals: an ordinary grant lets the mount
        answer only removals of files it made under it, and leaves other clients' removals free of recalls (rule
        5), so a mount that only removes names would gain nothing from one."""
        if (self.nursery is None or parent in self._held or parent in self._asking or not self.coherence.live
                or self._backoff.get(parent, (0.0, 0.0))[0] > trio.current_time()):
            return
        if len(self._counts) >= COUNTED and parent not in self._counts:
            self._counts.clear()
        count = self._counts[parent] = self._counts.get(parent, 0) + 1
        if count >= WANT_AFTER:
            del self._counts[parent]
            token = self.coherence.begin_listing(parent, force=True)  # the grant's names become its listing
            if token is not None:
                self._asking[parent] = _Asking(token, removes)
                self._start(self._ask, parent, caller)

    # ------------------------------------------------------------------ grants ----------
    def _start(self, fn: Any, *args: Any) -> None:
        assert self.nursery is not None
        self.nursery.start_soon(fn, *args)

    async def _ask(self, parent: int, caller: Caller) -> None:
        grant: Delegated | None = None
        try:
            await self.settled()  # changes queued under an earlier grant of it go first
            sent = trio.current_time()
            grant = await self.meta.delegate(caller, parent, removes=self._asking[parent].removes)
        except Exception as exc:  # noqa: BLE001 - only an optimisation failed: changes there stay synchronous
            log.debug("asking for the delegation of directory %d: %r", parent, exc)
        asking = self._asking.pop(parent)
        granted = grant is not None and grant.granted
        # The listing counts only if nothing voided it (another client's change, a lapse: fuse/coherence.py); our
        # own changes made while we asked are replayed on top of the grant's names there.
        kept = self.coherence.end_listing(parent, asking.token, grant.names if granted and asking.wanted else None)
        if not kept:
            self._back_off(parent)
            if granted:
                self._start(self._give_back, [parent])
            return
        assert grant is not None and grant.names is not None and grant.layout is not None
        ids = list(range(grant.ids + ID_BLOCK - 1, grant.ids - 1, -1))
        touched = asking.touched
        others = {name: entry for name, entry in zip(grant.names, grant.entries or ()) if name not in touched}
        self._held[parent] = _Held(parent, grant.epoch, grant.lease, sent + grant.lease * USE_FRACTION, {},
                                   None if touched else grant.attr, grant.layout, others, ids)
        log.debug("directory %d is delegated to this mount (%d names%s)", parent, len(grant.names),
                  ", for removals" if grant.entries is not None else "")

    async def _refill(self, held: _Held) -> None:
        try:
            sent = trio.current_time()
            grant = await self.meta.delegate(self._me, held.ino, held.epoch)
            if grant.granted:
                held.ids[:0] = range(grant.ids + ID_BLOCK - 1, grant.ids - 1, -1)
                held.deadline = max(held.deadline, sent + held.lease * USE_FRACTION)
            else:
                self._drop(held, "its renewal was refused")
        except Exception as exc:  # noqa: BLE001 - creates go synchronous once the ids run out
            log.warning("renewing the delegation of directory %d: %r", held.ino, exc)
        finally:
            held.refilling = False

    def _back_off(self, parent: int) -> None:
        now = trio.current_time()
        until, step = self._backoff.get(parent, (0.0, BACKOFF[0]))
        if now > until + BACKOFF[1]:  # quiet for long: start over
            step = BACKOFF[0]
        self._backoff[parent] = (now + step, min(step * 2, BACKOFF[1]))
        if len(self._backoff) > COUNTED:
            self._backoff = {d: v for d, v in self._backoff.items() if v[0] > now}

    def _drop(self, held: _Held, why: str) -> None:
        """Stop answering in ``held`` and give it back once what is queued there is sent."""
        if self._held.get(held.ino) is held:
            del self._held[held.ino]
            log.debug("directory %d: delegation dropped (%s)", held.ino, why)
            self._back_off(held.ino)
            if self.nursery is not None:
                self._start(self._give_back, [held.ino])
        held.dropped = True

    async def _give_back(self, directories: list[int]) -> None:
        await self.settled()
        try:
            await self.meta.undelegate(self._me, directories)
        except Exception as exc:  # noqa: BLE001 - the grants lapse by themselves
            log.warning("giving back directories %s: %r", directories, exc)

    def recall(self, directory: int) -> None:
        """Another client waits for ``directory`` (a recall in the change feed)."""
        self._void_ask(directory)
        held = self._held.get(directory)
        if held is not None:
            self._drop(held, "recalled")

    def lapse(self) -> None:
        """The change feed lapsed: recalls cannot reach us, so stop answering anywhere."""
        for held in list(self._held.values()):
            self._drop(held, "the change feed lapsed")
        for directory in self._asking:
            self._void_ask(directory)

    async def close(self) -> None:
        """Send everything queued and give every directory back (an orderly unmount)."""
        held = list(self._held)
        for h in list(self._held.values()):
            h.dropped = True
        self._held.clear()
        await self.settled()
        if held:
            await self._give_back(held)

    # ------------------------------------------------------------------ the queue ----------
    def _enqueue(self, held: _Held, op: DirOp) -> None:
        self._queue.append((held, op))
        self._queued += 1
        self._wake.set()
        if len(self._queue) >= BATCH:
            self._urgent.set()

    def position(self) -> int:
        """How many changes were queued so far: :meth:`settled` waits for as many."""
        return self._queued

    async def settled(self, upto: int | None = None) -> None:
        """Wait until every change queued so far (the first ``upto``) is applied or given up; those not yet on their
        way go without lingering."""
        target = self._queued if upto is None else upto
        while self._done < target:
            if self._taken < target:
                self._urgent.set()
            await self._progress.wait()

    async def run(self) -> None:
        """Send queued changes in order, a batch per directory at a time, forever (run it in the mount's nursery)."""
        while True:
            if not self._queue:
                self._wake = trio.Event()
                await self._wake.wait()
            with trio.move_on_after(LINGER):  # one call for a burst of changes, not one each
                await self._urgent.wait()
            self._urgent = trio.Event()
            held = self._queue[0][0]
            batch = []
            while self._queue and self._queue[0][0] is held and len(batch) < BATCH:
                op = self._queue.popleft()[1]
                if isinstance(op, CreateOp) and op.session is not None:
                    del self._unsent[(op.ino, op.session)]
                batch.append(op)
            self._taken += len(batch)
            try:
                await self._send(held, batch)
            finally:
                self._done += len(batch)
                self._progress.set()
                self._progress = trio.Event()

    async def _send(self, held: _Held, batch: list[DirOp]) -> None:
        sent = trio.current_time()
        try:
            while True:  # meta applies a batch sent again once (MetaStore.apply_delegated)
                try:
                    results = await self.meta.apply_delegated(self._me, held.ino, held.epoch, batch)
                    break
                except (ServiceUnavailable, ConnectionLost, RpcTimeout):
                    if trio.current_time() - sent > SEND_FOR:  # a restart of meta takes seconds, not this long
                        raise
                    await trio.sleep(0.5)
        except Exception as exc:  # noqa: BLE001 - lost: every change of the batch is reported below
            results = [getattr(exc, "errno", None) or -1] * len(batch)
            log.error("directory %d: %d changes this mount had answered could not be applied: %r",
                      held.ino, len(batch), exc)
            self._drop(held, "its changes could not be applied")
        else:
            held.deadline = max(held.deadline, sent + held.lease * USE_FRACTION)
        for op, code in zip(batch, results):
            if code:
                self._lost(held, op, code)

    def _lost(self, held: _Held, op: DirOp, code: int) -> None:
        """A change we answered did not happen: say so, and make the kernel ask meta again."""
        what = "create" if isinstance(op, CreateOp) else "unlink"
        log.error("lost %s of %r in directory %d (inode %d): %s", what, op.name, held.ino, op.ino,
                  os.strerror(code) if code > 0 else "not applied")
        pyfuse3.invalidate_entry_async(held.ino, op.name, ignore_enoent=True)
        invalidate_attributes(held.ino)
        self.coherence.drop_listing(held.ino)  # it showed the change
        self.coherence.stale(held.ino, op.ino)
        if not held.dropped:
            self._drop(held, "a change of ours there failed")


class Ordered:
    """``meta`` for the mount's handlers: each call first waits for the changes answered before it
    (:meth:`DirOps.settled`), so the mount's own view is in program order."""

    def __init__(self, meta: Any, dirops: DirOps) -> None:
        self.unordered = meta  # for a call that knows which changes it must wait for (DirOps.settled)
        self._dirops = dirops
        self._calls: dict[str, Any] = {}
        self.client_id = getattr(meta, "client_id", b"")

    def __getattr__(self, name: str) -> Any:
        call = self._calls.get(name)
        if call is None:
            fn = getattr(self.unordered, name)
            settled = self._dirops.settled

            async def call(*args: Any, **kwargs: Any) -> Any:
                await settled()
                return await fn(*args, **kwargs)

            self._calls[name] = call
        return call
