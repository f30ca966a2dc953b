"""POSIX metadata over the transactional KV store: one KV transaction per operation.

Methods are synchronous: the RPC service calls them through ``trio.to_thread.run_sync``.  Each
takes the :class:`Caller` first, checks POSIX permissions for it and raises :class:`KvfsError`
with the errno a kernel would give.  Operations are inode based like FUSE's low-level API
(``parent`` inode + ``name``); :meth:`MetaStore.resolve` walks whole paths for callers that
bypass the kernel.  Names are bytes (any byte but ``/`` and NUL); ``str`` is accepted and
encoded with UTF-8/surrogateescape like ``os.fsencode``.

readdir returns real entries only: "." and ".." are the FUSE layer's business.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import itertools
import os
import random
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

import msgspec

from kvfs.errors import KvfsError
from kvfs.kv import Database, Transaction
from kvfs.kv.base import STAMP_BYTES
from kvfs.kv.keys import decode_int, encode_int, key_after, unpack
from kvfs.meta import schema
from kvfs.meta.chunks import ChunkRemover
from kvfs.meta.delegation import BLOCKS_KEPT, DELEGATION_SECONDS, MAX_DELEGATED_NAMES, DelegationHeld
from kvfs.meta.feed import ORIGIN, FeedDatabase, decode_change, stamp_of
from kvfs.meta.posix import (
    LAYOUT_XATTR, LINK_MAX, NAME_MAX, PATH_MAX, R_OK, RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO, SYMLOOP_MAX,
    W_OK, X_OK, XATTR_CREATE, XATTR_NAME_MAX, XATTR_REPLACE, XATTR_SIZE_MAX, blocks, check_name, child_attr,
    errno_error, fsname, is_dir, kill_suid, open_wants, pick_time, require_access, require_owner, require_sticky,
)
from kvfs.meta.types import ID_BLOCK, ID_SHARDS
from .types import (Attr, Caller, Change, ChangePage, CreateOp, Delegated, Delegation, DirEntry, DirOp, DirPage, Entry,
                    Inode, Layout, Opened, Session, StatFs, TimeSpec)

_GC_SCAN_FACTOR = 16  # queued inodes gc_once looks at per inode it may collect
"""Virtual xattr (not listed, not stored as one) that shows an inode's layout and sets a directory's."""
_FIRST_ID = ROOT_INO + 1
#: How long an answer to a non-idempotent request is kept for retries of it (clients retry for ~30 s).
ANSWER_MINUTES = 10
#: How long change-feed records are kept: a mount cut off from meta for longer drops its caches when it is back.
FEED_SECONDS = 120.0


class _Once(msgspec.Struct):
    op_id: bytes
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    retry: bool


_ONCE: contextvars.ContextVar[_Once | None] = contextvars.ContextVar("kvfs_meta_once", default=None)
#: The time a delegated change was made at (its holder's clock): what meta applies it with, instead of its own.
_NOW: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvfs_meta_now", default=None)

_enc = msgspec.msgpack.Encoder()
_dec_inode = msgspec.msgpack.Decoder(Inode)
_dec_entry = msgspec.msgpack.Decoder(DirEntry)
_dec_session = msgspec.msgpack.Decoder(Session)
_dec_delegation = msgspec.msgpack.Decoder(Delegation)

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
        self._remover = chunk_remover
        self._space = space
        self._root_layout = root_layout
        self._clock = clock
        self._client_lease_ns = int(client_lease * 1e9)
        self._delegation_ns = int(delegation_lease * 1e9)
        self._ids: list[int] = []
        self._id_lock = threading.Lock()

    # ------------------------------------------------------------------ records -----------
    def _inode(self, tr: Transaction, ino: int) -> Inode:
        raw = tr.get(schema.inode(ino))
        if raw is None:
            raise errno_error(errno.ENOENT, f"inode {ino}")
        return _dec_inode.decode(raw)

    def _live(self, tr: Transaction, ino: int) -> Inode:
        """An inode that still has a name (unlinked-but-open files cannot gain new users)."""
        inode = self._inode(tr, ino)
        if inode.attr.nlink == 0:
            raise errno_error(errno.ENOENT, f"inode {ino} was removed")
        return inode

    def _put(self, tr: Transaction, inode: Inode) -> None:
        inode.attr.blocks = blocks(inode.attr.size)
        tr.set(schema.inode(inode.attr.ino), _enc.encode(inode))

    def _dir(self, tr: Transaction, caller: Caller, ino: int, want: int = X_OK) -> Inode:
        """A live directory the caller has ``want`` access to (search by default), not delegated to another client."""
        inode = self._live(tr, ino)
        if not is_dir(inode):
            raise errno_error(errno.ENOTDIR, f"inode {ino}")
        self._check_delegation(tr, caller, ino)
        require_access(caller, inode.attr, want)
        return inode

    def _check_delegation(self, tr: Transaction, caller: Caller, directory: int) -> None:
        """Raise :class:`DelegationHeld` if another client holds ``directory``: it may have answered changes there
        that meta has not seen yet (meta/delegation.py)."""
        raw = tr.get(schema.delegation(directory))
        if raw is None:
            return
        held = _dec_delegation.decode(raw)
        if caller.client and held.client == caller.client:
            return
        # a lapsed one is broken first (break_lapsed, its own transaction), so its holder's late changes cannot
        # follow what this caller sees
        raise DelegationHeld(directory, lapsed=held.expires_ns <= self._clock())

    def _now(self) -> int:
        """The time a change happens at: the holder's, for a delegated change (see :meth:`apply_delegated`)."""
        held = _NOW.get()
        return self._clock() if held is None else held

    def _entry(self, tr: Transaction, parent: int, name: bytes) -> DirEntry | None:
        raw = tr.get(schema.dentry(parent, name))
        return None if raw is None else _dec_entry.decode(raw)

    def _child(self, tr: Transaction, parent: int, name: bytes) -> tuple[DirEntry, Inode]:
        entry = self._entry(tr, parent, name)
        if entry is None:
            raise errno_error(errno.ENOENT, repr(name))
        return entry, self._inode(tr, entry.ino)

    def _link_entry(self, tr: Transaction, parent: int, name: bytes, inode: Inode) -> None:
        tr.set(schema.dentry(parent, name), _enc.encode(DirEntry(inode.attr.ino, stat.S_IFMT(inode.attr.mode))))

    def _sessions(self, tr: Transaction, ino: int, snapshot: bool = False) -> bool:
        return bool(tr.get_range(*schema.session_range(ino), limit=1, snapshot=snapshot))

    def _touch(self, *inodes: Inode, mtime: bool = True) -> None:
        now = self._now()
        for inode in inodes:
            inode.attr.ctime_ns = now
            if mtime:
                inode.attr.mtime_ns = now

    def _drop_link(self, tr: Transaction, inode: Inode) -> None:
        """Remove one name of ``inode``.  A regular file's last link queues it for chunk GC (the
        record stays while sessions are open, holds of read-only opens included); anything else goes now, and so
        does a file that never had a write session (``written``: no chunk server holds any of it) and is not open,
        so that a loop that creates and removes files leaves the collector no work to compete with its next
        creates."""
        inode.attr.nlink = 0 if is_dir(inode) else inode.attr.nlink - 1
        self._touch(inode, mtime=False)
        if inode.attr.nlink > 0 or (
            stat.S_ISREG(inode.attr.mode) and (inode.written or self._sessions(tr, inode.attr.ino))
        ):
            self._put(tr, inode)
            if inode.attr.nlink == 0:
                tr.set(schema.gc(inode.attr.ino), b"")
            return
        if is_dir(inode):
            tr.clear(schema.delegation(inode.attr.ino))  # held by its remover, if by anyone (see _remove)
        self._delete_inode(tr, inode.attr.ino)

    def _delete_inode(self, tr: Transaction, ino: int) -> None:
        tr.clear(schema.inode(ino))
        tr.clear_range(*schema.xattr_range(ino))
        tr.add(schema.INODE_COUNT, -1)

    # ------------------------------------------------------------------ exactly once --------
    @staticmethod
    @contextlib.contextmanager
    def answering_once(
        op_id: bytes, encode: Callable[[Any], bytes], decode: Callable[[bytes], Any], *, retry: bool = True
    ) -> Iterator[None]:
        """Run the operation called inside at most once for ``op_id``, however often it is retried.

        A client that loses its connection cannot know whether a create or rename ran; it retries with
        the same id. The operation's transaction also records its answer under the id, so a retry that
        finds the record returns that answer instead of running again (a create would say EEXIST, an
        unlink ENOENT). Failed operations record nothing: they changed nothing, so running them again is
        what the retry means. Records expire after ANSWER_MINUTES (:meth:`expire_answers`). ``retry=False``
        says this is the id's first try, which cannot have a record: it only records (no lookups)."""
        token = _ONCE.set(_Once(op_id, encode, decode, retry))
        try:
            yield
        finally:
            _ONCE.reset(token)

    def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``db.run`` for the transaction of a non-idempotent operation (see :meth:`answering_once`)."""
        once = _ONCE.get()
        if once is None:
            return self.db.run(fn, *args)

        def run_once(tr: Transaction, *args: Any) -> Any:
            minute = int(time.time() // 60)
            for m in range(minute, minute - 3, -1) if once.retry else ():  # retries come within 1-2 minutes
                raw = tr.get(schema.answer(m, once.op_id))
                if raw is not None:
                    return once.decode(raw)
            result = fn(tr, *args)
            tr.set(schema.answer(minute, once.op_id), once.encode(result))
            return result

        return self.db.run(run_once, *args)

    def expire_answers(self) -> None:
        """Drop answers recorded more than ANSWER_MINUTES ago (one range clear)."""
        minute = int(time.time() // 60)
        self.db.run(lambda tr: tr.clear_range(*schema.answers_before(minute - ANSWER_MINUTES)))

    # ------------------------------------------------------------------ ids ---------------
    def _next_ino(self) -> int:
        """A never-used inode id.  Ids come in blocks of ID_BLOCK reserved in one small
        transaction on a random one of ID_SHARDS counters, so creating instances rarely conflict;
        block ``n`` of shard ``s`` is ids ``[2 + (n*ID_SHARDS + s)*ID_BLOCK, +ID_BLOCK)``."""
        with self._id_lock:
            if not self._ids:
                start = self.db.run(self._reserve_block, random.randrange(ID_SHARDS))
                self._ids = list(range(start + ID_BLOCK - 1, start - 1, -1))
            return self._ids.pop()

    @staticmethod
    def _reserve_block(tr: Transaction, shard: int) -> int:
        key = schema.counter(shard)
        n = decode_int(tr.get(key))
        tr.set(key, encode_int(n + 1))
        return _FIRST_ID + (n * ID_SHARDS + shard) * ID_BLOCK

    # ------------------------------------------------------------------ format ------------
    def format(self, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Attr:
        """Create the root directory (inode 1) unless it exists; safe to call from every instance."""
        return self.db.run(self._format, mode, uid, gid)

    ensure_root = format

    def _format(self, tr: Transaction, mode: int, uid: int, gid: int) -> Attr:
        raw = tr.get(schema.inode(ROOT_INO))
        if raw is not None:
            return _dec_inode.decode(raw).attr
        now = self._clock()
        attr = Attr(ROOT_INO, stat.S_IFDIR | (mode & 0o7777), 2, uid, gid, 0, now, now, now,
                    blksize=self._root_layout.chunk_size)
        root = Inode(attr, parent=ROOT_INO, layout=self._root_layout)
        self._put(tr, root)
        tr.set(schema.FORMAT, b"1")
        tr.add(schema.INODE_COUNT, 1)
        return attr

    # ------------------------------------------------------------------ lookups -----------
    def lookup(self, caller: Caller, parent: int, name: bytes | str) -> Attr:
        return self.db.run(self._lookup, caller, parent, fsname(name))

    def _lookup(self, tr: Transaction, caller: Caller, parent: int, name: bytes) -> Attr:
        pdir = self._dir(tr, caller, parent)
        if name == b".":
            return pdir.attr
        if name == b"..":
            return self._inode(tr, pdir.parent).attr
        if len(name) > NAME_MAX:
            raise errno_error(errno.ENAMETOOLONG, repr(name[:32]))
        return self._child(tr, parent, name)[1].attr

    def getattr(self, caller: Caller, ino: int) -> Attr:
        """Attributes of any existing inode (stat needs no permission on the file itself)."""
        return self.db.run(self._getattr, caller, ino)

    def _getattr(self, tr: Transaction, caller: Caller, ino: int) -> Attr:
        inode = self._inode(tr, ino)
        if is_dir(inode):  # its times (and link count) follow changes a delegation's holder may not have sent
            self._check_delegation(tr, caller, ino)
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

    def resolve(self, caller: Caller, path: bytes | str, *, follow: bool = True) -> Attr:
        """Walk an absolute path from the root with search checks on every directory, following
        symlinks in the middle (and at the end if ``follow``); ELOOP after SYMLOOP_MAX of them."""
        return self.db.run(self._resolve, caller, fsname(path), follow)

    def _resolve(self, tr: Transaction, caller: Caller, path: bytes, follow: bool) -> Attr:
        if len(path) > PATH_MAX:
            raise errno_error(errno.ENAMETOOLONG, "path")
        parts = [p for p in path.split(b"/") if p]
        cur = self._inode(tr, ROOT_INO)
        hops = 0
        while parts:
            name = parts.pop(0)
            attr = self._lookup(tr, caller, cur.attr.ino, name)
            node = self._inode(tr, attr.ino)
            if stat.S_ISLNK(attr.mode) and (parts or follow):
                hops += 1
                if hops > SYMLOOP_MAX:
                    raise errno_error(errno.ELOOP, repr(path))
                target = node.target or b""
                parts = [p for p in target.split(b"/") if p] + parts
                if target.startswith(b"/"):
                    cur = self._inode(tr, ROOT_INO)
                continue
            cur = node
        return cur.attr

    # ------------------------------------------------------------------ setattr -----------
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
        inode = self._inode(tr, ino)
        if is_dir(inode):
            self._check_delegation(tr, caller, ino)
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
        self._put(tr, inode)
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

    # ------------------------------------------------------------------ create ------------
    def _make(self, tr: Transaction, caller: Caller, parent: int, name: bytes, mode: int, ino: int,
              *, rdev: int = 0, target: bytes | None = None, seed: int | None = None,
              parent_inode: Inode | None = None, written: bool = False) -> Inode:
        """Create inode ``ino`` named ``name`` in ``parent``: owner is the caller, the group and
        (for directories) the setgid bit come from a setgid parent, layout is the parent's
        (regular files get their own random seed). ``parent_inode``: the directory, loaded by a caller that makes
        several changes in it and stores it once at the end. ``written``: a write session starts with it."""
        pdir = parent_inode or self._dir(tr, caller, parent)
        if self._entry(tr, parent, name) is not None:
            raise errno_error(errno.EEXIST, repr(name))
        require_access(caller, pdir.attr, W_OK | X_OK)
        is_dir = stat.S_ISDIR(mode)
        if is_dir and pdir.attr.nlink >= LINK_MAX:
            raise errno_error(errno.EMLINK, f"inode {parent}")
        attr, layout = child_attr(caller, pdir.attr, pdir.layout or self._root_layout, mode, ino, self._now(),
                                  rdev=rdev, target=target, seed=seed)
        inode = Inode(attr, parent=parent if is_dir else 0, layout=layout, target=target, written=written)
        self._put(tr, inode)
        self._link_entry(tr, parent, name, inode)
        if is_dir:
            pdir.attr.nlink += 1
        self._touch(pdir)
        if parent_inode is None:
            self._put(tr, pdir)
        tr.add(schema.INODE_COUNT, 1)
        return inode

    def _create_op(self, fn: Callable[..., Any], caller: Caller, parent: int, name: bytes | str, *args: Any) -> Any:
        return self._write(fn, caller, parent, check_name(name), self._next_ino(), *args)

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

    def readlink(self, caller: Caller, ino: int) -> bytes:
        inode = self.db.run(self._inode, ino)
        if inode.target is None:
            raise errno_error(errno.EINVAL, f"inode {ino} is not a symlink")
        return inode.target

    def create(self, caller: Caller, parent: int, name: bytes | str, mode: int, flags: int = os.O_RDWR) -> Opened:
        """open(O_CREAT): create a regular file, or open the existing one unless ``O_EXCL``.
        Opening for writing starts a write session (see :meth:`close`)."""
        return self._create_op(self._create, caller, parent, name, mode, flags)

    def _create(self, tr: Transaction, caller: Caller, parent: int, name: bytes, ino: int, mode: int, flags: int) -> Opened:
        self._dir(tr, caller, parent)
        entry = self._entry(tr, parent, name)
        if entry is not None:
            if flags & os.O_EXCL:
                raise errno_error(errno.EEXIST, repr(name))
            return self._open(tr, caller, entry.ino, flags & ~os.O_CREAT)
        inode = self._make(tr, caller, parent, name, stat.S_IFREG | (mode & 0o7777), ino,
                           written=bool(open_wants(flags) & W_OK))
        session = self._start_session(tr, caller, inode, flags)
        return Opened(inode.attr, session, inode.layout, self._inode(tr, parent).attr)

    # ------------------------------------------------------------------ links -------------
    def link(self, caller: Caller, ino: int, newparent: int, newname: bytes | str) -> Attr:
        return self._write(self._link, caller, ino, newparent, check_name(newname))

    def _link(self, tr: Transaction, caller: Caller, ino: int, newparent: int, newname: bytes) -> Attr:
        inode = self._live(tr, ino)
        if is_dir(inode):
            raise errno_error(errno.EPERM, "hard link to a directory")
        if inode.attr.nlink >= LINK_MAX:
            raise errno_error(errno.EMLINK, f"inode {ino}")
        pdir = self._dir(tr, caller, newparent)
        if self._entry(tr, newparent, newname) is not None:
            raise errno_error(errno.EEXIST, repr(newname))
        require_access(caller, pdir.attr, W_OK | X_OK)
        inode.attr.nlink += 1
        self._touch(inode, mtime=False)
        self._touch(pdir)
        self._link_entry(tr, newparent, newname, inode)
        self._put(tr, inode)
        self._put(tr, pdir)
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
        _, inode = self._child(tr, parent, name)
        require_access(caller, pdir.attr, W_OK | X_OK)
        require_sticky(caller, pdir, inode)
        if want_dir:
            self._check_delegation(tr, caller, inode.attr.ino)  # its holder may have made names there
            self._check_empty_dir(tr, inode)
            pdir.attr.nlink -= 1
        elif is_dir(inode):
            raise errno_error(errno.EISDIR, repr(name))
        tr.clear(schema.dentry(parent, name))
        self._touch(pdir)
        if parent_inode is None:
            self._put(tr, pdir)
        self._drop_link(tr, inode)
        return pdir.attr

    def _check_empty_dir(self, tr: Transaction, inode: Inode) -> None:
        if not is_dir(inode):
            raise errno_error(errno.ENOTDIR, f"inode {inode.attr.ino}")
        if inode.attr.ino == ROOT_INO:
            raise errno_error(errno.EBUSY, "root")
        if tr.get_range(*schema.dir_range(inode.attr.ino), limit=1):
            raise errno_error(errno.ENOTEMPTY, f"inode {inode.attr.ino}")

    # ------------------------------------------------------------------ rename ------------
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
        sentry, src = self._child(tr, parent, name)
        dentry = self._entry(tr, newparent, newname)
        for d in (sdir, ddir):
            require_access(caller, d.attr, W_OK | X_OK)
        require_sticky(caller, sdir, src)
        dst = None
        if dentry is not None:
            if flags & RENAME_NOREPLACE:
                raise errno_error(errno.EEXIST, repr(newname))
            dst = self._inode(tr, dentry.ino)
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
            tr.set(schema.dentry(parent, name), _enc.encode(dentry))
            self._touch(dst, mtime=False)
            self._put(tr, dst)
        else:
            if dst is not None:
                if is_dir(src):
                    if is_dir(dst):
                        self._check_delegation(tr, caller, dst.attr.ino)
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
        tr.set(schema.dentry(newparent, newname), _enc.encode(sentry))
        self._touch(src, mtime=False)
        self._touch(sdir, ddir)
        self._put(tr, src)
        self._put(tr, sdir)
        self._put(tr, ddir)

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
            ino = self._inode(tr, ino).parent
        require_access(caller, node.attr, W_OK)
        if new.attr.nlink >= LINK_MAX:
            raise errno_error(errno.EMLINK, f"inode {new.attr.ino}")

    @staticmethod
    def _move(old: Inode, new: Inode, node: Inode) -> None:
        if is_dir(node):
            node.parent = new.attr.ino
            old.attr.nlink -= 1
            new.attr.nlink += 1

    # ------------------------------------------------------------------ readdir -----------
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
            entries.append(Entry(name, self._inode(tr, _dec_entry.decode(raw).ino).attr))
        return DirPage(entries, entries[-1].name if entries else cookie, len(rows) <= limit)

    # ------------------------------------------------------------------ statfs ------------
    def statfs(self, caller: Caller) -> StatFs:
        files = self.db.run(lambda tr: decode_int(tr.get(schema.INODE_COUNT, snapshot=True)))
        total, free = self._space() if self._space else (1 << 50, 1 << 50)
        bsize = 4096
        return StatFs(bsize, bsize, total // bsize, free // bsize, free // bsize, files, (1 << 48) - files, NAME_MAX)

    # ------------------------------------------------------------------ xattrs ------------
    def _xattr_target(self, tr: Transaction, caller: Caller, ino: int, name: bytes, want: int) -> Inode:
        """Namespace and permission rules: user.* follows the file's mode bits (and only regular
        files and directories carry them), trusted.* is root's, writing security.* needs root,
        system.* (POSIX ACLs) is not supported."""
        if not name or len(name) > XATTR_NAME_MAX:
            raise errno_error(errno.ERANGE, "xattr name length")
        inode = self._inode(tr, ino)
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
            inode = self.db.run(self._inode, ino)
            return (inode.layout or self._root_layout).describe(with_seed=not is_dir(inode))
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
        self._put(tr, inode)

    def listxattr(self, caller: Caller, ino: int) -> list[bytes]:
        """Names the caller may see (trusted.* only for root)."""
        def fn(tr: Transaction) -> list[bytes]:
            self._inode(tr, ino)
            names = [unpack(k)[-1] for k, _ in tr.get_range(*schema.xattr_range(ino))]
            return [n for n in names if caller.uid == 0 or not n.startswith(b"trusted.")]

        return self.db.run(fn)

    # ------------------------------------------------------------------ layouts -----------
    def get_layout(self, caller: Caller, ino: int) -> Layout:
        """A file's layout, or the layout a directory gives its new children."""
        inode = self.db.run(self._inode, ino)
        return inode.layout or self._root_layout

    def set_layout(self, caller: Caller, ino: int, layout: Layout) -> None:
        """Set what new children of directory ``ino`` inherit (owner or root only)."""
        cs = layout.chunk_size
        if cs & (cs - 1) or not 64 * 1024 <= cs <= 64 * 1024 * 1024:
            raise errno_error(errno.EINVAL, f"chunk_size {cs} is not a power of two from 64 KiB to 64 MiB")
        if layout.stripe < 1 or layout.chain_table < 0:
            raise errno_error(errno.EINVAL, f"layout {layout}: stripe must be at least 1")

        def fn(tr: Transaction) -> None:
            inode = self._inode(tr, ino)
            if not is_dir(inode):
                raise errno_error(errno.ENOTDIR, f"inode {ino}")
            self._check_delegation(tr, caller, ino)  # its holder gives new files the layout it has now
            require_owner(caller, inode.attr)
            inode.layout = layout
            self._touch(inode, mtime=False)
            self._put(tr, inode)

        self._write(fn)

    # ------------------------------------------------------------------ sessions ----------
    def open(self, caller: Caller, ino: int, flags: int, hold: bool = False) -> Opened:
        """Check access for ``flags``; ``O_TRUNC`` truncates; opening a regular file for writing
        starts a write session that keeps its chunks alive until :meth:`close`. ``hold``: a read-only open of a
        regular file gets a hold session (``Opened.hold``), which keeps the file readable after its last name
        goes, as POSIX wants, until it is closed the same way (or its client's lease lapses)."""
        return self._write(self._open, caller, ino, flags, hold)

    def _open(self, tr: Transaction, caller: Caller, ino: int, flags: int, hold: bool = False) -> Opened:
        inode = self._live(tr, ino)
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
            self._put(tr, inode)
        session = self._start_session(tr, caller, inode, flags)
        held = None
        if hold and session is None and stat.S_ISREG(inode.attr.mode):
            held = self._add_session(tr, caller, inode.attr.ino, secrets.randbits(63), hold=True)
        return Opened(inode.attr, session, inode.layout, hold=held)

    def _start_session(self, tr: Transaction, caller: Caller, inode: Inode, flags: int,
                       sid: int | None = None) -> int | None:
        if not (open_wants(flags) & W_OK and stat.S_ISREG(inode.attr.mode)):
            return None
        if not inode.written:  # its chunks may exist from now on: the collector must look for them
            inode.written = True
            self._put(tr, inode)
        return self._add_session(tr, caller, inode.attr.ino, secrets.randbits(63) if sid is None else sid)

    def _add_session(self, tr: Transaction, caller: Caller, ino: int, sid: int, *, hold: bool = False) -> int:
        now = self._clock()
        tr.set(schema.session(ino, sid), _enc.encode(Session(caller.uid, caller.pid, now, caller.client, hold)))
        if caller.client:
            tr.set(schema.owned_session(caller.client, ino, sid), b"")
            tr.set(schema.client(caller.client), encode_int(now))  # a session start renews the lease
        return sid

    def _session_inode(self, tr: Transaction, ino: int, session: int) -> Inode:
        raw = tr.get(schema.session(ino, session))
        if raw is None or _dec_session.decode(raw).hold:
            raise errno_error(errno.EBADF, f"no write session {session} on inode {ino}")
        return self._inode(tr, ino)

    def report_length(self, caller: Caller, ino: int, session: int, end_offset: int, *,
                      mtime: TimeSpec = "now") -> Attr:
        """A writer wrote up to ``end_offset``: the length becomes the max of both, mtime is
        updated, and an unprivileged writer clears the set-id bits."""
        def fn(tr: Transaction) -> Attr:
            inode = self._session_inode(tr, ino, session)
            attr = inode.attr
            attr.size = max(attr.size, end_offset)
            now = self._clock()
            attr.mtime_ns = pick_time(mtime, now, attr.mtime_ns)
            attr.ctime_ns = now
            kill_suid(caller, attr)
            self._put(tr, inode)
            return attr

        return self.db.run(fn)

    def set_length(self, caller: Caller, ino: int, session: int, length: int) -> Attr:
        """The exact length the writer knows (fsync/close), possibly shorter than reported maxima."""
        def fn(tr: Transaction) -> Attr:
            inode = self._session_inode(tr, ino, session)
            inode.attr.size = length
            self._touch(inode, mtime=False)
            self._put(tr, inode)
            return inode.attr

        return self.db.run(fn)

    def close(self, caller: Caller, ino: int, session: int | None, exact_length: int | None = None) -> Attr:
        """End a session, a write session or a hold (idempotent, so a retried close is harmless), optionally
        fixing the exact length first (write sessions only). An unlinked file's chunks become collectable when its
        last session closes."""
        def fn(tr: Transaction) -> Attr:
            inode = self._inode(tr, ino)
            if session is not None:
                self._end_session(tr, inode, session, exact_length)
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
                    ended += self._end_session(tr, _dec_inode.decode(raw), session, exact_length)
            return ended

        return self.db.run(fn)

    def _end_session(self, tr: Transaction, inode: Inode, session: int, exact_length: int | None) -> bool:
        key = schema.session(inode.attr.ino, session)
        raw = tr.get(key)
        if raw is None:
            return False
        record = _dec_session.decode(raw)
        if record.hold and exact_length is not None:  # a read-only open may not set the length
            raise errno_error(errno.EBADF, f"session {session} on inode {inode.attr.ino} is a read-only open's")
        tr.clear(key)
        if record.client:
            tr.clear(schema.owned_session(record.client, inode.attr.ino, session))
        if exact_length is not None:
            inode.attr.size = exact_length
            self._touch(inode, mtime=False)
            self._put(tr, inode)
        return True

    # ------------------------------------------------------------------ delegations -------
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
        key = schema.delegation(directory)
        raw = tr.get(key)
        held = None if raw is None else _dec_delegation.decode(raw)
        now = self._clock()
        lease = self._delegation_ns / 1e9
        if epoch:
            if held is None or held.client != caller.client or held.epoch != epoch:
                return Delegated(False)
            ids = self._reserve_block(tr, random.randrange(ID_SHARDS))
            blocks = (held.blocks + [ids])[-BLOCKS_KEPT:]
            tr.set(key, _enc.encode(Delegation(caller.client, epoch, now + self._delegation_ns, blocks)))
            return Delegated(True, epoch, lease, ids)
        rows = tr.get_range(*schema.dir_range(directory), limit=MAX_DELEGATED_NAMES + 1)
        if len(rows) > MAX_DELEGATED_NAMES:
            return Delegated(False)
        ids = self._reserve_block(tr, random.randrange(ID_SHARDS))
        epoch = secrets.randbits(62) + 1
        tr.set(key, _enc.encode(Delegation(caller.client, epoch, now + self._delegation_ns, [ids])))
        return Delegated(True, epoch, lease, ids, pdir.attr, pdir.layout or self._root_layout,
                         [unpack(k)[-1] for k, _ in rows])

    def undelegate(self, caller: Caller, directories: list[int]) -> int:
        """Give back the calling client's delegations of ``directories`` (after sending every change made under
        them); returns how many it held. Idempotent."""
        def fn(tr: Transaction) -> int:
            released = 0
            for directory in directories:
                key = schema.delegation(directory)
                raw = tr.get(key)
                if raw is not None and caller.client and _dec_delegation.decode(raw).client == caller.client:
                    tr.clear(key)
                    released += 1
            return released

        return self.db.run(fn)

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
        key = schema.delegation(directory)
        raw = tr.get(key)
        held = None if raw is None else _dec_delegation.decode(raw)
        now = self._clock()
        if held is None or held.client != caller.client or held.epoch != epoch:
            raise errno_error(errno.ENOLCK, f"the delegation of directory {directory} was given back, or lapsed and "
                                     f"another client used the directory since")
        tr.set(key, _enc.encode(Delegation(held.client, epoch, now + self._delegation_ns, held.blocks)))
        pdir = self._live(tr, directory)  # loaded once and stored once for the whole batch
        results = []
        for op in ops:
            who = msgspec.structs.replace(op.who, client=caller.client)  # its sessions live on the holder's lease
            token = _NOW.set(op.time_ns)
            try:
                if isinstance(op, CreateOp):
                    self._delegated_create(tr, who, pdir, held, op)
                elif (entry := self._entry(tr, directory, check_name(op.name))) is not None:
                    # (none: removed by an earlier try of this batch)
                    if entry.ino != op.ino:
                        raise errno_error(errno.ENOENT, f"{op.name!r} is not inode {op.ino}")
                    self._remove(tr, who, directory, op.name, False, parent_inode=pdir)
                results.append(0)
            except KvfsError as exc:  # raised before the change wrote anything
                results.append(exc.errno or errno.EIO)
            finally:
                _NOW.reset(token)
        if any(code == 0 for code in results):
            self._put(tr, pdir)
        return results

    def _delegated_create(self, tr: Transaction, who: Caller, pdir: Inode, held: Delegation, op: CreateOp) -> None:
        if not any(first <= op.ino < first + ID_BLOCK for first in held.blocks):
            raise errno_error(errno.EINVAL, f"inode id {op.ino} was not handed to this delegation")
        name = check_name(op.name)
        raw = tr.get(schema.inode(op.ino))
        if raw is not None:  # made by an earlier try of this batch (and perhaps removed again), or misused
            entry = self._entry(tr, pdir.attr.ino, name)
            if _dec_inode.decode(raw).attr.nlink == 0 or (entry is not None and entry.ino == op.ino):
                return
            raise errno_error(errno.EINVAL, f"inode id {op.ino} is in use")
        if msgspec.structs.replace(pdir.layout or self._root_layout, seed=op.layout.seed) != op.layout:
            raise errno_error(errno.ESTALE, f"directory {pdir.attr.ino} gives new files another layout than {op.layout}")
        inode = self._make(tr, who, pdir.attr.ino, name, stat.S_IFREG | (op.mode & 0o7777), op.ino,
                           seed=op.layout.seed, parent_inode=pdir, written=op.session is not None)
        if op.session is not None:  # None: the holder ended it before sending the create (nothing was written)
            self._start_session(tr, who, inode, op.flags, sid=op.session)

    def recall(self, directory: int) -> None:
        """Ask the holder of ``directory`` to give it back: a feed record it follows (meta/delegation.py)."""
        self.db.publish(Change(ORIGIN.get(), self._clock(), [], [], [directory]))

    def break_lapsed(self, directory: int) -> None:
        """End ``directory``'s grant if it has lapsed: from now on its holder can apply nothing more under it."""
        def fn(tr: Transaction) -> None:
            raw = tr.get(schema.delegation(directory))
            if raw is not None and _dec_delegation.decode(raw).expires_ns <= self._clock():
                tr.clear(schema.delegation(directory))

        self.db.run(fn)

    def answer_held(self, held: DelegationHeld) -> None:
        """What meta does for a caller that found ``held``: break a lapsed grant, or recall a live one."""
        if held.lapsed:
            self.break_lapsed(held.directory)
        else:
            self.recall(held.directory)

    # ------------------------------------------------------------------ client leases -----
    def renew_client(self, caller: Caller) -> float:
        """The calling client is alive: its write sessions stay. Returns the lease in seconds: the client renews
        well within it (so it need not be configured on both sides)."""
        if caller.client:
            self.db.run(lambda tr: tr.set(schema.client(caller.client), encode_int(self._clock())))
        return self._client_lease_ns / 1e9

    def expire_clients(self, limit: int = 256) -> int:
        """End the write sessions of clients that have not renewed for the lease (crashed or cut off), so
        files they held open can be collected. Ends at most ``limit`` sessions per call; returns how many.

        A client cut off for longer than its lease finds its sessions gone when it comes back: its writes
        then fail (EBADF at the next length report) instead of holding removed files' space forever."""
        deadline = self._clock() - self._client_lease_ns

        def fn(tr: Transaction) -> int:
            ended = 0
            for key, value in tr.get_range(*schema.CLIENT_RANGE):
                if decode_int(value) >= deadline:
                    continue
                client_id = unpack(key)[-1]
                owned = tr.get_range(*schema.owned_range(client_id), limit=limit - ended)
                for owned_key, _ in owned:
                    _, _, _, ino, sid = unpack(owned_key)
                    tr.clear(owned_key)
                    tr.clear(schema.session(ino, sid))
                    ended += 1
                if ended >= limit:
                    break  # this client may own more: the next call goes on
                tr.clear(key)
            return ended

        return self.db.run(fn)

    # ------------------------------------------------------------------ GC ----------------
    @property
    def collects_chunks(self) -> bool:
        """Whether :meth:`gc_once` can run (the store was given a chunk remover)."""
        return self._remover is not None

    def gc_once(self, limit: int = 64) -> int:
        """Collect up to ``limit`` queued inodes without write sessions: remove their chunks, then
        their records.  Returns how many were collected.  Chunk removal runs outside any
        transaction (it is not retryable) and before the record goes, so a crash in between only
        repeats an idempotent removal; a queued inode cannot gain a new session (open refuses
        nlink 0), so nothing can start writing after the check."""
        if self._remover is None:
            raise KvfsError("gc_once needs a chunk_remover", errno.ENOSYS)

        def pending(tr: Transaction) -> list[tuple[int, bool]]:
            out = []  # queued files still open are passed over, so they cannot hold up the ones behind them
            for key, _ in tr.get_range(*schema.GC_RANGE, limit=limit * _GC_SCAN_FACTOR, snapshot=True):
                ino = unpack(key)[-1]
                raw = tr.get(schema.inode(ino), snapshot=True)
                if raw is not None and not self._sessions(tr, ino, snapshot=True):
                    out.append((ino, _dec_inode.decode(raw).written))
                    if len(out) == limit:
                        break
            return out

        found = self.db.run(pending)
        if not found:
            return 0
        with_chunks = [ino for ino, written in found if written]  # never written: no chunk server holds any
        if with_chunks:
            self._remover.remove_chunks(with_chunks)
        return self.db.run(self._gc_finish, [ino for ino, _ in found])

    def _gc_finish(self, tr: Transaction, inodes: list[int]) -> int:
        done = 0
        for ino in inodes:
            if tr.get(schema.gc(ino)) is None or self._sessions(tr, ino):
                continue  # another instance finished it, or (never expected) a session appeared
            tr.clear(schema.gc(ino))
            self._delete_inode(tr, ino)
            done += 1
        return done

    # ------------------------------------------------------------------ change feed -------
    def changes(self, since: bytes = b"", *, limit: int = 1024, skip_client: bytes = b"") -> ChangePage:
        """The changes committed after cursor ``since`` (see :mod:`kvfs.meta.feed`), in commit order, at most ``limit``.

        An empty ``since`` starts at the feed's head: no changes, just the cursor to follow from. Changes made by
        ``skip_client`` are left out (a mount knows its own), but the cursor still moves past them."""
        return self.db.run(self._changes, since, max(1, limit), skip_client)

    def _changes(self, tr: Transaction, since: bytes, limit: int, skip_client: bytes) -> ChangePage:
        floor = tr.get(schema.FEED_FLOOR, snapshot=True) or bytes(STAMP_BYTES)
        if not since or since < floor:
            head = tr.get_range(*schema.FEED_RANGE, limit=1, reverse=True, snapshot=True)
            return ChangePage(max(floor, stamp_of(head[0][0])) if head else floor, [], gap=bool(since))
        rows = tr.get_range(key_after(schema.FEED + since), schema.FEED_RANGE[1], limit=limit, snapshot=True)
        changes = [c for c in map(decode_change, (raw for _, raw in rows)) if not skip_client or c.client != skip_client]
        cursor = stamp_of(rows[-1][0]) if rows else since
        return ChangePage(cursor, changes, more=len(rows) == limit)

    def trim_changes(self, keep_seconds: float = FEED_SECONDS, limit: int = 4096) -> int:
        """Drop up to ``limit`` feed records older than ``keep_seconds``; returns how many. A reader whose cursor
        is behind the newest dropped record then learns it has a gap (:meth:`changes`)."""
        cutoff = self._clock() - int(keep_seconds * 1e9)

        def fn(tr: Transaction) -> int:
            rows = tr.get_range(*schema.FEED_RANGE, limit=limit, snapshot=True)
            old = list(itertools.takewhile(lambda row: decode_change(row[1]).time_ns < cutoff, rows))
            if old:
                tr.clear_range(schema.FEED_RANGE[0], key_after(old[-1][0]))
                tr.set(schema.FEED_FLOOR, stamp_of(old[-1][0]))
            return len(old)

        return self.db.run(fn)
