"""The metadata service's logic: POSIX metadata over the transactional KV store, one KV transaction per operation.

Methods are synchronous: the RPC service runs them on its event loop (SQLite) or in a worker thread
(FoundationDB).  Each takes the :class:`Caller` first, checks POSIX permissions for it and raises
:class:`KvfsError` with the errno a kernel would give.  Operations are inode based like FUSE's low-level API
(``parent`` inode + ``name``); :meth:`MetaStore.resolve` walks whole paths for callers that bypass the kernel.
Names are bytes (any byte but ``/`` and NUL); ``str`` is accepted and encoded with UTF-8/surrogateescape like
``os.fsencode``. readdir returns real entries only: "." and ".." are the FUSE layer's business.

:class:`MetaStore` is where every operation is declared (the RPC surface is derived from its methods,
:mod:`kvfs.meta.rpc`). The parts with records of their own (inode ids, exactly-once answers, write sessions, client
leases, delegations, the chunk collector, the change feed) are components in :mod:`kvfs.meta.components`, which the
store composes.
"""

from __future__ import annotations

import contextvars
import errno
import os
import stat
import time
from typing import Any, Callable

import msgspec

from kvfs.errors import KvfsError
from kvfs.kv import Database, Transaction
from kvfs.kv.keys import decode_int, key_after, unpack
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
from kvfs.meta.posix import (
    LAYOUT_XATTR, LINK_MAX, NAME_MAX, PATH_MAX, RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO, R_OK, SYMLOOP_MAX, W_OK,
    XATTR_CREATE, XATTR_NAME_MAX, XATTR_REPLACE, XATTR_SIZE_MAX, X_OK, check_name, child_attr, errno_error, fsname,
    is_dir, kill_suid, open_wants, pick_time, require_access, require_owner, require_sticky,
)
from kvfs.meta.records import (
    decode_entry, decode_inode, delete_inode, encoder, get_child, get_entry, get_inode, get_live, link_entry,
    put_inode, touch,
)
from kvfs.meta.types import (
    ID_BLOCK, Attr, Caller, ChangePage, CreateOp, Delegated, Delegation, DirOp, DirPage, Entry, Inode, Layout, Opened,
    StatFs, TimeSpec,
)

#: The time a delegated change was made at (its holder's clock): what meta applies it with, instead of its own.
HOLDER_TIME: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvfs_meta_now", default=None)

__all__ = [
    "ANSWER_MINUTES", "FEED_SECONDS", "LAYOUT_XATTR", "RENAME_EXCHANGE", "RENAME_NOREPLACE", "ROOT_INO",
    "XATTR_CREATE", "XATTR_REPLACE", "MetaStore", "SpaceFn",
]

SpaceFn = Callable[[], tuple[int, int]]


class MetaStore:
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

    def _dir(self, tr: Transaction, caller: Caller, ino: int, want: int = X_OK) -> Inode:
        """A live directory the caller has ``want`` access to (search by default), not delegated to another client."""
        inode = get_live(tr, ino)
        if not is_dir(inode):
            raise errno_error(errno.ENOTDIR, f"inode {ino}")
        self._delegations.check(tr, caller, ino)
        require_access(caller, inode.attr, want)
        return inode

    def lookup(self, caller: Caller, parent: int, name: bytes | str) -> Attr:
        return self.db.run(self._lookup, caller, parent, fsname(name))

    def _lookup(self, tr: Transaction, caller: Caller, parent: int, name: bytes) -> Attr:
        pdir = self._dir(tr, caller, parent)
        if name == b".":
            return pdir.attr
        if name == b"..":
            return get_inode(tr, pdir.parent).attr
        if len(name) > NAME_MAX:
            raise errno_error(errno.ENAMETOOLONG, repr(name[:32]))
        return get_child(tr, parent, name)[1].attr

    def resolve(self, caller: Caller, path: bytes | str, *, follow: bool = True) -> Attr:
        """Walk an absolute path from the root with search checks on every directory, following
        symlinks in the middle (and at the end if ``follow``); ELOOP after SYMLOOP_MAX of them."""
        return self.db.run(self._resolve, caller, fsname(path), follow)

    def _resolve(self, tr: Transaction, caller: Caller, path: bytes, follow: bool) -> Attr:
        if len(path) > PATH_MAX:
            raise errno_error(errno.ENAMETOOLONG, "path")
        parts = [p for p in path.split(b"/") if p]
        cur = get_inode(tr, ROOT_INO)
        hops = 0
        while parts:
            name = parts.pop(0)
            attr = self._lookup(tr, caller, cur.attr.ino, name)
            node = get_inode(tr, attr.ino)
            if stat.S_ISLNK(attr.mode) and (parts or follow):
                hops += 1
                if hops > SYMLOOP_MAX:
                    raise errno_error(errno.ELOOP, repr(path))
                target = node.target or b""
                parts = [p for p in target.split(b"/") if p] + parts
                if target.startswith(b"/"):
                    cur = get_inode(tr, ROOT_INO)
                continue
            cur = node
        return cur.attr

    def _make(self, tr: Transaction, caller: Caller, parent: int, name: bytes, mode: int, ino: int,
              *, rdev: int = 0, target: bytes | None = None, seed: int | None = None,
              parent_inode: Inode | None = None, written: bool = False) -> Inode:
        """Create inode ``ino`` named ``name`` in ``parent``: owner is the caller, the group and
        (for directories) the setgid bit come from a setgid parent, layout is the parent's
        (regular files get their own random seed). ``parent_inode``: the directory, loaded by a caller that makes
        several changes in it and stores it once at the end. ``written``: a write session starts with it."""
        pdir = parent_inode or self._dir(tr, caller, parent)
        if get_entry(tr, parent, name) is not None:
            raise errno_error(errno.EEXIST, repr(name))
        require_access(caller, pdir.attr, W_OK | X_OK)
        is_dir = stat.S_ISDIR(mode)
        if is_dir and pdir.attr.nlink >= LINK_MAX:
            raise errno_error(errno.EMLINK, f"inode {parent}")
        attr, layout = child_attr(caller, pdir.attr, self._layout(pdir), mode, ino, self._now(),
                                  rdev=rdev, target=target, seed=seed)
        inode = Inode(attr, parent=parent if is_dir else 0, layout=layout, target=target, written=written)
        put_inode(tr, inode)
        link_entry(tr, parent, name, inode)
        if is_dir:
            pdir.attr.nlink += 1
        self._touch(pdir)
        if parent_inode is None:
            put_inode(tr, pdir)
        tr.add(schema.INODE_COUNT, 1)
        return inode

    def _create_op(self, fn: Callable[..., Any], caller: Caller, parent: int, name: bytes | str, *args: Any) -> Any:
        return self._write(fn, caller, parent, check_name(name), self._ids.next(), *args)

    def mkdir(self, caller: Caller, parent: int, name: bytes | str, mode: int) -> Attr:
        return self._create_op(self._mkdir, caller, parent, name, mode)

    def _mkdir(self, tr: Transaction, caller: Caller, parent: int, name: bytes, ino: int, mode: int) -> Attr:
        return self._make(tr, caller, parent, name, stat.S_IFDIR | (mode & 0o7777), ino).attr

    def mknod(self, caller: Caller, parent: int, name: bytes | str, mode: int, rdev: int = 0) -> Attr:
        """Regular files, FIFOs and sockets for anyone; character/block devices for root only."""
        return self._create_op(self._mknod, caller, parent, name, mode, rdev)

    def _mknod(self, tr: Transaction, caller: Caller, parent: int, name: bytes, ino: int, mode: int, rdev: int) -> Attr:
        ftype = stat.S_IFMT(mode) or stat.S_IFREG
        if ftype in (stat.S_IFCHR, stat.S_IFBLK):
            if caller.uid != 0:
                raise errno_error(errno.EPERM, "device nodes need root")
        elif ftype in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK):
            rdev = 0
        else:
            raise errno_error(errno.EINVAL, f"mknod type {ftype:o}")
        return self._make(tr, caller, parent, name, ftype | (mode & 0o7777), ino, rdev=rdev).attr

    def symlink(self, caller: Caller, parent: int, name: bytes | str, target: bytes | str) -> Attr:
        raw = fsname(target)
        if not raw or b"\0" in raw:
            raise errno_error(errno.ENOENT if not raw else errno.EINVAL, "symlink target")
        if len(raw) >= PATH_MAX:
            raise errno_error(errno.ENAMETOOLONG, "symlink target")
        return self._create_op(self._symlink, caller, parent, name, raw)

    def _symlink(self, tr: Transaction, caller: Caller, parent: int, name: bytes, ino: int, target: bytes) -> Attr:
        return self._make(tr, caller, parent, name, stat.S_IFLNK | 0o777, ino, target=target).attr

    def link(self, caller: Caller, ino: int, newparent: int, newname: bytes | str) -> Attr:
        return self._write(self._link, caller, ino, newparent, check_name(newname))

    def _link(self, tr: Transaction, caller: Caller, ino: int, newparent: int, newname: bytes) -> Attr:
        inode = get_live(tr, ino)
        if is_dir(inode):
            raise errno_error(errno.EPERM, "hard link to a directory")
        if inode.attr.nlink >= LINK_MAX:
            raise errno_error(errno.EMLINK, f"inode {ino}")
        pdir = self._dir(tr, caller, newparent)
        if get_entry(tr, newparent, newname) is not None:
            raise errno_error(errno.EEXIST, repr(newname))
        require_access(caller, pdir.attr, W_OK | X_OK)
        inode.attr.nlink += 1
        self._touch(inode, mtime=False)
        self._touch(pdir)
        link_entry(tr, newparent, newname, inode)
        put_inode(tr, inode)
        put_inode(tr, pdir)
        return inode.attr

    def unlink(self, caller: Caller, parent: int, name: bytes | str) -> Attr:
        """Remove a non-directory's name; returns the parent directory's new attributes."""
        return self._write(self._remove, caller, parent, check_name(name), False)

    def rmdir(self, caller: Caller, parent: int, name: bytes | str) -> Attr:
        """Remove an empty directory; returns the parent directory's new attributes."""
        return self._write(self._remove, caller, parent, check_name(name), True)

    def _remove(self, tr: Transaction, caller: Caller, parent: int, name: bytes, want_dir: bool,
                parent_inode: Inode | None = None) -> Attr:
        pdir = parent_inode or self._dir(tr, caller, parent)  # see _make
        _, inode = get_child(tr, parent, name)
        require_access(caller, pdir.attr, W_OK | X_OK)
        require_sticky(caller, pdir, inode)
        if want_dir:
            self._delegations.check(tr, caller, inode.attr.ino)  # its holder may have made names there
            self._check_empty_dir(tr, inode)
            pdir.attr.nlink -= 1
        elif is_dir(inode):
            raise errno_error(errno.EISDIR, repr(name))
        tr.clear(schema.dentry(parent, name))
        self._touch(pdir)
        if parent_inode is None:
            put_inode(tr, pdir)
        self._drop_link(tr, inode)
        return pdir.attr

    def _drop_link(self, tr: Transaction, inode: Inode) -> None:
        """Remove one name of ``inode``.  A regular file's last link queues it for chunk GC (the
        record stays while sessions are open, holds of read-only opens included); anything else goes now, and so
        does a file that never had a write session (``written``: no chunk server holds any of it) and is not open,
        so that a loop that creates and removes files leaves the collector no work to compete with its next
        creates."""
        inode.attr.nlink = 0 if is_dir(inode) else inode.attr.nlink - 1
        self._touch(inode, mtime=False)
        if inode.attr.nlink > 0 or (
            stat.S_ISREG(inode.attr.mode) and (inode.written or self._sessions.any_open(tr, inode.attr.ino))
        ):
            put_inode(tr, inode)
            if inode.attr.nlink == 0:
                tr.set(schema.gc(inode.attr.ino), b"")
            return
        if is_dir(inode):
            Delegations.remove(tr, inode.attr.ino)  # held by its remover, if by anyone (see _remove)
        delete_inode(tr, inode.attr.ino)

    def _check_empty_dir(self, tr: Transaction, inode: Inode) -> None:
        if not is_dir(inode):
            raise errno_error(errno.ENOTDIR, f"inode {inode.attr.ino}")
        if inode.attr.ino == ROOT_INO:
            raise errno_error(errno.EBUSY, "root")
        if tr.get_range(*schema.dir_range(inode.attr.ino), limit=1):
            raise errno_error(errno.ENOTEMPTY, f"inode {inode.attr.ino}")

    def rename(self, caller: Caller, parent: int, name: bytes | str, newparent: int, newname: bytes | str,
               flags: int = 0) -> None:
        """Atomic rename with Linux's RENAME_NOREPLACE / RENAME_EXCHANGE flags."""
        self._write(self._rename, caller, parent, check_name(name), newparent, check_name(newname), flags)

    def _rename(self, tr: Transaction, caller: Caller, parent: int, name: bytes, newparent: int,
                newname: bytes, flags: int) -> None:
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == RENAME_NOREPLACE | RENAME_EXCHANGE:
            raise errno_error(errno.EINVAL, f"rename flags {flags}")
        sdir = self._dir(tr, caller, parent)
        ddir = sdir if newparent == parent else self._dir(tr, caller, newparent)
        sentry, src = get_child(tr, parent, name)
        dentry = get_entry(tr, newparent, newname)
        for d in (sdir, ddir):
            require_access(caller, d.attr, W_OK | X_OK)
        require_sticky(caller, sdir, src)
        dst = None
        if dentry is not None:
            if flags & RENAME_NOREPLACE:
                raise errno_error(errno.EEXIST, repr(newname))
            dst = get_inode(tr, dentry.ino)
            require_sticky(caller, ddir, dst)
            if dst.attr.ino == src.attr.ino:
                return  # two names of one file: POSIX says do nothing
        elif flags & RENAME_EXCHANGE:
            raise errno_error(errno.ENOENT, repr(newname))

        if flags & RENAME_EXCHANGE:
            assert dst is not None and dentry is not None
            self._check_move(tr, caller, src, sdir, ddir)
            self._check_move(tr, caller, dst, ddir, sdir)
            self._move(sdir, ddir, src)
            self._move(ddir, sdir, dst)
            tr.set(schema.dentry(parent, name), encoder.encode(dentry))
            self._touch(dst, mtime=False)
            put_inode(tr, dst)
        else:
            if dst is not None:
                if is_dir(src):
                    if is_dir(dst):
                        self._delegations.check(tr, caller, dst.attr.ino)
                    self._check_empty_dir(tr, dst)
                elif is_dir(dst):
                    raise errno_error(errno.EISDIR, repr(newname))
            self._check_move(tr, caller, src, sdir, ddir)
            self._move(sdir, ddir, src)
            tr.clear(schema.dentry(parent, name))
            if dst is not None:
                if is_dir(dst):
                    ddir.attr.nlink -= 1
                self._drop_link(tr, dst)
        tr.set(schema.dentry(newparent, newname), encoder.encode(sentry))
        self._touch(src, mtime=False)
        self._touch(sdir, ddir)
        put_inode(tr, src)
        put_inode(tr, sdir)
        put_inode(tr, ddir)

    def _check_move(self, tr: Transaction, caller: Caller, node: Inode, old: Inode, new: Inode) -> None:
        """A directory changing parents must not land inside itself (EINVAL), needs write access
        to itself (its ".." changes) and room for one more link in the new parent."""
        if not is_dir(node) or old.attr.ino == new.attr.ino:
            return
        ino = new.attr.ino
        while True:
            if ino == node.attr.ino:
                raise errno_error(errno.EINVAL, "cannot move a directory under itself")
            if ino == ROOT_INO:
                break
            ino = get_inode(tr, ino).parent
        require_access(caller, node.attr, W_OK)
        if new.attr.nlink >= LINK_MAX:
            raise errno_error(errno.EMLINK, f"inode {new.attr.ino}")

    @staticmethod
    def _move(old: Inode, new: Inode, node: Inode) -> None:
        if is_dir(node):
            node.parent = new.attr.ino
            old.attr.nlink -= 1
            new.attr.nlink += 1

    def readdir(self, caller: Caller, ino: int, cookie: bytes = b"", limit: int = 256) -> DirPage:
        """Up to ``limit`` entries after ``cookie`` (the last name of the previous page; b"" to
        start), with attributes for readdirplus.  Names are in byte order, so paging stays
        correct while the directory changes: no entry twice, none that existed throughout lost."""
        return self.db.run(self._readdir, caller, ino, fsname(cookie), max(1, limit))

    def _readdir(self, tr: Transaction, caller: Caller, ino: int, cookie: bytes, limit: int) -> DirPage:
        self._dir(tr, caller, ino, R_OK)
        begin, end = schema.dir_range(ino)
        if cookie:
            begin = key_after(schema.dentry(ino, cookie))
        rows = tr.get_range(begin, end, limit=limit + 1)
        entries = []
        for key, raw in rows[:limit]:
            name = unpack(key)[-1]
            entries.append(Entry(name, get_inode(tr, decode_entry(raw).ino).attr))
        return DirPage(entries, entries[-1].name if entries else cookie, len(rows) <= limit)

    def getattr(self, caller: Caller, ino: int) -> Attr:
        """Attributes of any existing inode (stat needs no permission on the file itself)."""
        return self.db.run(self._getattr, caller, ino)

    def _getattr(self, tr: Transaction, caller: Caller, ino: int) -> Attr:
        inode = get_inode(tr, ino)
        if is_dir(inode):  # its times (and link count) follow changes a delegation's holder may not have sent
            self._delegations.check(tr, caller, ino)
        return inode.attr

    def access(self, caller: Caller, ino: int, mask: int) -> bool:
        """access(2): True when ``caller`` may read/write/execute (``mask`` of R_OK|W_OK|X_OK) the inode.

        The mount needs this because it mounts without ``default_permissions``: meta is the one judge."""
        attr = self.getattr(caller, ino)
        try:
            require_access(caller, attr, mask & 7)
        except KvfsError as exc:
            if exc.errno == errno.EACCES:
                return False
            raise
        return True

    def setattr(
        self,
        caller: Caller,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime: TimeSpec = None,
        mtime: TimeSpec = None,
    ) -> Attr:
        """chmod/chown/truncate/utimens in one.  ``None`` leaves a field alone; times take
        nanoseconds or ``"now"``.  Only the owner (or root) may chmod or set explicit times, only
        root may give a file away, an owner may chgrp to a group it belongs to; chown clears the
        set-id bits of non-directories; truncate needs write permission."""
        return self._write(self._setattr, caller, ino, mode, uid, gid, size, atime, mtime)

    def _setattr(self, tr: Transaction, caller: Caller, ino: int, mode: int | None, uid: int | None,
                 gid: int | None, size: int | None, atime: TimeSpec, mtime: TimeSpec) -> Attr:
        inode = get_inode(tr, ino)
        if is_dir(inode):
            self._delegations.check(tr, caller, ino)
        attr = inode.attr
        now = self._clock()
        if mode is not None:
            require_owner(caller, attr)
            attr.mode = stat.S_IFMT(attr.mode) | (mode & 0o7777)
            if caller.uid != 0 and not caller.in_group(attr.gid):
                attr.mode &= ~stat.S_ISGID
        if uid is not None or gid is not None:
            self._chown(caller, attr, uid, gid)
        if size is not None:
            if is_dir(inode):
                raise errno_error(errno.EISDIR, f"inode {ino}")
            if not stat.S_ISREG(attr.mode) or size < 0:
                raise errno_error(errno.EINVAL, f"size {size} for inode {ino}")
            require_access(caller, attr, W_OK)
            attr.size = size
            attr.mtime_ns = now
            kill_suid(caller, attr)
        if atime is not None or mtime is not None:
            if isinstance(atime, int) or isinstance(mtime, int):
                require_owner(caller, attr)
            elif caller.uid not in (0, attr.uid):
                require_access(caller, attr, W_OK)
            attr.atime_ns = pick_time(atime, now, attr.atime_ns)
            attr.mtime_ns = pick_time(mtime, now, attr.mtime_ns)
        attr.ctime_ns = now
        put_inode(tr, inode)
        return attr

    @staticmethod
    def _chown(caller: Caller, attr: Attr, uid: int | None, gid: int | None) -> None:
        if caller.uid != 0:
            if uid is not None and uid != attr.uid:
                raise errno_error(errno.EPERM, "only root may change the owner")
            if gid is not None and gid != attr.gid and (caller.uid != attr.uid or not caller.in_group(gid)):
                raise errno_error(errno.EPERM, f"may not change group to {gid}")
        attr.uid = attr.uid if uid is None else uid
        attr.gid = attr.gid if gid is None else gid
        if not stat.S_ISDIR(attr.mode):
            attr.mode &= ~stat.S_ISUID
            if attr.mode & stat.S_IXGRP:
                attr.mode &= ~stat.S_ISGID

    def readlink(self, caller: Caller, ino: int) -> bytes:
        inode = self.db.run(get_inode, ino)
        if inode.target is None:
            raise errno_error(errno.EINVAL, f"inode {ino} is not a symlink")
        return inode.target

    def statfs(self, caller: Caller) -> StatFs:
        files = self.db.run(lambda tr: decode_int(tr.get(schema.INODE_COUNT, snapshot=True)))
        total, free = self._space() if self._space else (1 << 50, 1 << 50)
        bsize = 4096
        return StatFs(bsize, bsize, total // bsize, free // bsize, free // bsize, files, (1 << 48) - files, NAME_MAX)

    def get_layout(self, caller: Caller, ino: int) -> Layout:
        """A file's layout, or the layout a directory gives its new children."""
        inode = self.db.run(get_inode, ino)
        return self._layout(inode)

    def set_layout(self, caller: Caller, ino: int, layout: Layout) -> None:
        """Set what new children of directory ``ino`` inherit (owner or root only)."""
        cs = layout.chunk_size
        if cs & (cs - 1) or not 64 * 1024 <= cs <= 64 * 1024 * 1024:
            raise errno_error(errno.EINVAL, f"chunk_size {cs} is not a power of two from 64 KiB to 64 MiB")
        if layout.stripe < 1 or layout.chain_table < 0:
            raise errno_error(errno.EINVAL, f"layout {layout}: stripe must be at least 1")

        def fn(tr: Transaction) -> None:
            inode = get_inode(tr, ino)
            if not is_dir(inode):
                raise errno_error(errno.ENOTDIR, f"inode {ino}")
            self._delegations.check(tr, caller, ino)  # its holder gives new files the layout it has now
            require_owner(caller, inode.attr)
            inode.layout = layout
            self._touch(inode, mtime=False)
            put_inode(tr, inode)

        self._write(fn)

    def _xattr_target(self, tr: Transaction, caller: Caller, ino: int, name: bytes, want: int) -> Inode:
        """Namespace and permission rules: user.* follows the file's mode bits (and only regular
        files and directories carry them), trusted.* is root's, writing security.* needs root,
        system.* (POSIX ACLs) is not supported."""
        if not name or len(name) > XATTR_NAME_MAX:
            raise errno_error(errno.ERANGE, "xattr name length")
        inode = get_inode(tr, ino)
        space = name.split(b".", 1)[0]
        if space == b"user":
            if not (stat.S_ISREG(inode.attr.mode) or is_dir(inode)):
                raise errno_error(errno.EPERM, "user xattrs on special files")
            require_access(caller, inode.attr, want)
        elif space == b"trusted" or (space == b"security" and want == W_OK):
            if caller.uid != 0:
                raise errno_error(errno.EPERM, repr(name))
        elif space != b"security":
            raise errno_error(errno.EOPNOTSUPP, repr(name))
        return inode

    def getxattr(self, caller: Caller, ino: int, name: bytes | str) -> bytes:
        name = fsname(name)
        if name == LAYOUT_XATTR:
            inode = self.db.run(get_inode, ino)
            return (self._layout(inode)).describe(with_seed=not is_dir(inode))
        return self.db.run(self._getxattr, caller, ino, name)

    def _getxattr(self, tr: Transaction, caller: Caller, ino: int, name: bytes) -> bytes:
        self._xattr_target(tr, caller, ino, name, R_OK)
        value = tr.get(schema.xattr(ino, name))
        if value is None:
            raise errno_error(errno.ENODATA, repr(name))
        return value

    def setxattr(self, caller: Caller, ino: int, name: bytes | str, value: bytes, flags: int = 0) -> None:
        if flags & ~(XATTR_CREATE | XATTR_REPLACE) or flags == XATTR_CREATE | XATTR_REPLACE:
            raise errno_error(errno.EINVAL, f"xattr flags {flags}")
        if len(value) > XATTR_SIZE_MAX:
            raise errno_error(errno.E2BIG, "xattr value")
        name = fsname(name)
        if name == LAYOUT_XATTR:
            try:
                layout = self.get_layout(caller, ino).changed_by(bytes(value))
            except (ValueError, UnicodeDecodeError) as e:
                raise errno_error(errno.EINVAL, f"{LAYOUT_XATTR.decode()}: {e}") from None
            self.set_layout(caller, ino, layout)
            return
        self._write(self._change_xattr, caller, ino, name, bytes(value), flags)

    def removexattr(self, caller: Caller, ino: int, name: bytes | str) -> None:
        name = fsname(name)
        if name == LAYOUT_XATTR:
            raise errno_error(errno.EINVAL, f"{LAYOUT_XATTR.decode()} cannot be removed; set the fields to change instead")
        self._write(self._change_xattr, caller, ino, name, None, XATTR_REPLACE)

    def _change_xattr(self, tr: Transaction, caller: Caller, ino: int, name: bytes, value: bytes | None, flags: int) -> None:
        inode = self._xattr_target(tr, caller, ino, name, W_OK)
        key = schema.xattr(ino, name)
        exists = tr.get(key) is not None
        if flags & XATTR_CREATE and exists:
            raise errno_error(errno.EEXIST, repr(name))
        if flags & XATTR_REPLACE and not exists:
            raise errno_error(errno.ENODATA, repr(name))
        if value is None:
            tr.clear(key)
        else:
            tr.set(key, value)
        self._touch(inode, mtime=False)
        put_inode(tr, inode)

    def listxattr(self, caller: Caller, ino: int) -> list[bytes]:
        """Names the caller may see (trusted.* only for root)."""
        def fn(tr: Transaction) -> list[bytes]:
            get_inode(tr, ino)
            names = [unpack(k)[-1] for k, _ in tr.get_range(*schema.xattr_range(ino))]
            return [n for n in names if caller.uid == 0 or not n.startswith(b"trusted.")]

        return self.db.run(fn)

    def create(self, caller: Caller, parent: int, name: bytes | str, mode: int, flags: int = os.O_RDWR) -> Opened:
        """open(O_CREAT): create a regular file, or open the existing one unless ``O_EXCL``.
        Opening for writing starts a write session (see :meth:`close`)."""
        return self._create_op(self._create, caller, parent, name, mode, flags)

    def _create(self, tr: Transaction, caller: Caller, parent: int, name: bytes, ino: int, mode: int, flags: int) -> Opened:
        self._dir(tr, caller, parent)
        entry = get_entry(tr, parent, name)
        if entry is not None:
            if flags & os.O_EXCL:
                raise errno_error(errno.EEXIST, repr(name))
            return self._open(tr, caller, entry.ino, flags & ~os.O_CREAT)
        inode = self._make(tr, caller, parent, name, stat.S_IFREG | (mode & 0o7777), ino,
                           written=bool(open_wants(flags) & W_OK))
        session = self._sessions.start(tr, caller, inode, flags)
        return Opened(inode.attr, session, inode.layout, get_inode(tr, parent).attr)

    def open(self, caller: Caller, ino: int, flags: int, hold: bool = False) -> Opened:
        """Check access for ``flags``; ``O_TRUNC`` truncates; opening a regular file for writing
        starts a write session that keeps its chunks alive until :meth:`close`. ``hold``: a read-only open of a
        regular file gets a hold session (``Opened.hold``), which keeps the file readable after its last name
        goes, as POSIX wants, until it is closed the same way (or its client's lease lapses)."""
        return self._write(self._open, caller, ino, flags, hold)

    def _open(self, tr: Transaction, caller: Caller, ino: int, flags: int, hold: bool = False) -> Opened:
        inode = get_live(tr, ino)
        wants = open_wants(flags)
        if flags & os.O_TRUNC:
            wants |= W_OK
        if is_dir(inode) and wants & W_OK:
            raise errno_error(errno.EISDIR, f"inode {ino}")
        if stat.S_ISLNK(inode.attr.mode):
            raise errno_error(errno.ELOOP, f"inode {ino} is a symlink")
        require_access(caller, inode.attr, wants)
        if flags & os.O_TRUNC and stat.S_ISREG(inode.attr.mode):
            inode.attr.size = 0
            kill_suid(caller, inode.attr)
            self._touch(inode)
            put_inode(tr, inode)
        session = self._sessions.start(tr, caller, inode, flags)
        held = None
        if hold and session is None and stat.S_ISREG(inode.attr.mode):
            held = self._sessions.hold(tr, caller, inode.attr.ino)
        return Opened(inode.attr, session, inode.layout, hold=held)

    def report_length(self, caller: Caller, ino: int, session: int, end_offset: int, *,
                      mtime: TimeSpec = "now") -> Attr:
        """A writer wrote up to ``end_offset``: the length becomes the max of both, mtime is
        updated, and an unprivileged writer clears the set-id bits."""
        def fn(tr: Transaction) -> Attr:
            inode = self._sessions.writer_inode(tr, ino, session)
            attr = inode.attr
            attr.size = max(attr.size, end_offset)
            now = self._clock()
            attr.mtime_ns = pick_time(mtime, now, attr.mtime_ns)
            attr.ctime_ns = now
            kill_suid(caller, attr)
            put_inode(tr, inode)
            return attr

        return self.db.run(fn)

    def set_length(self, caller: Caller, ino: int, session: int, length: int) -> Attr:
        """The exact length the writer knows (fsync/close), possibly shorter than reported maxima."""
        def fn(tr: Transaction) -> Attr:
            inode = self._sessions.writer_inode(tr, ino, session)
            inode.attr.size = length
            self._touch(inode, mtime=False)
            put_inode(tr, inode)
            return inode.attr

        return self.db.run(fn)

    def close(self, caller: Caller, ino: int, session: int | None, exact_length: int | None = None) -> Attr:
        """End a session, a write session or a hold (idempotent, so a retried close is harmless), optionally
        fixing the exact length first (write sessions only). An unlinked file's chunks become collectable when its
        last session closes."""
        def fn(tr: Transaction) -> Attr:
            inode = get_inode(tr, ino)
            if session is not None:
                self._sessions.end(tr, inode, session, exact_length)
            return inode.attr

        return self._write(fn)

    def close_sessions(self, caller: Caller, sessions: list[tuple[int, int, int | None]]) -> int:
        """:meth:`close` of many ``(ino, session, exact_length)`` in one transaction: a mount ending the
        sessions of many small files sends them together instead of a round trip each. Sessions already
        ended (a retry) and inodes already gone are skipped; returns how many sessions this call ended."""
        def fn(tr: Transaction) -> int:
            ended = 0
            for ino, session, exact_length in sessions:
                raw = tr.get(schema.inode(ino))
                if raw is not None:
                    ended += self._sessions.end(tr, decode_inode(raw), session, exact_length)
            return ended

        return self.db.run(fn)

    def delegate(self, caller: Caller, directory: int, epoch: int = 0) -> Delegated:
        """Grant ``directory`` to the calling client (meta/delegation.py), or with ``epoch`` renew that grant and
        hand it another block of inode ids. Not granted (no error) while another client holds it, when it has more
        than MAX_DELEGATED_NAMES names, or when the renewed grant has lapsed. Needs write and search permission
        on the directory, and a client id."""
        if not caller.client:
            raise errno_error(errno.EINVAL, "a delegation needs a client id")
        try:
            return self._write(self._delegate, caller, directory, epoch)
        except DelegationHeld:
            return Delegated(False)

    def _delegate(self, tr: Transaction, caller: Caller, directory: int, epoch: int) -> Delegated:
        pdir = self._dir(tr, caller, directory, W_OK | X_OK)
        return self._delegations.grant(tr, caller, pdir, self._layout(pdir), epoch)

    def undelegate(self, caller: Caller, directories: list[int]) -> int:
        """Give back the calling client's delegations of ``directories`` (after sending every change made under
        them); returns how many it held. Idempotent."""
        return self._delegations.give_back(caller, directories)

    def apply_delegated(self, caller: Caller, directory: int, epoch: int, ops: list[DirOp]) -> list[int]:
        """Apply, in order and in one transaction, changes the calling client made in ``directory`` under grant
        ``epoch`` and already answered; renews the grant. Returns an errno per change (0: applied, also by an
        earlier try of the same batch, so a client may send a batch again after losing an answer); a change that
        fails changes nothing. ENOLCK, with nothing applied, when the client no longer holds that grant: it gave it
        back, or it lapsed and another client has used the directory since (which broke it)."""
        if not caller.client:
            raise errno_error(errno.EINVAL, "a delegation needs a client id")
        return self._write(self._apply_delegated, caller, directory, epoch, ops)

    def _apply_delegated(self, tr: Transaction, caller: Caller, directory: int, epoch: int,
                         ops: list[DirOp]) -> list[int]:
        held = self._delegations.claim(tr, caller, directory, epoch)
        pdir = get_live(tr, directory)  # loaded once and stored once for the whole batch
        results = []
        for op in ops:
            who = msgspec.structs.replace(op.who, client=caller.client)  # its sessions live on the holder's lease
            token = HOLDER_TIME.set(op.time_ns)
            try:
                if isinstance(op, CreateOp):
                    self._delegated_create(tr, who, pdir, held, op)
                elif (entry := get_entry(tr, directory, check_name(op.name))) is not None:
                    # (none: removed by an earlier try of this batch)
                    if entry.ino != op.ino:
                        raise errno_error(errno.ENOENT, f"{op.name!r} is not inode {op.ino}")
                    self._remove(tr, who, directory, op.name, False, parent_inode=pdir)
                results.append(0)
            except KvfsError as exc:  # raised before the change wrote anything
                results.append(exc.errno or errno.EIO)
            finally:
                HOLDER_TIME.reset(token)
        if any(code == 0 for code in results):
            put_inode(tr, pdir)
        return results

    def _delegated_create(self, tr: Transaction, who: Caller, pdir: Inode, held: Delegation, op: CreateOp) -> None:
        if not any(first <= op.ino < first + ID_BLOCK for first in held.blocks):
            raise errno_error(errno.EINVAL, f"inode id {op.ino} was not handed to this delegation")
        name = check_name(op.name)
        raw = tr.get(schema.inode(op.ino))
        if raw is not None:  # made by an earlier try of this batch (and perhaps removed again), or misused
            entry = get_entry(tr, pdir.attr.ino, name)
            if decode_inode(raw).attr.nlink == 0 or (entry is not None and entry.ino == op.ino):
                return
            raise errno_error(errno.EINVAL, f"inode id {op.ino} is in use")
        if msgspec.structs.replace(self._layout(pdir), seed=op.layout.seed) != op.layout:
            raise errno_error(errno.ESTALE, f"directory {pdir.attr.ino} gives new files another layout than {op.layout}")
        inode = self._make(tr, who, pdir.attr.ino, name, stat.S_IFREG | (op.mode & 0o7777), op.ino,
                           seed=op.layout.seed, parent_inode=pdir, written=op.session is not None)
        if op.session is not None:  # None: the holder ended it before sending the create (nothing was written)
            self._sessions.start(tr, who, inode, op.flags, sid=op.session)
