"""The chunk collector: removes the chunks and then the records of files whose last link and session are gone.

Removing a regular file's last link queues it under ``("meta", "g", ino)`` while its chunks may exist (see
:meth:`kvfs.meta.ops.entries.EntryOps._drop_link`); meta's GC loop calls :meth:`Collector.collect` until a round
comes back short.
"""

from __future__ import annotations

import errno

from kvfs.errors import KvfsError
from kvfs.kv import Database, Transaction
from kvfs.kv.keys import unpack
from kvfs.meta import schema
from kvfs.meta.chunks import ChunkRemover
from kvfs.meta.components.sessions import Sessions
from kvfs.meta.records import decode_inode, delete_inode

_SCAN_FACTOR = 16  # queued inodes collect looks at per inode it may collect


class Collector:
    """Collects queued inodes through ``remover`` (None: this store cannot reach the chunk servers)."""

    def __init__(self, db: Database, remover: ChunkRemover | None) -> None:
        self._db = db
        self.remover = remover

    def collect(self, limit: int) -> int:
        """Collect up to ``limit`` queued inodes without sessions; returns how many (see
        :meth:`kvfs.meta.store.MetaStore.gc_once`)."""
        if self.remover is None:
            raise KvfsError("gc_once needs a chunk_remover", errno.ENOSYS)

        def pending(tr: Transaction) -> list[tuple[int, bool]]:
            out = []  # queued files still open are passed over, so they cannot hold up the ones behind them
            for key, _ in tr.get_range(*schema.GC_RANGE, limit=limit * _SCAN_FACTOR, snapshot=True):
                ino = unpack(key)[-1]
                raw = tr.get(schema.inode(ino), snapshot=True)
                if raw is not None and not Sessions.any_open(tr, ino, snapshot=True):
                    out.append((ino, decode_inode(raw).written))
                    if len(out) == limit:
                        break
            return out

        found = self._db.run(pending)
        if not found:
            return 0
        with_chunks = [ino for ino, written in found if written]  # never written: no chunk server holds any
        if with_chunks:
            self.remover.remove_chunks(with_chunks)
        return self._db.run(self._finish, [ino for ino, _ in found])

    @staticmethod
    def _finish(tr: Transaction, inodes: list[int]) -> int:
        done = 0
        for ino in inodes:
            if tr.get(schema.gc(ino)) is None or Sessions.any_open(tr, ino):
                continue  # another instance finished it, or (never expected) a session appeared
            tr.clear(schema.gc(ino))
            delete_inode(tr, ino)
            done += 1
        return done
