"""Operations on names in directories: lookup, resolve, create (mknod, mkdir, symlink), link, unlink, rmdir,
rename, readdir; and what a name's removal does to its inode."""

from __future__ import annotations

import errno
import stat
from typing import Any, Callable

from kvfs.kv import Transaction
from kvfs.kv.keys import key_after, unpack
from kvfs.meta import schema
from kvfs.meta.components.delegations import Delegations
from kvfs.meta.ops.base import OpsBase
from kvfs.meta.posix import (
    LINK_MAX, NAME_MAX, PATH_MAX, R_OK, RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO, SYMLOOP_MAX, W_OK, X_OK,
    check_name, child_attr, errno_error, fsname, is_dir, require_access, require_sticky,
)
from kvfs.meta.records import (
    decode_entry, delete_inode, encoder, get_child, get_entry, get_inode, get_live, link_entry, put_inode,
)
from kvfs.meta.types import Attr, Caller, DirPage, Entry, Inode


class EntryOps(OpsBase):
    """The namespace's names: every operation that adds, removes, moves or reads directory entries."""

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
              parent_inode: Inode | None = None, written: bool = False, grant: int = 0) -> Inode:
        """Create inode ``ino`` named ``name`` in ``parent``: owner is the caller, the group and
        (for directories) the setgid bit come from a setgid parent, layout is the parent's
        (regular files get their own random seed). ``parent_inode``: the directory, loaded by a caller that makes
        several changes in it and stores it once at the end. ``written``: a write session starts with it.
        ``grant``: the epoch of the delegation whose holder made it (meta/delegation.py, rule 5)."""
        pdir = parent_inode or self._dir(tr, caller, parent)
        if get_entry(tr, parent, name) is not None:
            raise errno_error(errno.EEXIST, repr(name))
        require_access(caller, pdir.attr, W_OK | X_OK)
        is_dir = stat.S_ISDIR(mode)
        attr, layout = child_attr(caller, pdir.attr, self._layout(pdir), mode, ino, self._now(),
                                  rdev=rdev, target=target, seed=seed)
        inode = Inode(attr, parent=parent if is_dir else 0, layout=layout, target=target, written=written,
                      grant=grant)
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
        # see _make; another client's grant of the directory does not stop the removal of a file made outside it
        pdir = parent_inode or self._dir(tr, caller, parent, removing=None if want_dir else name)
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
