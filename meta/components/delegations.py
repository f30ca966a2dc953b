"""Directory delegations, meta's side: the grant records under ``("meta", "L", dir)`` and the checks against them.

The rules are in :mod:`kvfs.meta.delegation` (which also holds the client's side); applying a holder's changes is
an operation on entries (:mod:`kvfs.meta.ops.delegated`).
"""

from __future__ import annotations

import errno
import random
import secrets
import stat
from typing import Callable

import msgspec

from kvfs.kv import Transaction
from kvfs.kv.keys import unpack
from kvfs.meta import schema
from kvfs.meta.components.ids import InodeIds
from kvfs.meta.delegation import BLOCKS_KEPT, MAX_DELEGATED_NAMES, DelegationHeld
from kvfs.meta.feed import ORIGIN, FeedDatabase
from kvfs.meta.posix import errno_error
from kvfs.meta.records import decode_entry, encoder, get_entry, get_inode
from kvfs.meta.types import ID_SHARDS, Caller, Change, Delegated, Delegation, Inode, Layout

_dec_delegation = msgspec.msgpack.Decoder(Delegation)


class Delegations:
    """Grants, renews, checks and ends delegations; ``lease_ns``: how long a grant lasts unrenewed."""

    def __init__(self, db: FeedDatabase, clock: Callable[[], int], lease_ns: int) -> None:
        self._db = db
        self._clock = clock
        self._lease_ns = lease_ns

    def _held(self, tr: Transaction, directory: int) -> Delegation | None:
        raw = tr.get(schema.delegation(directory))
        return None if raw is None else _dec_delegation.decode(raw)

    def check(self, tr: Transaction, caller: Caller, directory: int, *, removing: bytes | None = None) -> None:
        """Raise :class:`DelegationHeld` if another client holds ``directory``: it may have answered changes there
        that meta has not seen yet (meta/delegation.py). ``removing``: the caller removes that name of a
        non-directory, which may go ahead under a live grant if its inode was not made under it, unless the grant is
        one for removals (rule 5)."""
        held = self._held(tr, directory)
        if held is None:
            return
        if caller.client and held.client == caller.client:
            return
        # a lapsed one is broken first (break_lapsed, its own transaction), so its holder's late changes cannot
        # follow what this caller sees
        lapsed = held.expires_ns <= self._clock()
        if (removing is not None and not lapsed and not held.removes
                and _made_outside(tr, directory, removing, held.epoch)):
            return
        raise DelegationHeld(directory, lapsed=lapsed)

    def grant(self, tr: Transaction, caller: Caller, pdir: Inode, layout: Layout, epoch: int,
              removes: bool = False) -> Delegated:
        """Grant directory ``pdir`` (whose new files get ``layout``) to the caller's client, or with ``epoch`` renew
        that grant; with a fresh block of inode ids either way (see :meth:`kvfs.meta.store.MetaStore.delegate`).
        ``removes``: a grant for removals, which carries each name's entry too (a renewal keeps what it was)."""
        directory = pdir.attr.ino
        key = schema.delegation(directory)
        held = self._held(tr, directory)
        now = self._clock()
        lease = self._lease_ns / 1e9
        if epoch:
            if held is None or held.client != caller.client or held.epoch != epoch:
                return Delegated(False)
            ids = InodeIds.reserve_block(tr, random.randrange(ID_SHARDS))
            blocks = (held.blocks + [ids])[-BLOCKS_KEPT:]
            tr.set(key, encoder.encode(msgspec.structs.replace(held, expires_ns=now + self._lease_ns, blocks=blocks)))
            return Delegated(True, epoch, lease, ids)
        rows = tr.get_range(*schema.dir_range(directory), limit=MAX_DELEGATED_NAMES + 1)
        if len(rows) > MAX_DELEGATED_NAMES:
            return Delegated(False)
        ids = InodeIds.reserve_block(tr, random.randrange(ID_SHARDS))
        epoch = secrets.randbits(62) + 1
        tr.set(key, encoder.encode(Delegation(caller.client, epoch, now + self._lease_ns, [ids], removes)))
        entries = [decode_entry(v) for _, v in rows] if removes else None
        return Delegated(True, epoch, lease, ids, pdir.attr, layout, [unpack(k)[-1] for k, _ in rows], entries)

    def claim(self, tr: Transaction, caller: Caller, directory: int, epoch: int) -> Delegation:
        """The caller's grant ``epoch`` of ``directory``, renewed; ENOLCK if the caller no longer holds it."""
        held = self._held(tr, directory)
        now = self._clock()
        if held is None or held.client != caller.client or held.epoch != epoch:
            raise errno_error(errno.ENOLCK, f"the delegation of directory {directory} was given back, or lapsed and "
                                     f"another client used the directory since")
        renewed = msgspec.structs.replace(held, expires_ns=now + self._lease_ns)
        tr.set(schema.delegation(directory), encoder.encode(renewed))
        return held

    @staticmethod
    def remove(tr: Transaction, directory: int) -> None:
        """End any grant of ``directory`` (it is being removed)."""
        tr.clear(schema.delegation(directory))

    def give_back(self, caller: Caller, directories: list[int]) -> int:
        """End the caller's grants of ``directories``; returns how many it held."""
        def fn(tr: Transaction) -> int:
            released = 0
            for directory in directories:
                held = self._held(tr, directory)
                if held is not None and caller.client and held.client == caller.client:
                    self.remove(tr, directory)
                    released += 1
            return released

        return self._db.run(fn)

    def recall(self, directory: int) -> None:
        """See :meth:`kvfs.meta.store.MetaStore.recall`."""
        self._db.publish(Change(ORIGIN.get(), self._clock(), [], [], [directory]))

    def break_lapsed(self, directory: int) -> None:
        """See :meth:`kvfs.meta.store.MetaStore.break_lapsed`."""
        def fn(tr: Transaction) -> None:
            held = self._held(tr, directory)
            if held is not None and held.expires_ns <= self._clock():
                self.remove(tr, directory)

        self._db.run(fn)

    def answer(self, held: DelegationHeld) -> None:
        """See :meth:`kvfs.meta.store.MetaStore.answer_held`."""
        if held.lapsed:
            self.break_lapsed(held.directory)
        else:
            self.recall(held.directory)


def _made_outside(tr: Transaction, directory: int, name: bytes, epoch: int) -> bool:
    """Whether ``name`` in ``directory`` names a non-directory that grant ``epoch``'s holder did not make: the holder
    answers removals only of files it made under its grant, and creates only of names its listing lacks, so it
    cannot have answered anything about this name that meta has not seen."""
    entry = get_entry(tr, directory, name)
    if entry is None or stat.S_ISDIR(entry.type):
        return False
    return get_inode(tr, entry.ino).grant != epoch
