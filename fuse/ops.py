"""pyfuse3 low-level operations over two injected collaborators.

* ``meta``: any object with the async methods of :class:`kvfs.meta.store.MetaStore` (``kvfs.meta.client.RemoteMeta``
  over RPC, ``kvfs.meta.client.LocalMeta`` in process). Every call passes the requester's :class:`Caller`
  (uid, gid, supplementary gids, pid) so meta enforces POSIX permissions; the mount does not use the
  kernel's ``default_permissions``.
* ``storage``: a :class:`kvfs.storage.FileStorage` (read/write/truncate by inode + layout + offset).

Inodes map one to one to meta's inode ids (the root is inode 1 in both). Errors: a
:class:`~kvfs.errors.KvfsError` (any ``OSError``) becomes ``FUSEError(errno)``; anything else is logged and
becomes EIO. See ``fuse/README.md`` for caching, buffering and consistency.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from kvfs.aio import one_error
from kvfs.errors import ConnectionLost, RpcTimeout, ServiceUnavailable
from kvfs.pool import RECEIVED
from kvfs.meta.posix import LAYOUT_XATTR, NAME_MAX
from kvfs.meta.types import Attr, Caller, Layout, Opened

from .cache import BLOCK as CACHE_BLOCK
from .cache import BlockCache
from .coherence import STARTED, UNKNOWN, Coherence, invalidate_attributes, invalidate_kernel_cache
from .dirops import DirOps, Ordered
from .local import LocalReads
from .writes import FLUSH_DEPTH, DirtyRuns, Handle, InodeState, WriteBack, parallel, per_chunk

log = logging.getLogger(__name__)

MIB = 1 << 20


#: (parent, name) argument positions of the entries each namespace operation changes.
_ENTRY_ARGS = {"create": ((0, 1),), "mknod": ((0, 1),), "mkdir": ((0, 1),), "symlink": ((0, 1),),
               "unlink": ((0, 1),), "rmdir": ((0, 1),), "link": ((1, 2),), "rename": ((0, 1), (2, 3))}
#: Argument position of the inode whose attributes an operation changes (besides those its entries name).
_INODE_ARG = {"setattr": 0, "setxattr": 0, "removexattr": 0, "link": 0}
#: Operations that may take a name from an inode with other names (its nlink and ctime change).
_REMOVES_NAMES = frozenset({"unlink", "rename"})


def _changes_directories(fn):
    """Marks an operation that may change directories' attributes: directory attributes kept from earlier changes
    of this mount (``KvfsOperations._fresh_dir``) are forgotten before it runs, and the attributes listings keep
    of the inodes it touches (the directories, the inodes their names lead to) after it, whatever its outcome (the
    feed leaves this mount's own changes out: fuse/coherence.py). If it fails, its outcome may be unknown (meta
    unreachable), so complete listings are forgotten too; when it is unknown, so are the kernel's entries for the
    names it touched: nothing else would correct them before the long timeout. (Meta's own refusals, EEXIST and
    the like, changed nothing.) A name removed in a directory no listing holds leads to an inode the mount does
    not know, which a listing elsewhere may hold under another name: ``Coherence.stale_linked``."""
    entry_args = _ENTRY_ARGS.get(fn.__name__, ())
    inode_arg = _INODE_ARG.get(fn.__name__)
    removes_names = fn.__name__ in _REMOVES_NAMES

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        self._fresh_dirs.clear()
        touched = [] if inode_arg is None else [args[inode_arg]]
        unknown = False  # a name it removes leads to an inode no listing names
        if self.coherence is not None:
            for parent, name in entry_args:
                ino = self.coherence.inode_of(args[parent], args[name])
                touched += (args[parent], ino)
                unknown = unknown or removes_names and not ino
        try:
            return await fn(self, *args, **kwargs)
        except BaseException as exc:
            if self.coherence is not None:
                self.coherence.forget_listings()
                if _outcome_unknown(exc):
                    for parent, name in entry_args:
                        pyfuse3.invalidate_entry_async(args[parent], args[name], ignore_enoent=True)
                        if self.dirops is not None:
                            self.dirops.unsure(args[parent])
            raise
        finally:
            if self.coherence is not None:
                self.coherence.stale(*touched)
                if unknown:
                    self.coherence.stale_linked()

    return wrapper


def _outcome_unknown(exc: BaseException) -> bool:
    """False for a refusal (meta's answer, or the mount's own check); True when the call may have run: lost,
    timed out, cancelled, or a bug."""
    if isinstance(exc, pyfuse3.FUSEError):
        return False
    if isinstance(exc, (RpcTimeout, ConnectionLost, ServiceUnavailable)) or not isinstance(exc, OSError):
        return True
    return exc.errno in (None, errno.EIO)


def _fuse_errors(fn):
    """Translate exceptions from meta/storage into FUSEError; never let one escape into pyfuse3."""

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        if self.coherence is not None:
            STARTED.set(self.coherence.applied)  # each request runs in a task of its own
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:  # KvfsError is an OSError carrying the errno a kernel would give
            code = e.errno or errno.EIO
            if code == errno.EIO:
                log.warning("%s%r failed: %s", fn.__name__, args[:2], e)
            raise pyfuse3.FUSEError(code) from None
        except Exception:
            log.exception("%s%r crashed", fn.__name__, args[:2])
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


@dataclass(eq=False)
class _DirHandle:
    ino: int
    caller: Caller
    base: int = 0  # readdir offset of entries[0]
    entries: list = field(default_factory=list)  # (name, Attr)
    cookie: bytes = b""
    eof: bool = False
    dots: bool = False


class KvfsOperations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        meta: Any,
        storage: Any,
        *,
        entry_timeout: float = 1.0,
        attr_timeout: float = 1.0,
        negative_timeout: float = 1.0,
        write_buffer: int = 16 * MIB,
        flush_depth: int = FLUSH_DEPTH,
        read_parallel: int = 8,
        write_parallel: int = 32,
        readdir_page: int = 512,
        keep_cache: bool = False,
        groups_ttl: float = 1.0,
        read_cache: int = 256 * MIB,
        coherent_timeout: float = 60.0,
        delegations: bool = True,
        short_circuit: bool = False,
    ) -> None:
        """``entry_timeout``/``attr_timeout`` are what the kernel gets while the change feed is not followed;
        while it is, ``coherent_timeout`` (0: never follow it). See fuse/coherence.py. ``delegations``: answer
        creates and removals in directories meta delegates to this mount itself (fuse/dirops.py; needs the
        feed and a client id). ``short_circuit``: small reads of chunks with a replica on this host come from its
        file (fuse/local.py; needs the real storage client)."""
        super().__init__()
        self.meta = meta
        self.storage = storage
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.negative_timeout = negative_timeout
        self.read_limit = trio.CapacityLimiter(read_parallel)
        self.readdir_page = readdir_page
        self.keep_cache = keep_cache
        self.groups_ttl = groups_ttl
        self.cache = BlockCache(read_cache) if read_cache else None
        self.local = LocalReads(storage) if short_circuit else None
        self.coherence = Coherence(coherent_timeout) if coherent_timeout > 0 and hasattr(meta, "watch") else None
        self.client_id: bytes = getattr(meta, "client_id", b"")  # whose lease keeps this mount's sessions
        self.dirops: DirOps | None = None
        if delegations and self.coherence is not None and self.client_id:
            self.dirops = DirOps(meta, self.coherence, self.client_id)
            self.meta = Ordered(meta, self.dirops)
            self.coherence.on_recall = self.dirops.recall
            self.coherence.on_lapse = self.dirops.lapse
            self.coherence.on_foreign = self.dirops.unsure
        self.writes = WriteBack(self.meta, storage, write_buffer=write_buffer, flush_depth=flush_depth,
                                write_parallel=write_parallel, changed=self._changed, wrote=self._wrote,
                                reported=self._attributes_changed_here)
        self._groups: OrderedDict[tuple[int, int], tuple[float, tuple[int, ...]]] = OrderedDict()
        self._layouts: OrderedDict[int, Layout] = OrderedDict()
        self._inodes: dict[int, InodeState] = {}
        self._handles: dict[int, Handle] = {}
        self._dirs: dict[int, _DirHandle] = {}
        self._next_fh = 1
        self.initialized = trio.Event()
        self.nursery: trio.Nursery | None = None  # for background work (listings, session ends); run_mount sets it
        self._closing = 0  # sessions (write sessions, holds) being ended in the background (queued or on their way)
        self._to_close: list[tuple[int, int, None]] = []  # (ino, session, no exact length) not yet sent
        # directory inode -> (attributes a create of ours just returned, expiry): see getattr
        self._fresh_dirs: dict[int, tuple[Attr, float]] = {}
        # directory -> [absent names meta reported since its listing was last read, how many make it read again]
        self._misses: dict[int, list[int]] = {}
        self._listing_readers: set[int] = set()  # directories whose listing a task reads (_read_listing)
        self._closed = trio.Event()
        self._close_after = 0  # delegated changes to wait for before the queued session ends go (see _end_sessions)

    def init(self) -> None:
        """Called (synchronously, in the trio thread) when the kernel's INIT arrives."""
        self.initialized.set()

    # ------------------------------------------------------------------ identity ----------
    def _caller(self, ctx: pyfuse3.RequestContext) -> Caller:
        """The requester's credentials; supplementary groups from /proc/<pid>/status, cached briefly."""
        key = (ctx.pid, ctx.uid)
        now = time.monotonic()
        hit = self._groups.get(key)
        if hit is not None and hit[0] > now:
            gids = hit[1]
        else:
            try:
                gids = tuple(sorted(pyfuse3.get_sup_groups(ctx.pid)))
            except (OSError, RuntimeError, ValueError):
                gids = ()  # the process is gone, or a kernel thread: only its primary group counts
            self._groups[key] = (now + self.groups_ttl, gids)
            self._groups.move_to_end(key)
            while len(self._groups) > 4096:
                self._groups.popitem(last=False)
        return Caller(ctx.uid, ctx.gid, gids, ctx.pid, self.client_id)

    # ------------------------------------------------------------------ attributes --------
    def _entry(self, attr: Attr, parent: int | None = None, name: bytes | None = None) -> pyfuse3.EntryAttributes:
        """The kernel's copy of ``attr``, as the entry ``name`` in ``parent`` when those are given."""
        e = pyfuse3.EntryAttributes()
        e.st_ino = attr.ino
        e.generation = attr.generation
        e.st_mode = attr.mode
        e.st_nlink = attr.nlink
        e.st_uid = attr.uid
        e.st_gid = attr.gid
        e.st_rdev = attr.rdev
        size = attr.size
        st = self._inodes.get(attr.ino)
        if st is not None and stat.S_ISREG(attr.mode):
            # Buffered or unreported local writes make the local length the better one; otherwise
            # meta's length wins (another client may have changed it).
            if st.dirty():
                size = max(size, st.size)
            else:
                st.size = size
        e.st_size = size
        e.st_blksize = attr.blksize or MIB
        e.st_blocks = (size + 511) // 512 if size != attr.size else attr.blocks
        e.st_atime_ns = attr.atime_ns
        e.st_mtime_ns = attr.mtime_ns
        e.st_ctime_ns = attr.ctime_ns
        if self.coherence is None:
            e.entry_timeout, e.attr_timeout = self.entry_timeout, self.attr_timeout
        else:
            e.entry_timeout = self.coherence.timeout(self.entry_timeout)
            e.attr_timeout = self.coherence.timeout(self.attr_timeout)
            self.coherence.handed(attr.ino, parent, name)
        return e

    async def _layout(self, caller: Caller, ino: int) -> Layout:
        layout = self._layouts.get(ino)
        if layout is None:
            layout = await self.meta.get_layout(caller, ino)
            self._layouts[ino] = layout
            while len(self._layouts) > 65536:
                self._layouts.popitem(last=False)
        return layout

    # ------------------------------------------------------------------ namespace ---------
    @_fuse_errors
    async def lookup(self, parent_inode, name, ctx):
        if len(name) > NAME_MAX:  # a kernel may pass names up to FUSE_NAME_MAX (1024 bytes) on: none can exist
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        if self.coherence is not None:
            if self.coherence.absent(parent_inode, name):
                return self._negative(parent_inode, name)
            attr = self.coherence.entry(parent_inode, name)
            if attr is not None:
                return self._entry(attr, parent_inode, name)
        caller = self._caller(ctx)
        seen = 0 if self.coherence is None else self.coherence.changes
        try:
            attr = await self.meta.lookup(caller, parent_inode, name)
        except OSError as e:
            if e.errno == errno.ENOENT:
                self._missed(caller, parent_inode)
                return self._negative(parent_inode, name)
            raise
        self._missed(caller, parent_inode)
        if self.coherence is not None:
            self.coherence.keep_entry(parent_inode, name, attr, seen)
        return self._entry(attr, parent_inode, name)

    def _missed(self, caller: Caller, parent: int) -> None:
        """A lookup in ``parent`` had to ask meta. Every ``_LIST_AFTER_MISSES`` such lookups (a cold stat of
        every file; a program making new files, which looks each name up first) the mount reads a page more of
        the directory's listing with the entries' attributes, so later lookups there, of present and (once it is
        complete) of absent names, are answered without a round trip (fuse/coherence.py). Pages double in size
        from a small first one, so a lookup or two in a huge directory reads little of it."""
        if self.coherence is None or self.nursery is None:
            return
        counts = self._misses.get(parent)
        if counts is None:
            if len(self._misses) >= _MISSES_KEPT:
                self._misses.clear()
            counts = self._misses[parent] = [0, _LIST_AFTER_MISSES]
        counts[0] += 1
        if counts[0] >= counts[1] and parent not in self._listing_readers:
            self._listing_readers.add(parent)
            self.nursery.start_soon(self._read_listing, caller, parent, counts)

    async def _read_listing(self, caller: Caller, ino: int, counts: list[int]) -> None:
        """Read pages of ``ino``'s listing for :meth:`_missed` while lookups there keep asking meta. A failed read
        doubles the misses the next one waits for (a directory the caller may not read, say)."""
        assert self.coherence is not None
        try:
            while counts[0] >= counts[1] and (token := self.coherence.begin_listing(ino)) is not None:
                counts[0] = 0
                cookie, limit = self.coherence.next_page(ino)
                page = None
                try:
                    page = await self.meta.readdir(caller, ino, cookie, limit)
                except Exception as exc:  # noqa: BLE001 - only an optimisation failed; lookups keep asking meta
                    log.debug("reading the listing of directory %d: %r", ino, exc)
                    counts[1] = min(2 * counts[1], _LIST_AFTER_MISSES << 10)
                finally:  # also when cancelled (unmount): a page not read is not kept
                    listing = self.coherence.end_page(ino, token, page)
                if page is not None:
                    counts[1] = _LIST_AFTER_MISSES
                if listing is None:
                    break
                if listing.complete:
                    log.debug("directory %d: %d names listed, absent names are answered here", ino,
                              len(listing.names))
        finally:
            self._listing_readers.discard(ino)

    def _negative(self, parent: int, name: bytes) -> pyfuse3.EntryAttributes:
        """A negative entry: the kernel remembers the name is absent (for long while the feed, which invalidates
        it when another client makes the name, is followed)."""
        if self.negative_timeout <= 0:
            raise pyfuse3.FUSEError(errno.ENOENT)
        neg = pyfuse3.EntryAttributes()
        neg.st_ino = 0
        if self.coherence is None:
            neg.entry_timeout = self.negative_timeout
        else:
            neg.entry_timeout = self.coherence.timeout(self.negative_timeout)
            self.coherence.handed_absent(parent, name)
        return neg

    def _named(self, parent: int, name: bytes, attr: Attr) -> pyfuse3.EntryAttributes:
        """The reply to a change of ours that gave ``name`` in ``parent`` to ``attr``'s inode."""
        if self.coherence is not None:
            self.coherence.named(parent, name, attr.ino)
        if self.dirops is not None:
            self.dirops.named(parent, name)
        return self._entry(attr, parent, name)

    def _unnamed(self, parent: int, name: bytes) -> None:
        """A change of ours removed ``name`` from ``parent``."""
        if self.coherence is not None:
            self.coherence.unnamed(parent, name)
        if self.dirops is not None:
            self.dirops.unnamed(parent, name)

    @_fuse_errors
    async def getattr(self, inode, ctx):
        fresh = self._fresh_dirs.pop(inode, None)
        if fresh is not None and fresh[1] > trio.current_time():
            return self._entry(fresh[0])
        attr = self.coherence.attr(inode) if self.coherence is not None else None
        if attr is None:
            attr = await self.meta.getattr(self._caller(ctx), inode)
        if self.dirops is not None and stat.S_ISDIR(attr.mode):
            self.dirops.dir_attr(inode, attr)
        return self._entry(attr)

    @_fuse_errors
    @_changes_directories
    async def setattr(self, inode, attr, fields, fh, ctx):
        caller = self._caller(ctx)
        kw: dict[str, Any] = {}
        if fields.update_mode:
            kw["mode"] = stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            kw["uid"] = attr.st_uid
        if fields.update_gid:
            kw["gid"] = attr.st_gid
        st = self._inodes.get(inode)
        if fields.update_atime or fields.update_mtime:
            if st is not None:  # buffered writes land first, so their mtime update cannot undo an explicit time
                await self.writes.flush_inode(st)
            kw.update(await self._times(caller, inode, attr, fields))
        old = new_size = None
        if fields.update_size:
            new_size = attr.st_size
            if st is not None:
                await self.writes.flush_inode(st)
                old = st.size
            else:
                old = (await self.meta.getattr(caller, inode)).size
            kw["size"] = new_size
        if fh is not None and kw.keys() & {"size", "mode"}:
            # through a descriptor (ftruncate): permission was checked when it was opened, and the mode the file
            # has now must not undo that, so meta checks the descriptor's write session instead
            h = self._handles.get(fh)
            if h is not None and h.session is not None:
                kw["session"] = h.session
        # Nothing to change still changes ctime: chown(f, -1, -1) does on Linux, and FUSE (without writeback
        # caching) sends it as a setattr with no fields; meta's setattr sets ctime whatever it is asked
        result = await self.meta.setattr(caller, inode, **kw)
        if new_size is not None:
            if st is not None:
                st.size = new_size
                self._changed(st)
            else:
                if self.cache is not None:
                    self.cache.drop(inode)
                if self.local is not None:
                    self.local.drop(inode)
            if old is not None and new_size < old:
                layout = st.layout if st is not None else await self._layout(caller, inode)
                await self.storage.truncate(inode, layout, old, new_size)
        if self.dirops is not None:
            if stat.S_ISDIR(result.mode):
                self.dirops.dir_attr(inode, result)
            elif "uid" in kw:
                self.dirops.forget_inode(inode)  # sticky-bit checks here knew its old owner
        return self._entry(result)

    async def _times(self, caller: Caller, inode: int, attr: Any, fields: Any) -> dict[str, Any]:
        """The atime/mtime values for meta's setattr.

        pyfuse3 turns UTIME_NOW into the current time before we see it, but meta must know ("now" needs write
        access, explicit times need ownership). With ``default_permissions`` the kernel has already refused
        explicit times from anyone but the owner and root, so from them the value is sent as given, and from
        anyone else it can only have been UTIME_NOW."""
        owner_or_root = caller.uid == 0 or caller.uid == (await self.meta.getattr(caller, inode)).uid
        times = {}
        for name, want, value in (("atime", fields.update_atime, attr.st_atime_ns),
                                  ("mtime", fields.update_mtime, attr.st_mtime_ns)):
            if want:
                times[name] = value if owner_or_root else "now"
        return times

    @_fuse_errors
    @_changes_directories
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._named(parent_inode, name, await self.meta.mknod(self._caller(ctx), parent_inode, name, mode, rdev))

    @_fuse_errors
    @_changes_directories
    async def mkdir(self, parent_inode, name, mode, ctx):
        attr = await self.meta.mkdir(self._caller(ctx), parent_inode, name, mode)
        if self.coherence is not None:
            self.coherence.listing_made(attr.ino)
        return self._named(parent_inode, name, attr)

    @_fuse_errors
    @_changes_directories
    async def unlink(self, parent_inode, name, ctx):
        caller = self._caller(ctx)
        held = self.dirops.removable(parent_inode, name, caller) if self.dirops is not None else None
        if held is not None:  # a file this mount made in a directory it holds: answered here (fuse/dirops.py)
            self._fresh_dir(parent_inode, self.dirops.unlink(held, caller, name))
            return
        if self.dirops is not None:  # after a few, a grant for removals (fuse/dirops.py, want)
            self.dirops.want(parent_inode, caller, removes=True)
        parent = await self.meta.unlink(caller, parent_inode, name)
        self._unnamed(parent_inode, name)
        self._fresh_dir(parent_inode, parent)

    @_fuse_errors
    @_changes_directories
    async def rmdir(self, parent_inode, name, ctx):
        parent = await self.meta.rmdir(self._caller(ctx), parent_inode, name)
        self._unnamed(parent_inode, name)
        self._fresh_dir(parent_inode, parent)

    @_fuse_errors
    @_changes_directories
    async def symlink(self, parent_inode, name, target, ctx):
        return self._named(parent_inode, name, await self.meta.symlink(self._caller(ctx), parent_inode, name, target))

    @_fuse_errors
    async def readlink(self, inode, ctx):
        return await self.meta.readlink(self._caller(ctx), inode)

    @_fuse_errors
    @_changes_directories
    async def link(self, inode, new_parent_inode, new_name, ctx):
        attr = await self.meta.link(self._caller(ctx), inode, new_parent_inode, new_name)
        if self.dirops is not None:
            self.dirops.forget_inode(inode)  # reachable elsewhere now: its removals go to meta
        return self._named(new_parent_inode, new_name, attr)

    @_fuse_errors
    @_changes_directories
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        # pyfuse3.RENAME_NOREPLACE/EXCHANGE are Linux's values, which meta uses too
        moved = other = 0  # the inodes the names lead to, where listings know them
        if self.coherence is not None:
            moved = self.coherence.inode_of(parent_inode_old, name_old)
            other = self.coherence.inode_of(parent_inode_new, name_new)
        await self.meta.rename(self._caller(ctx), parent_inode_old, name_old, parent_inode_new, name_new, flags)
        if flags & pyfuse3.RENAME_EXCHANGE:  # both names stay, for each other's inodes
            if self.coherence is not None:
                self.coherence.named(parent_inode_old, name_old, other)
                self.coherence.named(parent_inode_new, name_new, moved)
            if self.dirops is not None:
                self.dirops.named(parent_inode_old, name_old)
                self.dirops.named(parent_inode_new, name_new)
            return
        self._unnamed(parent_inode_old, name_old)
        if self.coherence is not None:
            self.coherence.named(parent_inode_new, name_new, moved)
        if self.dirops is not None:
            self.dirops.named(parent_inode_new, name_new)

    async def forget(self, inode_list):
        for ino, _ in inode_list:
            if ino not in self._inodes:
                self._layouts.pop(ino, None)
            if self.dirops is not None:
                self.dirops.forgotten(ino)

    @_fuse_errors
    async def access(self, inode, mode, ctx):
        return await self.meta.access(self._caller(ctx), inode, mode)

    @_fuse_errors
    async def statfs(self, ctx):
        s = await self.meta.statfs(self._caller(ctx))
        out = pyfuse3.StatvfsData()
        bsize = s.bsize or 4096
        try:
            total, free = await self.storage.capacity()
            blocks, bfree = total // bsize, free // bsize
        except OSError:
            blocks, bfree = s.blocks, s.bfree
        out.f_bsize = bsize
        out.f_frsize = s.frsize or bsize
        out.f_blocks = blocks
        out.f_bfree = bfree
        out.f_bavail = bfree
        out.f_files = s.files + s.ffree
        out.f_ffree = s.ffree
        out.f_favail = s.ffree
        out.f_namemax = s.namemax
        return out

    # ------------------------------------------------------------------ xattrs ------------
    @_fuse_errors
    @_changes_directories
    async def setxattr(self, inode, name, value, ctx):
        try:
            await self.meta.setxattr(self._caller(ctx), inode, name, value)
        finally:
            self._xattrs_changed_here(inode)
            if name == LAYOUT_XATTR and self.dirops is not None:
                self.dirops.unsure(inode)  # what its new files get changed (or may have)

    @_fuse_errors
    async def getxattr(self, inode, name, ctx):
        if self.coherence is None:
            return await self.meta.getxattr(self._caller(ctx), inode, name)
        known = self.coherence.xattr(inode, name)
        if known is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        if known is not UNKNOWN:
            return known
        asked_at = self.coherence.xattr_changes
        try:
            value = await self.meta.getxattr(self._caller(ctx), inode, name)
        except OSError as e:
            if e.errno == errno.ENODATA:
                self.coherence.keep_xattr(inode, name, None, asked_at)
            raise
        self.coherence.keep_xattr(inode, name, value, asked_at)
        return value

    @_fuse_errors
    async def listxattr(self, inode, ctx):
        return await self.meta.listxattr(self._caller(ctx), inode)

    @_fuse_errors
    @_changes_directories
    async def removexattr(self, inode, name, ctx):
        try:
            await self.meta.removexattr(self._caller(ctx), inode, name)
        finally:
            self._xattrs_changed_here(inode)

    def _xattrs_changed_here(self, ino: int) -> None:
        """After the call: an answer kept before is dropped, and one read while the call ran is not kept."""
        if self.coherence is not None:
            self.coherence.drop_xattrs(ino)

    # ------------------------------------------------------------------ directories -------
    @_fuse_errors
    async def opendir(self, inode, ctx):
        caller = self._caller(ctx)
        await self.meta.open(caller, inode, os.O_RDONLY | os.O_DIRECTORY)  # read permission, ENOTDIR
        fh = self._new_fh()
        self._dirs[fh] = _DirHandle(inode, caller)
        return fh

    @_fuse_errors
    async def readdir(self, fh, start_id, token):
        d = self._dirs[fh]
        if start_id < d.base:  # rewinddir (or a seek backwards): list again from the start
            d.base, d.entries, d.cookie, d.eof, d.dots = 0, [], b"", False, False
        if not d.dots:
            here = await self.meta.getattr(d.caller, d.ino)
            up = await self.meta.lookup(d.caller, d.ino, b"..")
            d.entries[:0] = [(b".", here), (b"..", up)]
            d.dots = True
        while True:
            skip = start_id - d.base
            if skip > 0:  # the kernel has everything before start_id: forget it
                del d.entries[:skip]
                d.base = start_id
            while d.entries:
                name, attr = d.entries[0]
                named = (d.ino, name) if name not in (b".", b"..") else (None, None)
                if not pyfuse3.readdir_reply(token, name, self._entry(attr, *named), start_id + 1):
                    return
                start_id += 1
                del d.entries[0]
                d.base = start_id
            if d.eof:
                return
            page = await self.meta.readdir(d.caller, d.ino, d.cookie, self.readdir_page)
            d.entries.extend((e.name, e.attr) for e in page.entries)
            d.cookie, d.eof = page.cookie, page.eof

    @_fuse_errors
    async def releasedir(self, fh):
        self._dirs.pop(fh, None)

    @_fuse_errors
    async def fsyncdir(self, fh, datasync):
        if self.dirops is not None:  # changes answered here are durable once applied
            await self.dirops.settled()

    # ------------------------------------------------------------------ files -------------
    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    async def _attach(self, caller: Caller, opened: Opened, flags: int) -> pyfuse3.FileInfo:
        attr, session = opened.attr, opened.session
        if opened.layout is not None:
            self._layouts[attr.ino] = opened.layout
        st = self._inodes.get(attr.ino)
        if st is None:
            layout = await self._layout(caller, attr.ino)
            st = self._inodes.get(attr.ino)  # another open may have raced us
            if st is None:
                st = self._inodes[attr.ino] = InodeState(attr.ino, layout, attr.size)
        if not st.dirty():
            st.size = attr.size
        st.stamp = (attr.mtime_ns, attr.size)
        if self.cache is not None:
            self.cache.opened(attr.ino, st.stamp)
        # A write-only open cannot read or be mapped, and with keep_cache off the next open drops whatever it would
        # leave in the page cache: its writes skip the page cache (a copy, and a page each to allocate and free)
        direct = flags & os.O_ACCMODE == os.O_WRONLY and not self.keep_cache
        set_id = session is not None and caller.uid != 0 and bool(attr.mode & (stat.S_ISUID | stat.S_ISGID))
        h = Handle(self._new_fh(), st, flags, caller, session, opened.hold, direct=direct, set_id=set_id)
        st.handles.add(h)
        self._handles[h.fh] = h
        fi = pyfuse3.FileInfo(fh=h.fh)
        fi.keep_cache = self.keep_cache
        fi.direct_io = direct
        return fi

    @_fuse_errors
    async def open(self, inode, flags, ctx):
        caller = self._caller(ctx)
        old = None
        if flags & os.O_TRUNC:
            st = self._inodes.get(inode)
            if st is not None:
                await self.writes.flush_inode(st)
                old = st.size
            else:
                old = (await self.meta.getattr(caller, inode)).size
        # hold: a read-only open keeps the file from meta's GC too, so it stays readable after another process
        # (here or on another host) removes or replaces its last name, as POSIX promises
        try:
            opened = await self.meta.open(caller, inode, flags, hold=True)
        finally:
            if flags & os.O_TRUNC and self.coherence is not None:  # the size, mtime and ctime change
                self.coherence.stale(inode)
        fi = await self._attach(caller, opened, flags)
        if flags & os.O_TRUNC and stat.S_ISREG(opened.attr.mode):
            st = self._inodes[inode]
            st.size = 0
            self._changed(st)
            if old:
                await self.storage.truncate(inode, st.layout, old, 0)
        return fi

    @_fuse_errors
    @_changes_directories
    async def create(self, parent_inode, name, mode, flags, ctx):
        caller = self._caller(ctx)
        held = self.dirops.creatable(parent_inode, name, caller) if self.dirops is not None else None
        if held is not None:  # a free name in a directory this mount holds: answered here (fuse/dirops.py)
            opened = self.dirops.create(held, caller, name, mode, flags)
            self._fresh_dir(parent_inode, opened.parent)
            fi = await self._attach(caller, opened, flags)
            return fi, self._entry(opened.attr, parent_inode, name)
        if self.dirops is not None:
            self.dirops.want(parent_inode, caller)
        try:
            opened = await self.meta.create(caller, parent_inode, name, mode, flags)
        except OSError as e:
            if e.errno != errno.EEXIST or flags & os.O_EXCL:
                raise
            # The kernel thought the name absent (a negative entry, perhaps ours from a listing that another
            # client's create of the same name overtook): without O_EXCL, open what is there.
            attr = await self.meta.lookup(caller, parent_inode, name)
            started = STARTED.get()
            fi = await self.open(attr.ino, flags & ~os.O_CREAT, ctx)
            STARTED.set(started)  # open() noted its own start: this reply's is earlier
            return fi, self._named(parent_inode, name, attr)
        fi = await self._attach(caller, opened, flags)
        entry = self._named(parent_inode, name, opened.attr)
        if opened.parent is not None:
            self._fresh_dir(parent_inode, opened.parent)
        return fi, entry

    def _fresh_dir(self, ino: int, attr: Attr) -> None:
        """Keep a directory's attributes that meta returned from our own change of it. The kernel drops its cached
        copy after a create or unlink and, checking permissions itself, asks for it before the next lookup in the
        directory: this answers that getattr without a round trip (once, within the attribute timeout)."""
        self._fresh_dirs[ino] = (attr, trio.current_time() + self.attr_timeout)
        if self.dirops is not None:
            self.dirops.dir_attr(ino, attr)

    def _handle(self, fh: int) -> Handle:
        h = self._handles.get(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return h

    @_fuse_errors
    async def read(self, fh, off, size):
        h = self._handle(fh)
        st = h.state
        end = min(off + size, st.size)
        if end <= off:
            return b""
        cached = self.cache is not None and end - off <= _CACHED_READ
        over: list[DirtyRuns] | None = []
        if st.dirty():  # the cache fetches whole blocks, and keeps them only if no write here is pending in them
            lo, hi = (off // CACHE_BLOCK * CACHE_BLOCK, -(-end // CACHE_BLOCK) * CACHE_BLOCK) if cached else (off, end)
            over = self.writes.gathered_over(st, lo, hi)
            if over is None:
                await self.writes.flush_inode(st)
                over = []
                end = min(off + size, st.size)
                if end <= off:
                    return b""
        if cached:
            out = await self._read_cached(st, off, end, fill=not over)
        else:
            out = RECEIVED.take(end - off)  # every byte is filled below (holes as zeros by storage.read)
            await per_chunk(self.storage.read, st.ino, st.layout, off, memoryview(out), self.read_limit)
        for runs in over:  # bytes written here and not yet out, newer than storage's
            runs.copy_into(memoryview(out), off)
        return out

    async def _read_cached(self, st: InodeState, off: int, end: int, fill: bool = True) -> bytearray:
        """A small read from whole cached blocks, fetching the missing ones (see fuse/cache.py). ``fill=False``:
        the fetched blocks are not kept, as gathered writes not yet in storage will change them."""
        assert self.cache is not None
        first, last = off // CACHE_BLOCK, (end - 1) // CACHE_BLOCK
        blocks = {i: self.cache.get(st.ino, i) for i in range(first, last + 1)}
        missing = [i for i, b in blocks.items() if b is None or len(b) < min(CACHE_BLOCK, st.size - i * CACHE_BLOCK)]
        if missing:
            changes, stamp = st.changes, st.stamp

            async def fetch(index: int) -> None:
                start = index * CACHE_BLOCK  # a block never spans chunks: chunk sizes are multiples of it
                data = bytearray(min(CACHE_BLOCK, st.size - start))
                async with self.read_limit:
                    if self.local is None or not await self.local.read(st, start, memoryview(data)):
                        await self.storage.read(st.ino, st.layout, start, memoryview(data))
                blocks[index] = data

            if len(missing) == 1:
                await fetch(missing[0])
            else:
                await parallel(fetch, [(i,) for i in missing])
            if fill and st.changes == changes:  # no local write or truncation overtook the reads
                for i in missing:
                    self.cache.put(st.ino, i, blocks[i], stamp)
        if first == last:
            return blocks[first][off - first * CACHE_BLOCK : end - first * CACHE_BLOCK]
        out = bytearray()
        for i in range(first, last + 1):
            base = i * CACHE_BLOCK
            out += memoryview(blocks[i])[max(off, base) - base : min(end, base + CACHE_BLOCK) - base]
        return out

    def _wrote(self, st: InodeState) -> None:
        """Storage took this mount's writes to the file: versions located before are old (their chunks' other
        blocks are still right, so the read cache keeps them), and a locate racing the flush is not kept."""
        st.changes += 1
        if self.local is not None:
            self.local.drop(st.ino)

    def _changed(self, st: InodeState, offset: int = 0, length: int | None = None) -> None:
        """This mount changes the file's bytes in ``[offset, offset + length)`` (all of them if None): what
        :meth:`_wrote` drops, and the read cache's blocks of the range."""
        self._wrote(st)
        if self.cache is not None:
            if length is None:
                self.cache.drop(st.ino)
            else:
                self.cache.drop_range(st.ino, offset, length)

    @_fuse_errors
    async def write(self, fh, off, buf):
        h = self._handle(fh)
        st = h.state
        if h.set_id:
            await self._drop_set_id(h)
        others = len(st.handles) > 1
        if others:  # writes to the same bytes through two opens reach storage in the order they were made
            await self._drop_pages_of_other_opens(h)  # their dirty pages reach their opens' buffers first
            await self.writes.flush_inode(st, off, off + len(buf), but=h)
        await self.writes.write(h, off, buf)
        if others:
            await self._drop_pages_of_other_opens(h)
        return len(buf)

    async def _drop_set_id(self, h: Handle) -> None:
        """The first write through an open of a set-id file, by anyone but root: meta drops the bits (by Linux's
        rule, ``kill_suid``) before the bytes go anywhere, as a local filesystem does in write(2). Writes that skip
        the page cache get no request from the kernel for it, and a buffered write is reported to meta only when
        it is flushed: until then the changed file would still be set-id."""
        h.set_id = False
        assert h.session is not None
        try:
            await self.meta.report_length(h.caller, h.state.ino, h.session, 0)
        finally:
            if self.coherence is not None:
                self.coherence.stale(h.state.ino)
            invalidate_attributes(h.state.ino)

    @staticmethod
    async def _drop_pages_of_other_opens(h: Handle) -> None:
        """Around a write that skips the page cache: pages other opens of this mount hold would be stale after
        it, and dirty ones (stores through a shared mapping) would later be written back over it. So the kernel
        writes them back and drops them before the write, and drops what was read meanwhile after it (Linux 6.18
        does that part itself, older kernels may not). Outside the handle's lock: dropping a page waits for any
        read or write-back of it, which may need that lock."""
        if h.direct and any(not other.direct for other in h.state.handles):
            await trio.to_thread.run_sync(functools.partial(invalidate_kernel_cache, h.state.ino, attr_only=False))

    @_fuse_errors
    async def flush(self, fh):
        h = self._handle(fh)
        await self.writes.flush_inode(h.state)
        h.raise_error()

    @_fuse_errors
    async def fsync(self, fh, datasync):
        h = self._handle(fh)
        st = h.state
        await self.writes.flush_inode(st)
        h.raise_error()
        async with one_error(), trio.open_nursery() as nursery:
            nursery.start_soon(self.storage.flush, st.ino)  # chunk servers acknowledge from their page cache
            if self.dirops is not None:  # the file's create, if answered here, is durable once applied
                nursery.start_soon(self.dirops.settled)
        if h.session is not None:
            try:
                async with st.exact_length:  # st.size read inside: the last to reach meta is the newest
                    await self.meta.set_length(h.caller, st.ino, h.session, st.size)
            finally:
                self._attributes_changed_here(st.ino)

    def _attributes_changed_here(self, ino: int) -> None:
        """Meta changed attributes the kernel did not change itself (a length report sets size and mtime). The
        feed leaves out this mount's own changes, so the kernel's copy, perhaps kept for long, is dropped here."""
        if self.coherence is not None:
            self.coherence.stale(ino)
            invalidate_attributes(ino)

    @_fuse_errors
    async def release(self, fh):
        h = self._handles.pop(fh, None)
        if h is None:
            return
        st = h.state
        try:
            await self.writes.flush_inode(st)
        finally:
            st.handles.discard(h)
            if not st.handles:
                self._inodes.pop(st.ino, None)
            if h.session is not None and not (self.dirops is not None and self.dirops.end_session(st.ino, h.session)):
                self._close_in_background(h.caller, st.ino, h.session)
            if h.hold is not None:
                self._close_in_background(h.caller, st.ino, h.hold)

    def _close_in_background(self, caller: Caller, ino: int, session: int) -> None:
        """End a session (a write session or a read-only open's hold) without making close(2) wait: the kernel
        ignores release's answer anyway, the length meta needs was reported when the buffers were flushed, and one
        round trip fewer per file is a large share of a small file's cost. Sessions to end queue up while a batch
        is on its way and go together in one ``close_sessions`` call. Orderly unmounts wait for these
        (``flush_all``).

        No exact length goes with them: the kernel sends RELEASE after close(2) has returned, so a later open of
        the same file may already have written (and reported) more by the time this session ends, and an exact
        length from here would cut those bytes off. Flushes report every write's end, and truncation goes to
        meta itself, so meta's length is already right."""
        if self.nursery is None:
            raise RuntimeError("KvfsOperations used outside run_mount")
        self._to_close.append((ino, session, None))
        if self.dirops is not None:  # the sessions' creates, if answered here, are among the changes queued by now
            self._close_after = self.dirops.position()
        self._closing += 1
        if self._closing == 1:  # nothing was queued or on its way, so no closer task runs: start one
            self.nursery.start_soon(self._end_sessions, caller)

    async def _end_sessions(self, caller: Caller) -> None:
        """Send queued session ends until none are left (a session needs no particular caller to end). The first
        batch waits a moment for company: one program creating files one after another would otherwise pay a
        round trip per file, as nothing else is on its way to batch behind."""
        await trio.sleep(_CLOSE_LINGER)
        while self._to_close:
            batch, self._to_close = self._to_close[:_CLOSE_BATCH], self._to_close[_CLOSE_BATCH:]
            try:
                if self.dirops is None:
                    await self.meta.close_sessions(caller, batch)
                else:  # only after the creates of these files, not after every change queued since (fuse/dirops.py)
                    await self.dirops.settled(self._close_after)
                    await self.meta.unordered.close_sessions(caller, batch)
            except Exception:
                log.exception("ending %d sessions (inodes %s...)", len(batch), [b[0] for b in batch[:5]])
            finally:
                self._closing -= len(batch)
                if not self._closing:
                    self._closed.set()
                    self._closed = trio.Event()

    async def flush_all(self) -> None:
        """Write out every buffer and end every write session (before an orderly unmount)."""
        for st in list(self._inodes.values()):
            try:
                await self.writes.flush_inode(st)
            except Exception:
                log.exception("flushing inode %d before unmount", st.ino)
        while self._closing:
            await self._closed.wait()
        if self.dirops is not None:
            await self.dirops.close()


_CLOSE_BATCH = 256
_LIST_AFTER_MISSES = 2  # lookups in a directory that asked meta before the mount reads (more of) its listing
_MISSES_KEPT = 4096  # directories whose misses are counted (all are forgotten when more come)
_CACHED_READ = 128 * 1024  # reads up to this size go through the read cache; larger ones stream past it
_CLOSE_LINGER = 0.02  # seconds
