"""Operations on many names of one directory in one transaction, for clients that work in batches (kvclient):
lookups, the two halves of write-once puts, removals and access-time records. Each answers per name, so one
missing or refused name does not fail its batch; every per-name step raises before it changes anything, so a
name that fails leaves the transaction as it found it."""

from __future__ import annotations

import errno
import os
import stat
from typing import Callable

from kvfs.errors import KvfsError
from kvfs.kv import Transaction
from kvfs.meta.api import MAX_BATCH
from kvfs.meta.ops.files import FileOps
from kvfs.meta import schema
from kvfs.meta.posix import W_OK, X_OK, check_name, errno_error, require_access, require_sticky
from kvfs.meta.records import encoder, get_child, get_entries, get_entry, get_inodes, put_inode
from kvfs.meta.types import Caller, Commit, DirEntry, Found, Inode, Opened

_PUT_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL


def _checked(names: list[bytes]) -> list[bytes]:
    """Every name valid and at most MAX_BATCH of them, or EINVAL for the whole batch before anything runs."""
    if len(names) > MAX_BATCH:
        raise errno_error(errno.EINVAL, f"{len(names)} names in one batch; at most {MAX_BATCH}")
    return [check_name(name) for name in names]


class BatchOps(FileOps):
    """batch_lookup, begin_puts, commit_puts, batch_unlink, touch_atimes."""

    def batch_lookup(self, caller: Caller, parent: int, names: list[bytes]) -> list[Found | None]:
        """lookup of many names in ``parent`` in one transaction: each file's attributes and layout, or None."""
        return self.db.run(self._batch_lookup, caller, parent, _checked(names))

    def _batch_lookup(self, tr: Transaction, caller: Caller, parent: int, names: list[bytes]) -> list[Found | None]:
        self._dir(tr, caller, parent)
        entries = get_entries(tr, parent, names)
        inodes = iter(get_inodes(tr, [e.ino for e in entries if e is not None]))
        found: list[Found | None] = []
        for entry in entries:
            if entry is None:
                found.append(None)
                continue
            inode = next(inodes)
            found.append(Found(inode.attr, inode.layout if stat.S_ISREG(inode.attr.mode) else None))
        return found

    def begin_puts(self, caller: Caller, parent: int, puts: list[tuple[bytes, bytes]],
                   mode: int) -> list[Opened | None]:
        """The first half of write-once puts into ``parent``, in one transaction: for each ``(name, temp)``,
        None when ``name`` exists (a written-once value needs no rewrite), else temporary file ``temp`` created
        as ``create(O_EXCL)`` would, with a write session."""
        names = _checked([name for name, _ in puts])
        temps = _checked([temp for _, temp in puts])
        ids = [self._ids.next() for _ in puts]
        return self._write(self._begin_puts, caller, parent, list(zip(names, temps, ids)), mode)

    def _begin_puts(self, tr: Transaction, caller: Caller, parent: int, puts: list[tuple[bytes, bytes, int]],
                    mode: int) -> list[Opened | None]:
        pdir = self._dir(tr, caller, parent)
        opened: list[Opened | None] = []
        existing = get_entries(tr, parent, [name for name, _, _ in puts])  # all read at once
        made: set[bytes] = set()  # temporary files made since, which those reads could not see
        for (name, temp, ino), entry in zip(puts, existing):
            if entry is not None or name in made:
                opened.append(None)
                continue
            inode = self._make(tr, caller, parent, temp, stat.S_IFREG | (mode & 0o7777), ino, written=True,
                               parent_inode=pdir)
            made.add(temp)
            opened.append(Opened(inode.attr, self._sessions.start(tr, caller, inode, _PUT_FLAGS), inode.layout))
        if made:
            put_inode(tr, pdir)
        return opened

    def commit_puts(self, caller: Caller, parent: int, commits: list[Commit]) -> list[int]:
        """The second half, in one transaction: per commit, the write session ends at the exact length and the
        temporary file is renamed onto its name with RENAME_NOREPLACE (0). -EEXIST: the name appeared since
        (another put won); the temporary file is removed and the first value stands. Other -errno: the
        temporary file is not the one begun (-ENOENT: removed as an orphan; -EBADF: its session lapsed)."""
        _checked([c.name for c in commits])
        _checked([c.temp for c in commits])
        return self._write(self._commit_puts, caller, parent, commits)

    def _commit_puts(self, tr: Transaction, caller: Caller, parent: int, commits: list[Commit]) -> list[int]:
        pdir = self._dir(tr, caller, parent)
        require_access(caller, pdir.attr, W_OK | X_OK)  # what the removal or rename below would check
        found = iter(get_entries(tr, parent, [name for c in commits for name in (c.temp, c.name)]))  # read at once
        changed: set[bytes] = set()  # names an earlier commit changed since, which those reads could not see
        results = []
        for c in commits:
            temp, existing = next(found), next(found)
            if c.temp in changed or c.name in changed:
                temp, existing = get_entry(tr, parent, c.temp), get_entry(tr, parent, c.name)
            result = self._per_name(self._commit_one, tr, caller, pdir, c, temp, existing)
            if result in (0, -errno.EEXIST):
                changed.update((c.temp, c.name))
            results.append(result)
        if changed:
            self._touch(pdir)
            put_inode(tr, pdir)
        return results

    def _commit_one(self, tr: Transaction, caller: Caller, pdir: Inode, commit: Commit, temp: DirEntry | None,
                    existing: DirEntry | None) -> int:
        """One commit in directory ``pdir`` (stored by the caller) given its temporary file's entry and its name's:
        the rename as ``EntryOps._rename`` makes it of a file within one directory, without reading again what the
        batch read."""
        inode = self._sessions.writer_inode(tr, commit.ino, commit.session)
        if temp is None or temp.ino != commit.ino:
            raise errno_error(errno.ENOENT, f"temporary file {commit.temp!r} is gone")
        require_sticky(caller, pdir, inode)  # what the rename or the removal checks, before anything changes
        self._sessions.end(tr, inode, commit.session, commit.length)  # stores the inode, its change time set
        parent = pdir.attr.ino
        if existing is not None:
            self._remove(tr, caller, parent, commit.temp, False, parent_inode=pdir)
            return -errno.EEXIST
        tr.clear(schema.dentry(parent, commit.temp))
        tr.set(schema.dentry(parent, commit.name), encoder.encode(temp))
        return 0

    def batch_unlink(self, caller: Caller, parent: int, names: list[bytes]) -> list[int]:
        """unlink of many names in ``parent`` in one transaction: 0 or -errno per name."""
        return self._write(self._batch_unlink, caller, parent, _checked(names))

    def _batch_unlink(self, tr: Transaction, caller: Caller, parent: int, names: list[bytes]) -> list[int]:
        self._dir(tr, caller, parent)
        return [self._per_name(self._remove, tr, caller, parent, name, False) for name in names]

    def touch_atimes(self, caller: Caller, parent: int, names: list[bytes]) -> int:
        """Set the access time of names in ``parent`` to now (accesses a client recorded, sent together):
        what eviction orders by. As utimens(UTIME_NOW), it needs ownership or write permission; names gone or
        not allowed are skipped. Returns how many were touched."""
        return self.db.run(self._touch_atimes, caller, parent, _checked(names))

    def _touch_atimes(self, tr: Transaction, caller: Caller, parent: int, names: list[bytes]) -> int:
        self._dir(tr, caller, parent)
        now = self._clock()
        touched = 0
        for name in names:
            try:
                _, inode = get_child(tr, parent, name)
                if caller.uid != inode.attr.uid:
                    require_access(caller, inode.attr, W_OK)
            except KvfsError:
                continue
            inode.attr.atime_ns = now
            put_inode(tr, inode)
            touched += 1
        return touched

    @staticmethod
    def _per_name(fn: Callable[..., int | object], tr: Transaction, *args: object) -> int:
        """What ``fn`` answers for one name (0 unless it returns an int), or the -errno it raised (before
        changing anything, as every per-name step here does)."""
        try:
            result = fn(tr, *args)
        except KvfsError as exc:
            return -(exc.errno or errno.EIO)
        return result if isinstance(result, int) else 0
