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

from kvfs.kv.keys import pack, prefix_range

NS = "meta"
FORMAT = pack(NS, "format")
INODE_COUNT = pack(NS, "n", "inodes")
GC_RANGE = prefix_range(NS, "g")
INODE_PREFIX = pack(NS, "i")
DENTRY_PREFIX = pack(NS, "d")
FEED = pack(NS, "f")  # followed by a raw commit-ordered stamp, not a tuple element
FEED_RANGE = prefix_range(NS, "f")
FEED_FLOOR = pack(NS, "F")


def inode(ino: int) -> bytes:
    return pack(NS, "i", ino)


def dentry(parent: int, name: bytes) -> bytes:
    return pack(NS, "d", parent, name)


def dir_range(parent: int) -> tuple[bytes, bytes]:
    return prefix_range(NS, "d", parent)


def xattr(ino: int, name: bytes) -> bytes:
    return pack(NS, "x", ino, name)


def xattr_range(ino: int) -> tuple[bytes, bytes]:
    return prefix_range(NS, "x", ino)


def session(ino: int, sid: int) -> bytes:
    return pack(NS, "s", ino, sid)


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
