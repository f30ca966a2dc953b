"""Opening regular files and the write sessions' calls: create, open, report_length, set_length, close."""

from __future__ import annotations

import errno
import os
import stat

from kvfs.kv import Transaction
from kvfs.meta import schema
from kvfs.meta.ops.entries import EntryOps
from kvfs.meta.posix import W_OK, errno_error, is_dir, kill_suid, open_wants, pick_time, require_access
from kvfs.meta.records import decode_inode, get_entry, get_inode, get_live, put_inode
from kvfs.meta.types import Attr, Caller, Opened, TimeSpec


class FileOps(EntryOps):
    """create, open, report_length, set_length, close, close_sessions."""

    def create(self, caller: Caller, parent: int, name: bytes | str, mode: int, flags: int = os.O_RDWR) -> Opened:
        """open(O_CREAT): create a regular file, or open the existing one unless ``O_EXCL``.
        Opening for writing starts a write session (see :meth:`close`)."""
        return self._create_op(self._create, caller, parent, name, mode, flags)

    def _create(self, tr: Transaction, caller: Caller, parent: int, name: bytes, ino: int, mode: int, flags: int) -> Opened:
        self._dir(tr, caller, parent)
        entry = get_entry(tr, parent, name)
        if entry is not None:
            if flags & os.O_EXCL:
                raise errno_error(errno.EEXIST, repr(name))
            return self._open(tr, caller, entry.ino, flags & ~os.O_CREAT)
        inode = self._make(tr, caller, parent, name, stat.S_IFREG | (mode & 0o7777), ino,
                           written=bool(open_wants(flags) & W_OK))
        session = self._sessions.start(tr, caller, inode, flags)
        return Opened(inode.attr, session, inode.layout, get_inode(tr, parent).attr)

    def open(self, caller: Caller, ino: int, flags: int, hold: bool = False) -> Opened:
        """Check access for ``flags``; ``O_TRUNC`` truncates; opening a regular file for writing
        starts a write session that keeps its chunks alive until :meth:`close`. ``hold``: a read-only open of a
        regular file gets a hold session (``Opened.hold``), which keeps the file readable after its last name
        goes, as POSIX wants, until it is closed the same way (or its client's lease lapses)."""
        return self._write(self._open, caller, ino, flags, hold)

    def _open(self, tr: Transaction, caller: Caller, ino: int, flags: int, hold: bool = False) -> Opened:
        inode = get_live(tr, ino)
        wants = open_wants(flags)
        if flags & os.O_TRUNC:
            wants |= W_OK
        if is_dir(inode) and wants & W_OK:
            raise errno_error(errno.EISDIR, f"inode {ino}")
        if stat.S_ISLNK(inode.attr.mode):
            raise errno_error(errno.ELOOP, f"inode {ino} is a symlink")
        require_access(caller, inode.attr, wants)
        if flags & os.O_TRUNC and stat.S_ISREG(inode.attr.mode):
            inode.attr.size = 0
            kill_suid(caller, inode.attr)
            self._touch(inode)
            put_inode(tr, inode)
        session = self._sessions.start(tr, caller, inode, flags)
        held = None
        if hold and session is None and stat.S_ISREG(inode.attr.mode):
            held = self._sessions.hold(tr, caller, inode.attr.ino)
        return Opened(inode.attr, session, inode.layout, hold=held)

    def report_length(self, caller: Caller, ino: int, session: int, end_offset: int, *,
                      mtime: TimeSpec = "now") -> Attr:
        """A writer wrote up to ``end_offset``: the length becomes the max of both, mtime is
        updated, and an unprivileged writer clears the set-id bits."""
        def fn(tr: Transaction) -> Attr:
            inode = self._sessions.writer_inode(tr, ino, session)
            attr = inode.attr
            attr.size = max(attr.size, end_offset)
            now = self._clock()
            attr.mtime_ns = pick_time(mtime, now, attr.mtime_ns)
            attr.ctime_ns = now
            kill_suid(caller, attr)
            put_inode(tr, inode)
            return attr

        return self.db.run(fn)

    def set_length(self, caller: Caller, ino: int, session: int, length: int) -> Attr:
        """The exact length the writer knows (fsync/close), possibly shorter than reported maxima."""
        def fn(tr: Transaction) -> Attr:
            inode = self._sessions.writer_inode(tr, ino, session)
            inode.attr.size = length
            self._touch(inode, mtime=False)
            put_inode(tr, inode)
            return inode.attr

        return self.db.run(fn)

    def close(self, caller: Caller, ino: int, session: int | None, exact_length: int | None = None) -> Attr:
        """End a session, a write session or a hold (idempotent, so a retried close is harmless), optionally
        fixing the exact length first (write sessions only). An unlinked file's chunks become collectable when its
        last session closes."""
        def fn(tr: Transaction) -> Attr:
            inode = get_inode(tr, ino)
            if session is not None:
                self._sessions.end(tr, inode, session, exact_length)
            return inode.attr

        return self._write(fn)

    def close_sessions(self, caller: Caller, sessions: list[tuple[int, int, int | None]]) -> int:
        """:meth:`close` of many ``(ino, session, exact_length)`` in one transaction: a mount ending the
        sessions of many small files sends them together instead of a round trip each. Sessions already
        ended (a retry) and inodes already gone are skipped; returns how many sessions this call ended."""
        def fn(tr: Transaction) -> int:
            ended = 0
            for ino, session, exact_length in sessions:
                raw = tr.get(schema.inode(ino))
                if raw is not None:
                    ended += self._sessions.end(tr, decode_inode(raw), session, exact_length)
            return ended

        return self.db.run(fn)
