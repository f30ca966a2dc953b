"""Directory delegations: one client may create and remove names in a directory without asking meta first.

A metadata call costs a mount a round trip and meta a transaction, so a program that makes or removes files one
after another is bound by that latency. A client that holds a directory's delegation answers a create or an
unlink there itself and sends the changes after it, in batches (``MetaStore.apply_delegated``), as NFSv4
directory delegations and CephFS's asynchronous directory operations do. The rules that keep this correct:

1. **One holder.** ``MetaStore.delegate`` grants a directory to one client (a record under ``("meta", "L",
   dir)``) together with every name in it, so the holder knows which names are free. Grants lapse after
   ``DELEGATION_SECONDS`` unless the holder's batches renew them.
2. **Nobody else sees the directory while it is held.** Every operation of another client that reads or changes
   the directory's entries or attributes finds the record and fails with :class:`DelegationHeld` before it
   reads anything. The service then publishes a *recall* in the change feed (``Change.recalls``), or breaks a
   lapsed grant (rule 3), and answers EAGAIN; the caller retries (:func:`retry_while_recalled`). The holder, which follows the feed, sends what it
   has not sent yet and gives the directory back (``undelegate``); the retry then sees every change the holder
   answered, in the holder's order. A holder that is gone is waited out until its grant lapses.
3. **A lapsed grant applies nothing once another client has used the directory.** A batch names the grant's
   epoch; meta refuses it (ENOLCK) unless the holder still holds that epoch. Another client that finds a lapsed
   grant breaks it first (``MetaStore.break_lapsed``, its own transaction) and then goes on, so the holder's
   late changes can never appear behind what that client saw. A lapsed grant nobody touched still takes the
   holder's batch (a meta restart longer than the lease loses nothing). The holder stops answering locally
   well before its grant can lapse (it counts from when it sent the call that last renewed it), so only a holder
   cut off from meta for longer than that while others use the directory loses changes it answered, and it
   logs each one.
4. **The holder chooses what the answer showed** (inode ids from blocks meta handed to it, times, placement
   seeds, write sessions) and meta applies exactly that, after the same permission checks as ever: both sides
   build a new file's attributes with ``kvfs.meta.posix.child_attr``. Meta accepts only ids from the grant's blocks.
5. **Another client may remove what the holder did not make, unless the grant is for removals.** Under an
   ordinary grant the holder answers removals only of files it made under it (``Inode.grant`` records which grant
   made an inode) and creates only of names its listing lacks, so another client's unlink of a non-directory the
   holder did not make under this grant goes ahead without a recall: nothing the holder answers depends on it,
   and the holder learns of it from the feed as of any other client's change. So a creator's grant does not
   stand in the way of another client's ``rm``. A grant *for removals* (``delegate(..., removes=True)``, asked
   for by a mount that removes names one after another: ``rm`` of another client's files) carries each name's
   inode and type, and its holder answers the unlink of any non-directory there; rule 5 does not apply to it,
   so two clients can never both succeed in removing one name. Asking for it recalls another client's grant.

What stays synchronous: everything but creating regular files and removing names of files the holder itself
created under the grant (other clients cannot know those inodes except through the directory), or under a grant
for removals of any non-directory (where the sticky bit needs a file's owner, the holder asks meta). A client's other
metadata calls wait until its earlier delegated changes are applied, so its own view is in program order.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from kvfs.errors import KvfsError

T = TypeVar("T")

#: How long a grant lasts without a renewal (a batch of changes renews it).
DELEGATION_SECONDS = 5.0
#: A directory with more names than this is not delegated (the grant carries every name).
MAX_DELEGATED_NAMES = 1 << 16
#: Inode-id blocks a grant keeps valid: the holder's queued creates may still use the ones before the newest.
BLOCKS_KEPT = 4
#: How long a caller keeps retrying an operation that waits for a recall: a vanished holder's grant must lapse.
RECALL_WAIT = 2 * DELEGATION_SECONDS + 5.0


class DelegationHeld(KvfsError):
    """The operation needs a directory another client holds; nothing was read or changed."""

    default_errno = errno.EAGAIN

    def __init__(self, directory: int, lapsed: bool = False) -> None:
        super().__init__(f"directory {directory} is delegated to another client; recalled, retry", errno.EAGAIN)
        self.directory = directory
        self.lapsed = lapsed  # the grant has lapsed: it is broken (not recalled) before the retry

    def __reduce__(self):
        return (type(self), (self.directory, self.lapsed))


async def retry_while_recalled(call: Callable[[], Awaitable[T]], *, wait: float = RECALL_WAIT) -> T:
    """``await call()``, again and again while it fails with EAGAIN (a recall is under way: see the module
    docstring), backing off from 1 ms to 50 ms, for up to ``wait`` seconds."""
    deadline = trio.current_time() + wait
    delay = 0.001
    while True:
        try:
            return await call()
        except OSError as exc:
            if exc.errno != errno.EAGAIN or trio.current_time() + delay > deadline:
                raise
        await trio.sleep(delay)
        delay = min(delay * 2, 0.05)
