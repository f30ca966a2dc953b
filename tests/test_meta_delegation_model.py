"""A model-based check of the delegation protocol (meta/delegation.py) on a real MetaStore.

A holder answers creates and removals in a directory itself and queues them; another client creates, removes and
lists names there, and every one of its calls that finds the grant recalls it (the holder sends its queue and
gives the directory back, as fuse/dirops.py does), then retries; only its removal of a file the holder did not make
under an ordinary grant goes ahead at once, and the holder gives the directory back once the feed tells it. Under a
grant for removals the holder also removes names it did not make, and every removal by the other client recalls. Time moves on at random, so grants lapse, with or
without changes still queued. The model is the namespace as clients were told it, in the order they were told:
what the other client sees must always be the model, except that changes the holder had not sent when its grant
lapsed are lost (and only those); meta's invariants must hold throughout.
"""

from __future__ import annotations

import os

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfs.errors import KvfsError
from kvfs.meta.chunks import MemoryChunkRemover
from kvfs.meta.delegation import DelegationHeld
from kvfs.meta.fsck import check
from kvfs.kv import SqliteDatabase
from kvfs.meta.store import MetaStore
from kvfs.meta.types import ID_BLOCK
from kvfs.meta.types import Caller, CreateOp, UnlinkOp

HOLDER = Caller(1000, 1000, client=b"holder")
OTHER = Caller(1000, 1000, client=b"other")
LEASE = 5.0
USE = 0.6  # of the lease since the last renewal: the holder stops answering then (fuse/dirops.py, USE_FRACTION)
NAMES = st.sampled_from([f"n{i}".encode() for i in range(8)])


class Clock:
    now = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.now


class Delegations(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.db = SqliteDatabase(os.path.join(self.tmp.name, "meta.db"))
        self.clock = Clock()
        self.ms = MetaStore(self.db, chunk_remover=MemoryChunkRemover(), clock=self.clock, delegation_lease=LEASE)
        self.ms.format(mode=0o777)
        self.dir = self.ms.mkdir(HOLDER, 1, b"d", 0o777).ino
        self.model: dict[bytes, int] = {}  # name -> inode, as clients were told
        self.grant = None  # the holder's grant, while it thinks it holds the directory
        self.names: set[bytes] = set()  # the holder's listing
        self.own: dict[bytes, int] = {}
        self.others: dict[bytes, int] = {}  # under a grant for removals: the names it carried, not yet removed
        self.ids: list[int] = []
        self.queue: list = []
        self.undo: list = []  # how to take each queued change back out of the model if it is lost
        self.renewed = 0  # the clock when the grant was last granted or renewed
        self.lapsed = False  # the grant lapsed with changes queued: the model has dropped them already

    def _since_renewed(self) -> float:
        return (self.clock() - self.renewed) / 1e9

    def _holder_checks_its_grant(self) -> None:
        """What the holder's clock says before anything else happens: past the lease, what it had not sent is lost
        (meta refuses it); past USE of it, it sends what it has and gives the directory back."""
        if self.grant is None:
            return
        if self._since_renewed() >= USE * LEASE:
            self._send()
            if self.grant is not None:
                self.ms.undelegate(HOLDER, [self.dir])
                self.grant = None

    def teardown(self) -> None:
        self.db.close()
        self.tmp.cleanup()

    # ------------------------------------------------------------------ the holder --------
    @precondition(lambda self: self.grant is None)
    @rule(removes=st.booleans())
    def holder_asks(self, removes: bool) -> None:
        grant = self.ms.delegate(HOLDER, self.dir, removes=removes)
        if grant.granted:
            self.renewed = self.clock()
            assert set(grant.names) == set(self.model)
            self.others = {name: entry.ino for name, entry in zip(grant.names, grant.entries)} if removes else {}
            assert not removes or self.others == self.model
            self.grant, self.names, self.own = grant, set(grant.names), {}
            self.ids = list(range(grant.ids, grant.ids + ID_BLOCK))

    @precondition(lambda self: self.grant is not None)
    @rule(name=NAMES)
    def holder_creates(self, name: bytes) -> None:
        self._holder_checks_its_grant()
        if self.grant is None or name in self.names:
            return
        ino = self.ids.pop()
        layout = msgspec.structs.replace(self.grant.layout, seed=ino)
        self.queue.append(CreateOp(HOLDER, name, ino, 0o644, os.O_WRONLY, self.clock(), layout, None))
        self.undo.append(("create", name))
        self.names.add(name)
        self.own[name] = ino
        self.model[name] = ino

    @precondition(lambda self: self.grant is not None)
    @rule(name=NAMES)
    def holder_removes(self, name: bytes) -> None:
        self._holder_checks_its_grant()
        if self.grant is None or (name not in self.own and name not in self.others):
            return
        ino = self.own.pop(name) if name in self.own else self.others.pop(name)
        self.queue.append(UnlinkOp(HOLDER, name, ino, self.clock()))
        self.undo.append(("unlink", name, ino))
        self.names.discard(name)
        del self.model[name]

    @precondition(lambda self: self.grant is not None)
    @rule()
    def holder_sends(self) -> None:
        self._holder_checks_its_grant()
        self._send()

    def _send(self) -> None:
        if not self.queue or self.grant is None:
            return
        try:
            results = self.ms.apply_delegated(HOLDER, self.dir, self.grant.epoch, self.queue)
        except KvfsError as exc:  # lapsed: nothing applied, every queued change is lost
            assert exc.errno == 37  # ENOLCK
            self._lose_queue()
            self.grant = None
        else:
            assert not self.lapsed, "a lapsed grant's changes were applied after others saw the directory"
            assert results == [0] * len(self.queue)
            self.renewed = self.clock()
        self.queue, self.undo, self.lapsed = [], [], False

    def _lose_queue(self) -> None:
        if self.lapsed:
            return
        for undo in reversed(self.undo):
            if undo[0] == "create":
                del self.model[undo[1]]
            else:
                self.model[undo[1]] = undo[2]
        self.lapsed = True

    def _recall(self) -> None:
        """The holder got a recall: send the queue, give the directory back."""
        self._holder_checks_its_grant()
        if self.grant is not None:
            self._send()
            self.ms.undelegate(HOLDER, [self.dir])
            self.grant = None

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0]))
    def time_passes(self, seconds: float) -> None:
        """The holder may not notice (it was cut off): see _as_other."""
        self.clock.now += int(seconds * 1e9)

    # ------------------------------------------------------------------ the other client --
    def _as_other(self, fn, *args):
        """The other client acts first; a holder cut off for longer than its lease has lost what it queued."""
        if self.grant is not None and self._since_renewed() >= LEASE and self.queue:
            self._lose_queue()
        for _ in range(3):
            try:
                return fn(OTHER, *args)
            except DelegationHeld as held:
                if held.lapsed:  # what the service does: break it; the holder's queue is lost (above)
                    self.ms.answer_held(held)
                else:
                    self._recall()
        raise AssertionError("still delegated after the recall")

    @rule(name=NAMES)
    def other_creates(self, name: bytes) -> None:
        try:
            opened = self._as_other(self.ms.create, self.dir, name, 0o644, os.O_WRONLY | os.O_EXCL)
        except KvfsError as exc:
            assert exc.errno == 17 and name in self.model  # EEXIST
            return
        assert name not in self.model
        self.ms.close(OTHER, opened.attr.ino, opened.session)
        self.model[name] = opened.attr.ino

    @rule(name=NAMES)
    def other_removes(self, name: bytes) -> None:
        try:
            self._as_other(self.ms.unlink, self.dir, name)
        except KvfsError as exc:
            assert exc.errno == 2 and name not in self.model  # ENOENT
            return
        assert name in self.model
        del self.model[name]
        if self.grant is not None:
            if self._since_renewed() < LEASE:  # removed without a recall (rule 5): not what the holder made under
                # its grant, and not under a grant for removals; past the lease, the grant was meta's to break
                assert name not in self.own and self.grant.entries is None, "a removal raced the holder's"
            self._recall()  # the holder hears of it in the feed, and gives the directory back (fuse/dirops.py)

    @rule()
    def other_lists(self) -> None:
        page = self._as_other(self.ms.readdir, self.dir)
        assert {e.name: e.attr.ino for e in page.entries} == self.model

    @invariant()
    def namespace_is_consistent(self) -> None:
        if hasattr(self, "db"):
            assert check(self.db) == []


TestDelegations = Delegations.TestCase
TestDelegations.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
