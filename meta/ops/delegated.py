"""Directory delegations: granting them, and applying the creates and removals their holders already answered.

The rules are in :mod:`kvfs.meta.delegation`; the grant records are kept by
:class:`kvfs.meta.components.delegations.Delegations`. A holder's changes go through the same checks and helpers as
everyone's (:class:`.entries.EntryOps`), at the time the holder made them.
"""

from __future__ import annotations

import errno
import stat

import msgspec

from kvfs.errors import KvfsError
from kvfs.kv import Transaction
from kvfs.meta import schema
from kvfs.meta.delegation import DelegationHeld
from kvfs.meta.ops.base import HOLDER_TIME
from kvfs.meta.ops.entries import EntryOps
from kvfs.meta.posix import W_OK, X_OK, check_name, errno_error
from kvfs.meta.records import decode_inode, get_entry, get_live, put_inode
from kvfs.meta.types import ID_BLOCK, Caller, CreateOp, Delegated, Delegation, DirOp, Inode


class DelegationOps(EntryOps):
    """delegate, undelegate, apply_delegated."""

    def delegate(self, caller: Caller, directory: int, epoch: int = 0, removes: bool = False) -> Delegated:
        """Grant ``directory`` to the calling client (meta/delegation.py), or with ``epoch`` renew that grant and
        hand it another block of inode ids. Not granted (no error) while another client holds it, when it has more
        than MAX_DELEGATED_NAMES names, or when the renewed grant has lapsed. ``removes``: a grant for removals
        (rule 5), which waits for another client's grant as any other call does: :class:`DelegationHeld`, so the
        service recalls (or breaks) that grant and the caller retries, since a mount that removes files one
        after another gains only once it holds the directory. Needs write and search permission on the
        directory, and a client id."""
        if not caller.client:
            raise errno_error(errno.EINVAL, "a delegation needs a client id")
        try:
            return self._write(self._delegate, caller, directory, epoch, removes)
        except DelegationHeld:
            if removes and not epoch:
                raise
            return Delegated(False)

    def _delegate(self, tr: Transaction, caller: Caller, directory: int, epoch: int, removes: bool) -> Delegated:
        pdir = self._dir(tr, caller, directory, W_OK | X_OK)
        return self._delegations.grant(tr, caller, pdir, self._layout(pdir), epoch, removes)

    def undelegate(self, caller: Caller, directories: list[int]) -> int:
        """Give back the calling client's delegations of ``directories`` (after sending every change made under
        them); returns how many it held. Idempotent."""
        return self._delegations.give_back(caller, directories)

    def apply_delegated(self, caller: Caller, directory: int, epoch: int, ops: list[DirOp]) -> list[int]:
        """Apply, in order and in one transaction, changes the calling client made in ``directory`` under grant
        ``epoch`` and already answered; renews the grant. Returns an errno per change (0: applied, also by an
        earlier try of the same batch, so a client may send a batch again after losing an answer); a change that
        fails changes nothing. ENOLCK, with nothing applied, when the client no longer holds that grant: it gave it
        back, or it lapsed and another client has used the directory since (which broke it)."""
        if not caller.client:
            raise errno_error(errno.EINVAL, "a delegation needs a client id")
        return self._write(self._apply_delegated, caller, directory, epoch, ops)

    def _apply_delegated(self, tr: Transaction, caller: Caller, directory: int, epoch: int,
                         ops: list[DirOp]) -> list[int]:
        held = self._delegations.claim(tr, caller, directory, epoch)
        pdir = get_live(tr, directory)  # loaded once and stored once for the whole batch
        results = []
        for op in ops:
            who = msgspec.structs.replace(op.who, client=caller.client)  # its sessions live on the holder's lease
            token = HOLDER_TIME.set(op.time_ns)
            try:
                if isinstance(op, CreateOp):
                    self._delegated_create(tr, who, pdir, held, op)
                elif (entry := get_entry(tr, directory, check_name(op.name))) is not None:
                    # (none: removed by an earlier try of this batch)
                    if entry.ino != op.ino:
                        raise errno_error(errno.ENOENT, f"{op.name!r} is not inode {op.ino}")
                    self._remove(tr, who, directory, op.name, False, parent_inode=pdir)
                results.append(0)
            except KvfsError as exc:  # raised before the change wrote anything
                results.append(exc.errno or errno.EIO)
            finally:
                HOLDER_TIME.reset(token)
        if any(code == 0 for code in results):
            put_inode(tr, pdir)
        return results

    def _delegated_create(self, tr: Transaction, who: Caller, pdir: Inode, held: Delegation, op: CreateOp) -> None:
        if not any(first <= op.ino < first + ID_BLOCK for first in held.blocks):
            raise errno_error(errno.EINVAL, f"inode id {op.ino} was not handed to this delegation")
        name = check_name(op.name)
        raw = tr.get(schema.inode(op.ino))
        if raw is not None:  # made by an earlier try of this batch (and perhaps removed again), or misused
            entry = get_entry(tr, pdir.attr.ino, name)
            if decode_inode(raw).attr.nlink == 0 or (entry is not None and entry.ino == op.ino):
                return
            raise errno_error(errno.EINVAL, f"inode id {op.ino} is in use")
        if msgspec.structs.replace(self._layout(pdir), seed=op.layout.seed) != op.layout:
            raise errno_error(errno.ESTALE, f"directory {pdir.attr.ino} gives new files another layout than {op.layout}")
        inode = self._make(tr, who, pdir.attr.ino, name, stat.S_IFREG | (op.mode & 0o7777), op.ino,
                           seed=op.layout.seed, parent_inode=pdir, written=op.session is not None, grant=held.epoch)
        if op.session is not None:  # None: the holder ended it before sending the create (nothing was written)
            self._sessions.start(tr, who, inode, op.flags, sid=op.session)
