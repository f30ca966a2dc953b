"""The metadata service's operations as a client sees them: names, parameters, answers.

:mod:`kvfs.meta.rpc` derives the wire surface from this protocol (a request struct per operation from its
parameters, a response struct from its return type), and :class:`kvfs.meta.store.MetaStore` implements it; a test
holds the two signatures equal. It lives apart from the store so that a client (the mount, kvclient) knows every
operation without loading the store or the KV engines behind it.

Every operation takes the :class:`~kvfs.meta.types.Caller` first, checks POSIX permissions for it, and fails
with :class:`~kvfs.errors.KvfsError` carrying the errno a kernel would give. Names are bytes (any byte but ``/``
and NUL); ``str`` is accepted and encoded like ``os.fsencode``.
"""

from __future__ import annotations

import os
from typing import Protocol

from kvfs.meta.types import (
    Attr, Caller, Commit, Delegated, DirOp, DirPage, Found, Layout, Opened, StatFs, TimeSpec,
)

#: Names one batch operation takes at most (``batch_lookup`` ... ``touch_atimes``): a client splits larger
#: batches, so that one transaction stays bounded.
MAX_BATCH = 1024


class MetaApi(Protocol):
    """One KV transaction per operation, served by any ``kvfs meta`` instance."""

    def lookup(self, caller: Caller, parent: int, name: bytes | str) -> Attr:
        ...

    def getattr(self, caller: Caller, ino: int) -> Attr:
        """Attributes of any existing inode (stat needs no permission on the file itself)."""

    def setattr(
        self,
        caller: Caller,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime: TimeSpec = None,
        mtime: TimeSpec = None,
        session: int | None = None,
    ) -> Attr:
        """chmod/chown/truncate/utimens in one.  ``None`` leaves a field alone; times take nanoseconds or
        ``"now"``.  Only the owner (or root) may chmod or set explicit times, only root may give a file away,
        an owner may chgrp to a group it belongs to; chown clears the set-id bits of non-directories; truncate
        needs write permission, and so does a mode change by anyone else that only drops set-id bits (what a
        write makes the kernel ask for). ``session``: the caller's write session on ``ino`` (``ftruncate``):
        write permission was checked at open, so neither needs it now."""

    def create(self, caller: Caller, parent: int, name: bytes | str, mode: int, flags: int = os.O_RDWR) -> Opened:
        """open(O_CREAT): create a regular file, or open the existing one unless ``O_EXCL``. Opening for
        writing starts a write session (see :meth:`close`)."""

    def mknod(self, caller: Caller, parent: int, name: bytes | str, mode: int, rdev: int = 0) -> Attr:
        """Regular files, FIFOs and sockets for anyone; character/block devices for root only."""

    def mkdir(self, caller: Caller, parent: int, name: bytes | str, mode: int) -> Attr:
        ...

    def unlink(self, caller: Caller, parent: int, name: bytes | str) -> Attr:
        """Remove a non-directory's name; returns the parent directory's new attributes."""

    def rmdir(self, caller: Caller, parent: int, name: bytes | str) -> Attr:
        """Remove an empty directory; returns the parent directory's new attributes."""

    def symlink(self, caller: Caller, parent: int, name: bytes | str, target: bytes | str) -> Attr:
        ...

    def readlink(self, caller: Caller, ino: int) -> bytes:
        ...

    def link(self, caller: Caller, ino: int, newparent: int, newname: bytes | str) -> Attr:
        ...

    def rename(self, caller: Caller, parent: int, name: bytes | str, newparent: int, newname: bytes | str,
               flags: int = 0) -> None:
        """Atomic rename with Linux's RENAME_NOREPLACE / RENAME_EXCHANGE flags."""

    def readdir(self, caller: Caller, ino: int, cookie: bytes = b"", limit: int = 256) -> DirPage:
        """Up to ``limit`` entries after ``cookie`` (the last name of the previous page; b"" to start), with
        attributes for readdirplus.  Names are in byte order, so paging stays correct while the directory
        changes: no entry twice, none that existed throughout lost."""

    def statfs(self, caller: Caller) -> StatFs:
        ...

    def getxattr(self, caller: Caller, ino: int, name: bytes | str) -> bytes:
        ...

    def setxattr(self, caller: Caller, ino: int, name: bytes | str, value: bytes, flags: int = 0) -> None:
        ...

    def listxattr(self, caller: Caller, ino: int) -> list[bytes]:
        """Names the caller may see (trusted.* only for root)."""

    def removexattr(self, caller: Caller, ino: int, name: bytes | str) -> None:
        ...

    def open(self, caller: Caller, ino: int, flags: int, hold: bool = False) -> Opened:
        """Check access for ``flags``; ``O_TRUNC`` truncates; opening a regular file for writing starts a
        write session that keeps its chunks alive until :meth:`close`. ``hold``: a read-only open of a regular
        file gets a hold session (``Opened.hold``), which keeps the file readable after its last name goes, as
        POSIX wants, until it is closed the same way (or its client's lease lapses)."""

    def close(self, caller: Caller, ino: int, session: int | None, exact_length: int | None = None) -> Attr:
        """End a session, a write session or a hold (idempotent, so a retried close is harmless), optionally
        fixing the exact length first (write sessions only). An unlinked file's chunks become collectable when
        its last session closes."""

    def report_length(self, caller: Caller, ino: int, session: int, end_offset: int, *,
                      mtime: TimeSpec = "now") -> Attr:
        """A writer wrote up to ``end_offset``: the length becomes the max of both, mtime is updated, and an
        unprivileged writer clears the set-id bits."""

    def set_length(self, caller: Caller, ino: int, session: int, length: int) -> Attr:
        """The exact length the writer knows (fsync/close), possibly shorter than reported maxima."""

    def get_layout(self, caller: Caller, ino: int) -> Layout:
        """A file's layout, or the layout a directory gives its new children."""

    def set_layout(self, caller: Caller, ino: int, layout: Layout) -> None:
        """Set what new children of directory ``ino`` inherit (owner or root only)."""

    def resolve(self, caller: Caller, path: bytes | str, *, follow: bool = True) -> Attr:
        """Walk an absolute path from the root with search checks on every directory, following symlinks in
        the middle (and at the end if ``follow``); ELOOP after SYMLOOP_MAX of them."""

    def access(self, caller: Caller, ino: int, mask: int) -> bool:
        """access(2): True when ``caller`` may read/write/execute (``mask`` of R_OK|W_OK|X_OK) the inode."""

    def close_sessions(self, caller: Caller, sessions: list[tuple[int, int, int | None]]) -> int:
        """:meth:`close` of many ``(ino, session, exact_length)`` in one transaction: a mount ending the
        sessions of many small files sends them together instead of a round trip each. Sessions already ended
        (a retry) and inodes already gone are skipped; returns how many sessions this call ended."""

    def renew_client(self, caller: Caller) -> float:
        """The calling client is alive: its write sessions stay. Returns the lease in seconds: the client
        renews well within it (so it need not be configured on both sides)."""

    def delegate(self, caller: Caller, directory: int, epoch: int = 0, removes: bool = False) -> Delegated:
        """Grant ``directory`` to the calling client (meta/delegation.py), or with ``epoch`` renew that grant
        and hand it another block of inode ids. Not granted (no error) while another client holds it, when it
        has more than MAX_DELEGATED_NAMES names, or when the renewed grant has lapsed. ``removes``: a grant under
        which the holder may remove any non-directory's name; while another client holds the directory, this
        asks for it back (EAGAIN, as any call that finds a grant) instead of answering "not granted". Needs
        write and search permission on the directory, and a client id."""

    def undelegate(self, caller: Caller, directories: list[int]) -> int:
        """Give back the calling client's delegations of ``directories`` (after sending every change made
        under them); returns how many it held. Idempotent."""

    def apply_delegated(self, caller: Caller, directory: int, epoch: int, ops: list[DirOp]) -> list[int]:
        """Apply, in order and in one transaction, changes the calling client made in ``directory`` under
        grant ``epoch`` and already answered; renews the grant. Returns an errno per change (0: applied, also
        by an earlier try of the same batch, so a client may send a batch again after losing an answer); a
        change that fails changes nothing. ENOLCK, with nothing applied, when the client no longer holds that
        grant: it gave it back, or it lapsed and another client has used the directory since (which broke it)."""

    def batch_lookup(self, caller: Caller, parent: int, names: list[bytes]) -> list[Found | None]:
        """:meth:`lookup` of many names in ``parent`` in one transaction: each one's attributes and, for a
        file, its layout (what a reader needs before its chunk I/O), or None where there is no such name."""

    def begin_puts(self, caller: Caller, parent: int, puts: list[tuple[bytes, bytes]],
                   mode: int) -> list[Opened | None]:
        """The first half of write-once puts into ``parent``, in one transaction: for each ``(name, temp)``,
        None when ``name`` exists (a value written once needs no rewrite), else the temporary file ``temp``
        created as ``create(O_EXCL)`` would, with a write session."""

    def commit_puts(self, caller: Caller, parent: int, commits: list[Commit]) -> list[int]:
        """The second half, in one transaction, once all bytes are on every replica: per commit the write
        session ends at the exact length and the temporary file is renamed onto its name with RENAME_NOREPLACE
        (0). -EEXIST: the name appeared since (another put won); the temporary file is removed and the first
        value stands. Another -errno: the temporary file is no longer the one begun (-ENOENT: removed as an
        orphan; -EBADF: its session ended when the client's lease lapsed)."""

    def batch_unlink(self, caller: Caller, parent: int, names: list[bytes]) -> list[int]:
        """:meth:`unlink` of many names in ``parent`` in one transaction: 0 or -errno per name."""

    def touch_atimes(self, caller: Caller, parent: int, names: list[bytes]) -> int:
        """Set the access time of names in ``parent`` to now: accesses a client recorded and sends together,
        so that a read costs no metadata write of its own (eviction orders by them). Like utimens(UTIME_NOW)
        it needs ownership or write permission; names gone or not allowed are skipped. Returns how many were
        set."""
