"""Extended attributes, and the virtual ``kvfs.layout`` one (never stored or listed) that shows and sets layouts."""

from __future__ import annotations

import errno
import stat

from kvfs.kv import Transaction
from kvfs.kv.keys import unpack
from kvfs.meta import schema
from kvfs.meta.ops.attrs import AttrOps
from kvfs.meta.posix import (
    LAYOUT_XATTR, R_OK, W_OK, XATTR_CREATE, XATTR_NAME_MAX, XATTR_REPLACE, XATTR_SIZE_MAX, errno_error, fsname,
    is_dir, require_access,
)
from kvfs.meta.records import get_inode, put_inode
from kvfs.meta.types import Caller, Inode


class XattrOps(AttrOps):
    """getxattr, setxattr, removexattr, listxattr."""

    def _xattr_target(self, tr: Transaction, caller: Caller, ino: int, name: bytes, want: int) -> Inode:
        """Namespace and permission rules: user.* follows the file's mode bits (and only regular
        files and directories carry them), trusted.* is root's, writing security.* needs root,
        system.* (POSIX ACLs) is not supported."""
        if not name or len(name) > XATTR_NAME_MAX:
            raise errno_error(errno.ERANGE, "xattr name length")
        inode = get_inode(tr, ino)
        space, _, rest = name.partition(b".")
        if not rest and space in (b"user", b"trusted", b"security"):  # a namespace with no name in it
            raise errno_error(errno.EINVAL, repr(name))
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
