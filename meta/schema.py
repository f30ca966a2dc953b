"""The metadata key schema (all keys are ``fdb.tuple`` tuples under the ``"meta"`` namespace).

=============================  ==========================================================
key                            value
=============================  ==========================================================
("meta", "format")             b"1": the store was formatted (root exists)
("meta", "i", ino)             Inode (msgpack): attributes, dir parent, layout, symlink target
("meta", "d", parent, name)    DirEntry (msgpack [ino, type]); one range read lists a dir
("meta", "x", ino, name)       xattr value
("meta", "s", ino, session)    Session (msgpack): a write-open session
("meta", "g", ino)             b"": inode whose last link is gone, waiting for chunk GC
("meta", "c", shard)           int64 LE: id blocks handed out by this allocator shard
("meta", "n", "inodes")        int64 LE, atomic add: live inode count for statfs
("meta", "r", minute, op_id)   the answer to a non-idempotent request, for its retries (expires)
("meta", "k", client)          int64 LE: when the client last renewed its lease (meta's clock, ns)
("meta", "o", client, ino, s)  b"": the client owns write session s of ino (ended with it when the lease lapses)
("meta", "f") + stamp          Change (msgpack): one committed transaction's changed inodes and entries (the feed)
("meta", "F")                  stamp of the newest trimmed feed record: a reader behind it has missed changes
("meta", "L", dir)             Delegation (msgpack): the client that may change the directory's entries unasked
=============================  ==========================================================
"""

from __future__ import annotations

from kvfs.kv.keys import pack, pack_bytes, pack_uint, prefix_range, unpack, unpack_uint, unpack_uint_bytes

NS = "meta"
FORMAT = pack(NS, "format")
INODE_COUNT = pack(NS, "n", "inodes")
GC_RANGE = prefix_range(NS, "g")
INODE_PREFIX = pack(NS, "i")
DENTRY_PREFIX = pack(NS, "d")
SESSION_PREFIX = pack(NS, "s")
FEED = pack(NS, "f")  # followed by a raw commit-ordered stamp, not a tuple element
FEED_RANGE = prefix_range(NS, "f")
FEED_FLOOR = pack(NS, "F")


def inode(ino: int) -> bytes:
    return INODE_PREFIX + pack_uint(ino)


def dentry(parent: int, name: bytes) -> bytes:
    return DENTRY_PREFIX + pack_uint(parent) + pack_bytes(name)


def inode_of(key: bytes) -> int:
    """The inode number of an :func:`inode` key."""
    ino = unpack_uint(key, len(INODE_PREFIX))
    return unpack(key)[2] if ino is None else ino


def dentry_of(key: bytes) -> tuple[int, bytes]:
    """``(parent, name)`` of a :func:`dentry` key."""
    found = unpack_uint_bytes(key, len(DENTRY_PREFIX))
    if found is None:
        _, _, parent, name = unpack(key)
        return parent, name
    return found


def dir_range(parent: int) -> tuple[bytes, bytes]:
    return prefix_range(NS, "d", parent)


def xattr(ino: int, name: bytes) -> bytes:
    return pack(NS, "x", ino, name)


def xattr_range(ino: int) -> tuple[bytes, bytes]:
    return prefix_range(NS, "x", ino)


def session(ino: int, sid: int) -> bytes:
    return SESSION_PREFIX + pack_uint(ino) + pack_uint(sid)


def session_range(ino: int) -> tuple[bytes, bytes]:
    return prefix_range(NS, "s", ino)


def gc(ino: int) -> bytes:
    return pack(NS, "g", ino)


def counter(shard: int) -> bytes:
    return pack(NS, "c", shard)


def client(client_id: bytes) -> bytes:
    return pack(NS, "k", client_id)


CLIENT_RANGE = prefix_range(NS, "k")


def owned_session(client_id: bytes, ino: int, sid: int) -> bytes:
    return pack(NS, "o", client_id, ino, sid)


def owned_range(client_id: bytes) -> tuple[bytes, bytes]:
    return prefix_range(NS, "o", client_id)


def answer(minute: int, op_id: bytes) -> bytes:
    return pack(NS, "r", minute, op_id)


def answers_before(minute: int) -> tuple[bytes, bytes]:
    """Every recorded answer from before ``minute``."""
    return pack(NS, "r"), pack(NS, "r", minute)


def delegation(directory: int) -> bytes:
    return pack(NS, "L", directory)


DELEGATION_RANGE = prefix_range(NS, "L")
