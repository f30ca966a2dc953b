"""Offline consistency check of the namespace: what tests and ``kvfs admin`` use to prove that
concurrent operations left the store sound.  Reads everything in one transaction, so it is meant
for small stores or a quiesced cluster."""

from __future__ import annotations

import stat
from collections import Counter

import msgspec

from . import schema
from kvfs.kv import Database, Transaction
from kvfs.kv.keys import decode_int, prefix_range, unpack
from kvfs.meta.posix import ROOT_INO
from .types import DirEntry, Inode, Session


def check(db: Database) -> list[str]:
    """Problems found (empty when consistent): dangling entries, wrong nlink or type, directories
    with a wrong parent pointer or several names, nameless inodes not queued for GC, a wrong
    inode count, write sessions and their owners' index out of step, delegations of what is not a directory, and
    files with a write session that say they were never written."""
    return db.run(_check)


def _check(tr: Transaction) -> list[str]:
    problems: list[str] = []
    inodes = {
        unpack(k)[-1]: msgspec.msgpack.decode(v, type=Inode)
        for k, v in tr.get_range(*prefix_range(schema.NS, "i"))
    }
    queued = {unpack(k)[-1] for k, _ in tr.get_range(*schema.GC_RANGE)}
    links: Counter[int] = Counter()
    subdirs: Counter[int] = Counter()
    for key, raw in tr.get_range(*prefix_range(schema.NS, "d")):
        _, _, parent, name = unpack(key)
        entry = msgspec.msgpack.decode(raw, type=DirEntry)
        node = inodes.get(entry.ino)
        if node is None:
            problems.append(f"entry {parent}/{name!r} -> missing inode {entry.ino}")
            continue
        links[entry.ino] += 1
        if stat.S_IFMT(node.attr.mode) != entry.type:
            problems.append(f"entry {parent}/{name!r} type {entry.type:o} != inode {entry.ino}")
        if stat.S_ISDIR(node.attr.mode):
            subdirs[parent] += 1
            if node.parent != parent:
                problems.append(f"dir {entry.ino} named in {parent} but its parent is {node.parent}")
    for ino, node in inodes.items():
        is_dir = stat.S_ISDIR(node.attr.mode)
        names = links[ino]
        if is_dir and names > 1:
            problems.append(f"dir {ino} has {names} names")
        if ino != ROOT_INO and names == 0 and ino not in queued:
            problems.append(f"inode {ino} has no name and is not queued for GC")
        want = 2 + subdirs[ino] if is_dir else names
        if node.attr.nlink != want:
            problems.append(f"inode {ino} nlink {node.attr.nlink} != {want}")
    for ino in queued:
        if ino in inodes and inodes[ino].attr.nlink:
            problems.append(f"inode {ino} queued for GC but has nlink {inodes[ino].attr.nlink}")
    sessions = {}
    for key, raw in tr.get_range(*prefix_range(schema.NS, "s")):
        _, _, ino, sid = unpack(key)
        sessions[(ino, sid)] = msgspec.msgpack.decode(raw, type=Session).client
        if ino not in inodes:
            problems.append(f"session {sid} of missing inode {ino}")
    owned = {}
    for key, _ in tr.get_range(*prefix_range(schema.NS, "o")):
        _, _, client, ino, sid = unpack(key)
        owned[(ino, sid)] = client
    want_owned = {k: client for k, client in sessions.items() if client}
    if owned != want_owned:
        problems.append(f"client session index {sorted(owned.items())} != sessions {sorted(want_owned.items())}")
    for key, _ in tr.get_range(*schema.DELEGATION_RANGE):
        ino = unpack(key)[-1]
        if ino not in inodes or not stat.S_ISDIR(inodes[ino].attr.mode):
            problems.append(f"delegation of {ino}, which is not a directory")
    for ino in {ino for ino, _ in sessions}:
        if ino in inodes and not inodes[ino].written:  # the collector would skip its chunks
            problems.append(f"inode {ino} has a write session but says it was never written")
    count = decode_int(tr.get(schema.INODE_COUNT))
    if count != len(inodes):
        problems.append(f"inode count {count} != {len(inodes)} records")
    return problems
