"""Operations on inodes' attributes: getattr, access, setattr (chmod, chown, truncate, utimens), readlink,
statfs, and layouts (what a file is striped with, what a directory gives its new files)."""

from __future__ import annotations

import errno
import stat

from kvfs.errors import KvfsError
from kvfs.kv import Transaction
from kvfs.kv.keys import decode_int
from kvfs.meta import schema
from kvfs.meta.ops.base import OpsBase
from kvfs.meta.posix import (
    NAME_MAX, W_OK, clears_only_set_id, errno_error, is_dir, kill_suid, pick_time, require_access, require_owner,
)
from kvfs.meta.records import get_inode, put_inode
from kvfs.meta.types import Attr, Caller, Layout, StatFs, TimeSpec


class AttrOps(OpsBase):
    """getattr, access, setattr, readlink, statfs, get_layout, set_layout."""

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
        session: int | None = None,
    ) -> Attr:
        """chmod/chown/truncate/utimens in one.  ``None`` leaves a field alone; times take
        nanoseconds or ``"now"``.  Only the owner (or root) may chmod or set explicit times, only
        root may give a file away, an owner may chgrp to a group it belongs to; chown clears the
        set-id bits of non-directories; truncate needs write permission, and so does a mode change by
        anyone else that only drops set-id bits (what a write makes the kernel ask for). ``session``: the
        caller's write session on ``ino`` (``ftruncate``): write permission was checked when it was opened,
        so neither needs it now (EBADF if it is not such a session)."""
        return self._write(self._setattr, caller, ino, mode, uid, gid, size, atime, mtime, session)

    def _setattr(self, tr: Transaction, caller: Caller, ino: int, mode: int | None, uid: int | None,
                 gid: int | None, size: int | None, atime: TimeSpec, mtime: TimeSpec, session: int | None) -> Attr:
        inode = get_inode(tr, ino)
        if is_dir(inode):
            self._delegations.check(tr, caller, ino)
        attr = inode.attr
        now = self._clock()

        def require_write() -> None:
            if session is None:
                require_access(caller, attr, W_OK)
            else:
                self._sessions.writer_inode(tr, ino, session)

        if mode is not None:
            if caller.uid not in (0, attr.uid) and stat.S_ISREG(attr.mode) and clears_only_set_id(attr.mode, mode):
                require_write()
            else:
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
            require_write()
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
