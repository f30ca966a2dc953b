"""Typed reads and writes of the namespace's records (keys in :mod:`kvfs.meta.schema`), inside a transaction.

The store's operations and components all load and store inodes and directory entries the same way; this is
that one way: msgpack codecs, ENOENT for what is missing, the derived ``blocks`` field kept with the size, and
the live inode count kept with the inode records.
"""

from __future__ import annotations

import errno
import stat
from collections.abc import Sequence

import msgspec

from kvfs.kv import Transaction
from kvfs.meta import schema
from kvfs.meta.posix import blocks, errno_error
from kvfs.meta.types import DirEntry, Inode

encoder = msgspec.msgpack.Encoder()
decode_inode = msgspec.msgpack.Decoder(Inode).decode
decode_entry = msgspec.msgpack.Decoder(DirEntry).decode


def get_inode(tr: Transaction, ino: int) -> Inode:
    return _inode(ino, tr.get(schema.inode(ino)))


def _inode(ino: int, raw: bytes | None) -> Inode:
    if raw is None:
        raise errno_error(errno.ENOENT, f"inode {ino}")
    return decode_inode(raw)


def get_live(tr: Transaction, ino: int) -> Inode:
    """An inode that still has a name (unlinked-but-open files cannot gain new users)."""
    inode = get_inode(tr, ino)
    if inode.attr.nlink == 0:
        raise errno_error(errno.ENOENT, f"inode {ino} was removed")
    return inode


def put_inode(tr: Transaction, inode: Inode) -> None:
    inode.attr.blocks = blocks(inode.attr.size)
    tr.set(schema.inode(inode.attr.ino), encoder.encode(inode))


def delete_inode(tr: Transaction, ino: int) -> None:
    tr.clear(schema.inode(ino))
    tr.clear_range(*schema.xattr_range(ino))
    tr.add(schema.INODE_COUNT, -1)


def get_entry(tr: Transaction, parent: int, name: bytes) -> DirEntry | None:
    raw = tr.get(schema.dentry(parent, name))
    return None if raw is None else decode_entry(raw)


def get_entries(tr: Transaction, parent: int, names: Sequence[bytes]) -> list[DirEntry | None]:
    """:func:`get_entry` of many names, read together."""
    return [None if raw is None else decode_entry(raw)
            for raw in tr.get_many([schema.dentry(parent, name) for name in names])]


def get_inodes(tr: Transaction, inos: Sequence[int]) -> list[Inode]:
    """:func:`get_inode` of many inodes, read together."""
    return [_inode(ino, raw) for ino, raw in zip(inos, tr.get_many([schema.inode(ino) for ino in inos]))]


def get_child(tr: Transaction, parent: int, name: bytes) -> tuple[DirEntry, Inode]:
    entry = get_entry(tr, parent, name)
    if entry is None:
        raise errno_error(errno.ENOENT, repr(name))
    return entry, get_inode(tr, entry.ino)


def link_entry(tr: Transaction, parent: int, name: bytes, inode: Inode) -> None:
    tr.set(schema.dentry(parent, name), encoder.encode(DirEntry(inode.attr.ino, stat.S_IFMT(inode.attr.mode))))


def touch(now: int, *inodes: Inode, mtime: bool = True) -> None:
    """Set the change time (and the modification time, with ``mtime``) of ``inodes`` to ``now``."""
    for inode in inodes:
        inode.attr.ctime_ns = now
        if mtime:
            inode.attr.mtime_ns = now
