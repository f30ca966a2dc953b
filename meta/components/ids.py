"""Inode id allocation: never-used ids in blocks, from sharded counters so that instances rarely conflict."""

from __future__ import annotations

import random
import threading

from kvfs.kv import Database, Transaction
from kvfs.kv.keys import decode_int, encode_int
from kvfs.meta import schema
from kvfs.meta.posix import ROOT_INO
from kvfs.meta.types import ID_BLOCK, ID_SHARDS

_FIRST_ID = ROOT_INO + 1


class InodeIds:
    """Hands out inode ids from a block this instance reserved; reserves the next block when it runs out."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._ids: list[int] = []
        self._lock = threading.Lock()

    def next(self) -> int:
        """A never-used inode id.  Ids come in blocks of ID_BLOCK reserved in one small
        transaction on a random one of ID_SHARDS counters, so creating instances rarely conflict;
        block ``n`` of shard ``s`` is ids ``[2 + (n*ID_SHARDS + s)*ID_BLOCK, +ID_BLOCK)``."""
        with self._lock:
            if not self._ids:
                start = self._db.run(self.reserve_block, random.randrange(ID_SHARDS))
                self._ids = list(range(start + ID_BLOCK - 1, start - 1, -1))
            return self._ids.pop()

    @staticmethod
    def reserve_block(tr: Transaction, shard: int) -> int:
        """Reserve the next block of ``shard`` in ``tr``; returns its first id."""
        key = schema.counter(shard)
        n = decode_int(tr.get(key))
        tr.set(key, encode_int(n + 1))
        return _FIRST_ID + (n * ID_SHARDS + shard) * ID_BLOCK
