"""POSIX rules that meta enforces and a client answering for meta must apply the same way: name checks, permission
bits, the sticky bit, set-id clearing, a new inode's attributes, and the limits behind them.

Pure functions over :mod:`kvfs.meta.types` records, so the mount (which answers creates and removals in delegated
directories itself) can apply them without loading the store.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

import msgspec

from kvfs.errors import KvfsError
from kvfs.meta.types import Attr, Caller, Inode, Layout, TimeSpec

ROOT_INO = 1
NAME_MAX = 255
PATH_MAX = 4096
LINK_MAX = 65000  # hard links to a file, as ext4; a directory's subdirectories are not limited (ext4's dir_nlink)
SYMLOOP_MAX = 40
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 64 * 1024
XATTR_CREATE = 1
XATTR_REPLACE = 2
LAYOUT_XATTR = b"kvfs.layout"
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
R_OK, W_OK, X_OK = 4, 2, 1
_KILL_SUID = stat.S_ISUID | stat.S_ISGID


def errno_error(code: int, what: str = "") -> KvfsError:
    text = os.strerror(code)
    return KvfsError(f"{text}: {what}" if what else text, code)


def fsname(name: bytes | str) -> bytes:
    return os.fsencode(name) if isinstance(name, str) else bytes(name)


def check_name(name: bytes | str) -> bytes:
    """A name an entry may be created or removed under."""
    raw = fsname(name)
    if not raw or b"/" in raw or b"\0" in raw or raw in (b".", b".."):
        raise errno_error(errno.EINVAL, repr(raw))
    if len(raw) > NAME_MAX:
        raise errno_error(errno.ENAMETOOLONG, repr(raw[:32]))
    return raw


def blocks(size: int) -> int:
    return (size + 511) // 512


def is_dir(inode: Inode) -> bool:
    return stat.S_ISDIR(inode.attr.mode)


def kill_suid(caller: Caller, attr: Attr) -> None:
    """What a write or truncate by a caller without CAP_FSETID (anyone but root) does to set-id bits, as Linux's
    ``setattr_should_drop_suidgid``: drop setuid; drop setgid where group execute is set (a set-gid executable),
    or where the caller is not in the file's group (it could not have set the bit itself)."""
    if caller.uid == 0 or not attr.mode & _KILL_SUID:
        return
    attr.mode &= ~stat.S_ISUID
    if attr.mode & stat.S_IXGRP or not caller.in_group(attr.gid):
        attr.mode &= ~stat.S_ISGID


def clears_only_set_id(old_mode: int, new_mode: int) -> bool:
    """Whether ``new_mode`` is ``old_mode`` with some of its set-id bits dropped and nothing else changed: what the
    kernel asks a FUSE filesystem for, in the writer's name, after a write or truncate (FUSE leaves clearing the
    bits to the filesystem), so a writer who does not own the file may ask for it."""
    old, new = stat.S_IMODE(old_mode), stat.S_IMODE(new_mode)
    dropped = old & ~new
    return new & ~old == 0 and dropped != 0 and dropped & ~_KILL_SUID == 0


def require_access(caller: Caller, attr: Attr, want: int) -> None:
    """Owner/group/other permission bits; root bypasses all but exec on a non-executable file."""
    if caller.uid == 0:
        if want & X_OK and not stat.S_ISDIR(attr.mode) and not attr.mode & 0o111:
            raise errno_error(errno.EACCES, f"inode {attr.ino} not executable")
        return
    if caller.uid == attr.uid:
        bits = attr.mode >> 6
    elif caller.in_group(attr.gid):
        bits = attr.mode >> 3
    else:
        bits = attr.mode
    if want & ~bits & 7:
        raise errno_error(errno.EACCES, f"inode {attr.ino}")


def require_owner(caller: Caller, attr: Attr) -> None:
    if caller.uid not in (0, attr.uid):
        raise errno_error(errno.EPERM, f"not the owner of inode {attr.ino}")


def require_sticky(caller: Caller, directory: Inode, victim: Inode) -> None:
    """In a sticky directory only the file's owner, the directory's owner or root may remove it."""
    if directory.attr.mode & stat.S_ISVTX and caller.uid not in (0, directory.attr.uid, victim.attr.uid):
        raise errno_error(errno.EPERM, "sticky directory")


def child_attr(caller: Caller, parent: Attr, layout: Layout, mode: int, ino: int, now: int, *, rdev: int = 0,
               target: bytes | None = None, seed: int | None = None) -> tuple[Attr, Layout | None]:
    """A new inode's attributes and layout, made by ``caller`` in a directory with attributes ``parent`` whose
    children get ``layout``: the caller owns it; the group, and for directories the setgid bit, come from a
    setgid parent; a regular file gets its own placement ``seed`` (random if None). Meta's creates use it, and so
    does a client that answers creates in a delegated directory itself (meta/delegation.py), so both agree."""
    ftype, perm = stat.S_IFMT(mode), mode & 0o7777
    is_dir = ftype == stat.S_IFDIR
    gid = caller.gid
    if parent.mode & stat.S_ISGID:
        gid = parent.gid
        if is_dir:
            perm |= stat.S_ISGID
    # Linux's mode_strip_sgid: a set-gid executable for a group its maker is not in would run with that group's
    # rights; set-gid without group execute (mandatory locking's old mark) is harmless and stays
    executable_sgid = stat.S_ISGID | stat.S_IXGRP
    if not is_dir and perm & executable_sgid == executable_sgid and caller.uid != 0 and not caller.in_group(gid):
        perm &= ~stat.S_ISGID
    blksize = layout.chunk_size
    own_layout: Layout | None = layout
    if ftype == stat.S_IFREG:
        own_layout = msgspec.structs.replace(layout, seed=secrets.randbits(64) if seed is None else seed)
    elif not is_dir:
        own_layout = None
    attr = Attr(ino, ftype | perm, 2 if is_dir else 1, caller.uid, gid, len(target or b""), now, now, now,
                rdev=rdev, blksize=blksize)
    return attr, own_layout


def check_access(caller: Caller, attr: Attr, want: int) -> bool:
    """Whether ``caller`` has ``want`` (R_OK|W_OK|X_OK) on ``attr`` by the rules meta enforces."""
    try:
        require_access(caller, attr, want)
    except KvfsError:
        return False
    return True


def sticky_allows(caller: Caller, directory: Attr, victim_uid: int) -> bool:
    """Whether the sticky bit of ``directory`` lets ``caller`` remove a name owned by ``victim_uid``."""
    return not directory.mode & stat.S_ISVTX or caller.uid in (0, directory.uid, victim_uid)


def pick_time(value: TimeSpec, now: int, old: int) -> int:
    if value is None:
        return old
    return now if value == "now" else int(value)


def open_wants(flags: int) -> int:
    acc = flags & os.O_ACCMODE
    return {os.O_RDONLY: R_OK, os.O_WRONLY: W_OK}.get(acc, R_OK | W_OK)
