"""Transitions of the chain member state machine, driven by hand (no simulator, no I/O)."""

from __future__ import annotations

import errno

import msgspec
import pytest
from crc32c import crc32c

from kvfs.errors import ProtocolError

from kvfs.craq.member import (
    Abort, AskTail, ChainMember, PersistFailed, ChunkState, Commit, Configure, DropChunks, PersistPending, Persisted,
    ReplyClient, ReportToMgmtd, Retry, Send, SendChunk, ServeVersion, Tick,
)
from kvfs.craq.messages import (
    AckStatus, BlockDelta, ChainConfig, ChainTarget, ChecksumReport, ChunkId, ResyncDone, ResyncDrop, ResyncDropped,
    ResyncPull, ResyncQuery, ResyncState, TargetState,
    UpdateAck, UpdateReq, VersionQuery, VersionReply, WireMessage, WriteReq, ChunkSummary,
)
from kvfs.craq.sim import MemEngine, _Version

CID = ChunkId(7, 0)
S, Y, O = TargetState.SERVING, TargetState.SYNCING, TargetState.OFFLINE


def config(version: int, *targets: tuple[int, TargetState]) -> ChainConfig:
    return ChainConfig(1, version, tuple(ChainTarget(t, t, s) for t, s in targets))


def write(data: bytes, request_id: int = 1, client_id: int = 9, version: int = 1, crc: int | None = None) -> WriteReq:
    return WriteReq(1, version, CID, client_id, request_id, 0, crc32c(data) if crc is None else crc, data)


class Chain:
    """Members plus engine models; effects are run by hand so each test controls what is delivered when."""

    def __init__(self, cfg: ChainConfig, metas: dict[int, dict[ChunkId, ChunkState]] | None = None,
                 engines: dict[int, MemEngine] | None = None) -> None:
        """``engines``: what some targets hold already (their members start from it); ``metas`` without the bytes."""
        metas = metas or {t: e.meta() for t, e in (engines or {}).items()}
        self.members = {t.target_id: ChainMember(t.target_id, 1, metas.get(t.target_id)) for t in cfg.targets}
        self.engines = {t: (engines or {}).get(t) or MemEngine() for t in self.members}
        self.replies: list = []
        self.mgmtd: list = []
        self.outbox: list[tuple[int, object]] = []  # (target, message) not yet delivered
        self.sent: list[tuple[int, object]] = []  # (sender, message), everything ever sent
        self.full: set[int] = set()  # targets whose disk is full
        self.aborted: list[tuple[int, Abort]] = []
        for m in self.members.values():
            self.run(m.target_id, m.handle(Configure(cfg, lease_until=100.0)))

    def run(self, target: int, effects: list) -> list:
        """Execute effects; persists complete at once (or fail at targets in ``full``), sends go to the outbox."""
        engine = self.engines[target]
        for e in effects:
            if isinstance(e, PersistPending) and target in self.full:
                self.run(target, self.members[target].handle(PersistFailed(e.chunk_id, e.version, errno.ENOSPC, "full")))
            elif isinstance(e, PersistPending):
                crc, length = engine.write_pending(e)
                self.run(target, self.members[target].handle(Persisted(e.chunk_id, e.version, crc, length)))
            elif isinstance(e, Commit):
                engine.commit(e.chunk_id, e.version)
            elif isinstance(e, Abort):
                engine.pending.pop(e.chunk_id, None)
                self.aborted.append((target, e))
            elif isinstance(e, Send):
                self.outbox.append((e.target, e.msg))
                self.sent.append((target, e.msg))
            elif isinstance(e, SendChunk):
                self.outbox.append((e.target, msgspec.structs.replace(e.msg, data=engine.read(e.msg.chunk_id, e.msg.version))))
                self.sent.append((target, e.msg))
            elif isinstance(e, DropChunks):
                engine.remove(e.chunk_ids)
                self.outbox.append((e.target, e.ack))
                self.sent.append((target, e.ack))
            elif isinstance(e, ReplyClient):
                self.replies.append(e.msg)
            elif isinstance(e, ReportToMgmtd):
                self.mgmtd.append(e.msg)
        return effects

    def deliver_all(self) -> None:
        while self.outbox:
            target, msg = self.outbox.pop(0)
            self.run(target, self.members[target].handle(msg))

    def reconfigure(self, cfg: ChainConfig, *targets: int) -> None:
        for t in targets or self.members:
            self.run(t, self.members[t].handle(Configure(cfg, lease_until=100.0)))


def test_write_flows_down_and_commit_flows_back():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    head = chain.members[1]
    effects = head.handle(write(b"hello"))
    assert effects == [PersistPending(CID, 1, 0, b"hello", crc32c(b"hello"), False, {9: 1})]
    chain.run(1, effects)
    (target, update), = chain.outbox
    assert target == 2 and isinstance(update, UpdateReq) and update.version == 1
    chain.deliver_all()
    assert [m.chunk_versions(CID) for m in chain.members.values()] == [(1, None)] * 3
    (reply,) = chain.replies
    assert (reply.errno, reply.version, reply.request_id) == (0, 1, 1)


def test_tail_commits_before_it_acks_and_head_replies_last():
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"x")))
    target, update = chain.outbox.pop()
    tail_effects = chain.run(2, chain.members[2].handle(update))
    assert [type(e) for e in tail_effects] == [PersistPending]
    assert chain.members[2].chunk_versions(CID) == (1, None)  # the persist completed and it committed
    assert not chain.replies
    chain.deliver_all()
    assert chain.replies[0].errno == 0


def test_head_queues_a_second_write_until_the_first_commits():
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a", request_id=1)))
    assert chain.members[1].handle(write(b"b", request_id=2)) == []
    assert chain.members[1].chunk_versions(CID) == (0, 1)
    chain.deliver_all()
    assert [r.version for r in chain.replies] == [1, 2]
    assert chain.engines[2].committed[CID].data == b"b"


def test_client_retry_is_idempotent_while_pending_and_after_commit():
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    assert chain.members[1].handle(write(b"a")) == []  # attached to the pending write
    chain.deliver_all()
    assert len(chain.replies) == 1
    chain.run(1, chain.members[1].handle(write(b"a")))  # after commit: answered from the table
    assert [(r.errno, r.version) for r in chain.replies] == [(0, 1), (0, 1)]
    assert chain.members[1].chunk_versions(CID) == (1, None)


def test_checksum_mismatch_is_refused_at_head_and_at_successor():
    chain = Chain(config(1, (1, S), (2, S)))
    (reply,) = chain.members[1].handle(write(b"a", crc=123))
    assert reply.msg.errno == errno.EBADMSG
    bad = UpdateReq(1, 1, CID, 1, 1, 0, 123, data=b"a")
    (ack,) = chain.members[2].handle(bad)
    assert ack.msg.status is AckStatus.CHECKSUM and chain.members[2].chunk_versions(CID) == (0, None)


def test_stale_chain_version_is_refused():
    chain = Chain(config(2, (1, S), (2, S)))
    (reply,) = chain.members[1].handle(write(b"a", version=1))
    assert reply.msg.errno == errno.ESTALE
    (ack,) = chain.members[2].handle(UpdateReq(1, 3, CID, 1, 1, 0, crc32c(b"a"), data=b"a"))
    assert ack.msg.status is AckStatus.STALE and ack.msg.chain_version == 3  # echoes the sender's view


def test_successor_refuses_a_gap_and_predecessor_repairs_with_full_chunk():
    chain = Chain(config(1, (1, S), (2, S)))
    (ack,) = chain.members[2].handle(UpdateReq(1, 1, CID, 1, 5, 0, crc32c(b"z"), data=b"z"))
    assert ack.msg.status is AckStatus.VERSION_GAP and ack.msg.committed_version == 0
    for i, data in enumerate([b"a", b"b"], start=1):
        chain.run(1, chain.members[1].handle(write(data, request_id=i)))
        chain.deliver_all()
    chain.members[2], chain.engines[2] = ChainMember(2, 1), MemEngine()  # the successor lost its chunk
    chain.reconfigure(config(1, (1, S), (2, S)), 2)
    chain.run(1, chain.members[1].handle(write(b"c", request_id=3)))
    chain.deliver_all()
    assert chain.members[2].chunk_versions(CID) == (3, None)
    assert chain.engines[2].committed[CID].data == b"c" and chain.replies[-1].version == 3


def test_duplicate_update_is_idempotent():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    u = UpdateReq(1, 1, CID, 1, 1, 0, crc32c(b"a"), data=b"a")
    first = chain.members[2].handle(u)
    assert isinstance(first[0], PersistPending)
    assert chain.members[2].handle(u) == []  # still persisting: nothing new
    chain.members[2].handle(Persisted(CID, 1, crc32c(b"a"), 1))
    (again,) = chain.members[2].handle(u)  # persisted: forward again, no second persist
    assert isinstance(again, Send) and again.target == 3


@pytest.mark.parametrize("case", ["persisted_without_pending", "update_from_stranger", "write_at_middle",
                                  "ack_from_stranger", "sync_query_at_serving"])
def test_unexpected_messages_are_protocol_errors(case):
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    member, event = {
        "persisted_without_pending": (1, Persisted(CID, 1, 0, 0)),
        "update_from_stranger": (3, UpdateReq(1, 1, CID, 1, 1, 0, crc32c(b""))),
        "write_at_middle": (2, write(b"a")),
        "ack_from_stranger": (1, UpdateAck(1, 1, CID, 3, 1, AckStatus.OK)),
        "sync_query_at_serving": (3, ResyncQuery(1, 1, 2)),
    }[case]
    with pytest.raises(ProtocolError):
        chain.members[member].handle(event)


def test_reads_clean_dirty_and_tail():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    head, mid, tail = chain.members.values()
    assert head.read_decision(CID, 1) == ServeVersion(0)
    chain.run(1, head.handle(write(b"a")))
    chain.deliver_all()
    chain.run(1, head.handle(write(b"b", request_id=2)))  # pending at 1 only
    chain.outbox.clear()
    ask = head.read_decision(CID, 1)
    assert isinstance(ask, AskTail) and ask.target == 3
    assert tail.read_decision(CID, 1) == ServeVersion(1)
    reply = tail.answer_version_query(ask.query)
    assert reply.committed_version == 1 and head.decide_with_tail(CID, reply) == ServeVersion(1)
    assert isinstance(head.read_decision(CID, 2), Retry)  # wrong chain version
    head.handle(Tick(now=200.0))
    assert isinstance(head.read_decision(CID, 1), Retry)  # lease expired: mgmtd may have moved on


def test_tail_failure_redrives_pending_and_new_tail_commits_before_serving():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    target, update = chain.outbox.pop()
    chain.run(2, chain.members[2].handle(update))
    chain.outbox.clear()  # 2's forward to 3 is lost; 3 dies
    new = config(2, (1, S), (2, S), (3, O))
    chain.reconfigure(new, 1)
    assert isinstance(chain.members[2].read_decision(CID, 1), AskTail)  # a dirty middle asks the tail
    effects = chain.run(2, chain.members[2].handle(Configure(new, 100.0)))
    assert [type(e) for e in effects] == [Commit, Send]  # new end of chain commits at once, acks upstream
    chain.deliver_all()
    assert chain.replies[-1].errno == 0 and chain.members[1].chunk_versions(CID) == (1, None)


def test_new_tail_does_not_serve_a_pending_it_held_when_it_became_tail():
    """The old tail committed (and may have served) v1; the new tail still forwards v1 to a syncing target."""
    chain = Chain(config(1, (1, S), (2, S), (3, S), (4, Y)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    while chain.members[3].chunk_versions(CID) != (1, None):  # deliver until the old tail 3 committed
        target, msg = chain.outbox.pop(0)
        chain.run(target, chain.members[target].handle(msg))
    chain.outbox.clear()  # 3 dies: its ack to 2 is lost
    assert chain.members[3].read_decision(CID, 1) == ServeVersion(1)  # v1 was visible at the old tail
    new = config(2, (1, S), (2, S), (4, Y), (3, O))
    chain.reconfigure(new, 1, 2, 4)
    new_tail = chain.members[2]
    decision = new_tail.read_decision(CID, 2)
    assert isinstance(decision, Retry) and decision.error.errno == errno.EAGAIN  # not v0: that would un-see v1
    assert new_tail.answer_version_query(VersionQuery(1, 2, CID, 1, 1)).errno == errno.EAGAIN
    chain.deliver_all()  # 4 acks the re-driven v1 (it already committed it)
    assert new_tail.read_decision(CID, 2) == ServeVersion(1) and chain.replies[-1].errno == 0


def test_head_failure_leaves_the_pending_write_to_the_new_head():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    _, update = chain.outbox.pop()
    chain.run(2, chain.members[2].handle(update))
    chain.outbox.clear()
    new = config(2, (2, S), (3, S), (1, O))
    chain.reconfigure(new, 2, 3)
    chain.deliver_all()
    assert chain.members[3].chunk_versions(CID) == (1, None) and chain.members[2].chunk_versions(CID) == (1, None)
    chain.run(2, chain.members[2].handle(write(b"a", version=2)))  # the client's retry at the new head
    assert [(r.errno, r.version) for r in chain.replies] == [(0, 1)]


def test_resync_copies_differing_chunks_then_reports_done():
    chain = Chain(config(1, (1, S), (2, S)))
    for i, data in enumerate([b"a", b"b"], start=1):
        chain.run(1, chain.members[1].handle(write(data, request_id=i)))
        chain.deliver_all()
    # 2 restarts with nothing, comes back syncing at the end
    chain.members[2] = ChainMember(2, 1)
    chain.engines[2] = MemEngine()
    syncing = config(3, (1, S), (2, Y))
    effects = chain.members[1].handle(Configure(syncing, 100.0))
    assert effects == [Send(2, ResyncQuery(1, 3, 1))]
    assert chain.members[1].resync_progress() == (2, -1, -1)  # visible before the successor counted its chunks
    chain.run(1, effects)
    chain.run(2, chain.members[2].handle(Configure(syncing, 100.0)))
    chain.run(2, chain.members[2].handle(chain.outbox.pop(0)[1]))  # the query; its answer is now in the outbox
    chain.run(1, chain.members[1].handle(chain.outbox.pop(0)[1]))  # the answer: one chunk differs, copy sent
    assert chain.members[1].resync_progress() == (2, 1, 1)
    chain.deliver_all()
    assert chain.members[1].resync_progress() == (2, 0, 1)
    assert chain.mgmtd == [ResyncDone(1, 3, 2)]
    assert chain.engines[2].committed[CID].data == b"b" and chain.members[2].chunk_versions(CID) == (2, None)
    assert isinstance(chain.members[2].read_decision(CID, 3), Retry)  # syncing targets do not serve reads


def test_writes_during_sync_reach_the_syncing_target_as_sent_once_it_holds_the_chunk_from_the_live_chain():
    """Rule 3a: a chunk the syncing target held from before it left takes the first write whole (its version may
    be of another lineage under the same number); once the live chain wrote it there, writes go as sent."""
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    chain.deliver_all()
    chain.reconfigure(config(2, (1, S), (2, Y)))
    chain.outbox.clear()  # the resync: chunk 7 is in step, nothing to copy
    chain.run(1, chain.members[1].handle(WriteReq(1, 2, CID, 9, 2, 0, crc32c(b"b"), b"b")))
    (first,) = [m for _, m in chain.outbox if isinstance(m, UpdateReq)]
    assert not first.full_replace and first.data == b"b"
    chain.deliver_all()
    refusals = [m for _, m in chain.sent if isinstance(m, UpdateAck) and m.status is AckStatus.VERSION_GAP]
    wholes = [m for _, m in chain.sent if isinstance(m, UpdateReq) and m.full_replace]
    assert len(refusals) == 1 and len(wholes) == 1 and chain.replies[-1].errno == 0
    chain.sent.clear()
    chain.run(1, chain.members[1].handle(WriteReq(1, 2, CID, 9, 3, 0, crc32c(b"c"), b"c")))
    chain.deliver_all()
    assert [m.full_replace for _, m in chain.sent if isinstance(m, UpdateReq)] == [False]
    assert chain.replies[-1].errno == 0 and chain.engines[2].committed[CID].data == b"c"


def test_becoming_syncing_drops_pending_writes_of_the_old_lineage():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    member = chain.members[2]
    member.handle(UpdateReq(1, 1, CID, 1, 1, 0, crc32c(b"a"), data=b"a"))
    member.handle(Persisted(CID, 1, crc32c(b"a"), 1))
    assert member.chunk_versions(CID) == (0, 1)
    assert member.handle(Configure(config(3, (1, S), (3, S), (2, Y)), 100.0)) == []  # no commit, no ack
    assert member.chunk_versions(CID) == (0, None)


def test_restarted_last_serving_target_finishes_its_pending_write():
    meta = {CID: ChunkState(1, crc32c(b"a"), 1, {9: 1}, pending_version=2, pending_crc=crc32c(b"b"), pending_length=1)}
    member = ChainMember(1, 1, meta)
    assert member.handle(Configure(config(5, (1, S)), 100.0)) == [Commit(CID, 2)]
    assert member.read_decision(CID, 5) == ServeVersion(2)


def test_ack_with_different_crc_is_reported():
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    chain.outbox.clear()
    effects = chain.members[1].handle(UpdateAck(1, 1, CID, 2, 1, AckStatus.OK, 1, chunk_crc=1, chunk_len=1))
    assert isinstance(effects[0], ReportToMgmtd) and isinstance(effects[0].msg, ChecksumReport)
    assert isinstance(effects[1], Commit)


def test_retransmit_on_tick_until_acked():
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    chain.outbox.clear()  # lost
    assert chain.members[1].handle(Tick(0.01)) == []
    (resend,) = chain.members[1].handle(Tick(1.0))
    assert isinstance(resend, Send) and resend.msg.version == 1


def test_a_member_has_timers_only_while_a_write_or_resync_waits():
    """What lets a driver tick idle members rarely: nothing of theirs can time out."""
    chain = Chain(config(1, (1, S), (2, S)))
    head = chain.members[1]
    assert not head.has_timers()
    chain.run(1, head.handle(write(b"a")))
    assert head.has_timers()  # forwarded, waiting for its ack
    chain.deliver_all()
    assert not head.has_timers() and not chain.members[2].has_timers()
    head.handle(Configure(config(2, (1, S), (2, Y)), 100.0))
    assert head.has_timers()  # a resync of the returning target


def test_messages_round_trip_as_msgpack_with_data_stripped():
    u = UpdateReq(1, 2, CID, 1, 3, 0, crc32c(b"bulk"), requests={9: 1}, data=b"bulk")
    wire = msgspec.msgpack.encode(msgspec.structs.replace(u, data=None))
    back = msgspec.msgpack.decode(wire, type=WireMessage)
    assert msgspec.structs.replace(back, data=b"bulk") == u
    s = ResyncState(1, 2, 3, ())
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=WireMessage) == s


def test_a_dropped_pending_write_is_not_remembered_as_applied():
    """Regression (sim seed 2632): the idempotency table must only learn a request when its version commits."""
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    member = chain.members[2]
    member.handle(UpdateReq(1, 1, CID, 1, 1, 0, crc32c(b"a"), client_id=9, request_id=4, data=b"a"))
    member.handle(Persisted(CID, 1, crc32c(b"a"), 1))
    member.handle(Configure(config(2, (1, S), (3, S), (2, Y)), 100.0))  # cut off, comes back syncing
    member.handle(Configure(config(3, (2, S), (1, O), (3, O)), 100.0))  # ... and ends up the head
    effects = member.handle(write(b"a", request_id=4, version=3))
    assert isinstance(effects[0], PersistPending)  # applied, not answered "ok" from the table


def test_a_replica_that_cannot_store_a_write_fails_it_everywhere():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    chain.full = {3}  # the tail's disk is full
    chain.run(1, chain.members[1].handle(write(b"lost")))
    chain.deliver_all()
    (reply,) = chain.replies
    assert reply.errno == errno.ENOSPC
    assert sorted(t for t, _ in chain.aborted) == [1, 2]  # the members that had stored it dropped it
    assert all(m.chunk_versions(CID) == (0, None) for m in chain.members.values())
    assert all(not e.pending and not e.committed for e in chain.engines.values())
    chain.full = set()  # space freed: the next write takes the same version and commits everywhere
    chain.run(1, chain.members[1].handle(write(b"kept", request_id=2)))
    chain.deliver_all()
    assert chain.replies[-1].errno == 0 and chain.replies[-1].version == 1
    assert all(m.chunk_versions(CID) == (1, None) for m in chain.members.values())


@pytest.mark.parametrize("write_starts", ["after_sync_done", "before_sync_done"])
def test_tail_handing_over_to_a_synced_successor_stops_serving_dirty_chunks(write_starts):
    """Regression (sim seed 1318 with a coarse retransmit scan): a read tail that reported ResyncDone must not
    serve its committed version of a dirty chunk. The syncing successor (end of the write chain) commits the
    write first; mgmtd makes it serving, the new read tail, at once; the old tail has not heard yet (heartbeat
    reply in flight, or cut off from mgmtd with a valid lease) and would un-see what the new tail serves."""
    other = ChunkId(7, 1)
    chain = Chain(config(1, (1, S), (2, S), (3, O)))
    chain.run(1, chain.members[1].handle(WriteReq(1, 1, other, 9, 1, 0, crc32c(b"o"), b"o")))
    chain.deliver_all()  # `other` is committed at 1 and 2 only: the resync must copy it to 3

    def deliver(match) -> None:
        i = next(i for i, (t, m) in enumerate(chain.outbox) if match(t, m))
        target, msg = chain.outbox.pop(i)
        chain.run(target, chain.members[target].handle(msg))

    def is_chunk(cid):
        return lambda t, m: getattr(m, "chunk_id", None) == cid

    chain.reconfigure(config(2, (1, S), (2, S), (3, Y)))  # 3 returns syncing; 2 (read tail) asks for its list
    deliver(lambda t, m: isinstance(m, ResyncQuery))
    deliver(lambda t, m: isinstance(m, ResyncState))  # 2 sends the copy of `other`
    if write_starts == "after_sync_done":
        chain.deliver_all()
        assert chain.mgmtd == [ResyncDone(1, 2, 3)]
    chain.run(1, chain.members[1].handle(write(b"a", version=2)))
    while chain.members[3].chunk_versions(CID) != (1, None):  # the write reaches 3, which commits first
        deliver(is_chunk(CID))
    ((_, held),) = [(t, m) for t, m in chain.outbox if is_chunk(CID)(t, m)]
    chain.outbox.remove((2, held))  # 3's ack to 2 is slow
    chain.deliver_all()  # (before_sync_done: the copy of `other` is acked now, with the write still in flight)
    assert chain.mgmtd == [ResyncDone(1, 2, 3)] and chain.members[2].chunk_versions(CID) == (0, 1)

    promoted = config(3, (1, S), (2, S), (3, S))  # mgmtd acts on ResyncDone; 2 has not heard yet
    chain.reconfigure(promoted, 3)
    assert chain.members[3].read_decision(CID, 3) == ServeVersion(1)  # the new read tail serves v1 ...
    old_tail, head = chain.members[2], chain.members[1]
    decision = old_tail.read_decision(CID, 2)  # ... so the old one must not serve v0 under chain version 2
    assert isinstance(decision, Retry) and decision.error.errno == errno.EAGAIN
    ask = head.read_decision(CID, 2)  # nor tell a dirty member at chain version 2 that v0 is committed
    assert isinstance(ask, AskTail) and ask.target == 2
    assert old_tail.answer_version_query(ask.query).errno == errno.EAGAIN
    assert old_tail.read_decision(other, 2) == ServeVersion(1)  # clean chunks are still served

    chain.run(2, old_tail.handle(held))  # the ack arrives: committed at 2, served again
    assert old_tail.read_decision(CID, 2) == ServeVersion(1)
    chain.reconfigure(promoted, 1, 2)
    chain.deliver_all()
    assert [m.chunk_versions(CID) for m in chain.members.values()] == [(1, None)] * 3
    assert chain.replies[-1].errno == 0 and chain.replies[-1].version == 1


def test_tick_looks_only_at_chunks_with_a_pending_version():
    chain = Chain(config(1, (1, S), (2, S)))
    head = chain.members[1]
    for i in range(50):
        chain.run(1, head.handle(WriteReq(1, 1, ChunkId(8, i), 9, i + 1, 0, crc32c(b"x"), b"x")))
    chain.deliver_all()
    chain.run(1, head.handle(write(b"a")))
    chain.outbox.clear()  # lost
    assert list(head._dirty) == [CID]  # the index holds the one chunk in flight, not the 51 the member knows
    (resend,) = head.handle(Tick(1.0))
    assert isinstance(resend, Send) and resend.msg.chunk_id == CID
    chain.run(1, [resend])
    chain.deliver_all()
    assert not head._dirty and head.handle(Tick(2.0)) == []


# ------------------------------------------------------------------------------------------------------------------
# Edges that mutation testing (tests/craq_mutation.py) showed no test looked at; each names the rule it pins.


def _syncing_member_with(committed: bytes, version: int) -> ChainMember:
    """Target 2, syncing behind serving target 1, holding ``committed`` at ``version`` from before it left."""
    meta = {CID: ChunkState(version, crc32c(committed), len(committed), {9: 1})}
    member = ChainMember(2, 1, meta)
    member.handle(Configure(config(4, (1, S), (2, Y)), 100.0))
    return member


def _full(version: int, data: bytes, resync: bool = True, requests: dict[int, int] | None = None) -> UpdateReq:
    return UpdateReq(1, 4, CID, 1, version, 0, crc32c(data), full_replace=True, resync=resync,
                     requests=requests if requests is not None else {9: 1}, data=data)


def test_resync_overwrites_a_replica_diverged_under_the_same_version():
    """"Version or CRC differs": a replica that came back with other bytes under the same version (a rollback,
    then a different write took that version) takes the full copy; its own version is not trusted."""
    member = _syncing_member_with(b"mine", 3)
    (persist,) = member.handle(_full(3, b"theirs"))
    assert isinstance(persist, PersistPending) and persist.force and persist.data == b"theirs"


def test_resync_pulls_back_a_replica_that_is_ahead():
    """A syncing replica ahead of its predecessor (an orphan lineage) is overwritten with the older version."""
    member = _syncing_member_with(b"orphan", 5)
    (persist,) = member.handle(_full(4, b"chain"))
    assert isinstance(persist, PersistPending) and persist.force and persist.version == 4


def test_a_full_replace_carries_and_stores_the_idempotency_table():
    member = _syncing_member_with(b"old", 1)
    (persist,) = member.handle(_full(2, b"new", resync=False, requests={5: 7, 9: 3}))
    assert persist.requests == {5: 7, 9: 3} and not persist.force  # newer than committed: a plain pending write


def test_a_resync_copy_older_than_a_live_write_is_acknowledged_not_refused():
    """A live write reached the syncing target first; the late resync copy of an older version is done."""
    member = _syncing_member_with(b"old", 1)
    member.handle(_full(3, b"live", resync=False))
    (commit, ack) = member.handle(Persisted(CID, 3, crc32c(b"live"), 4))
    assert isinstance(commit, Commit)
    (ack,) = member.handle(_full(2, b"copy"))
    assert ack.msg.status is AckStatus.OK and member.chunk_versions(CID) == (3, None)


def test_a_pending_replica_refuses_what_does_not_supersede_its_pending_version():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    member = chain.members[2]
    member.handle(UpdateReq(1, 1, CID, 1, 1, 0, crc32c(b"a"), data=b"a"))
    member.handle(Persisted(CID, 1, crc32c(b"a"), 1))
    for update in (UpdateReq(1, 1, CID, 1, 2, 0, crc32c(b"b"), data=b"b"),  # not full: a gap
                   UpdateReq(1, 1, CID, 1, 0, 0, crc32c(b"z"), full_replace=True, data=b"z")):  # full but older
        (ack,) = member.handle(update)
        assert ack.msg.status is AckStatus.VERSION_GAP
    (persist,) = member.handle(UpdateReq(1, 1, CID, 1, 2, 0, crc32c(b"ab"), full_replace=True, data=b"ab"))
    assert isinstance(persist, PersistPending) and persist.version == 2 and not persist.force


def test_forwards_to_a_syncing_target_name_the_writer_and_resync_copies_name_nobody():
    chain = Chain(config(1, (1, S), (2, Y)))
    chain.run(1, chain.members[1].handle(write(b"a", request_id=4)))
    live = chain.members[1]._full_update(chain.members[1]._chunks[CID], 1, crc32c(b"a"), resync=False)  # rule 3a
    assert live.full_replace and (live.client_id, live.request_id, live.requests) == (9, 4, {9: 4})
    chain.deliver_all()
    copy = chain.members[1]._full_update(chain.members[1]._chunks[CID], 1, crc32c(b"a"), resync=True)
    assert (copy.client_id, copy.request_id, copy.requests) == (0, 0, {9: 4})


def test_a_write_in_flight_at_a_syncing_member_is_never_finished_by_it():
    """Its persist completes after the member started syncing: another lineage, neither forwarded nor committed."""
    member = ChainMember(2, 1)
    member.handle(Configure(config(1, (1, S), (2, S)), 100.0))
    member.handle(UpdateReq(1, 1, CID, 1, 1, 0, crc32c(b"a"), data=b"a"))  # persisting
    member.handle(Configure(config(3, (1, S), (2, Y)), 100.0))
    assert member.handle(Persisted(CID, 1, crc32c(b"a"), 1)) == []
    assert member.chunk_versions(CID) == (0, None)


def test_a_member_taken_out_of_the_chain_does_not_act_on_a_finished_persist():
    member = ChainMember(2, 1)
    member.handle(Configure(config(1, (1, S), (2, S)), 100.0))
    member.handle(UpdateReq(1, 1, CID, 1, 1, 0, crc32c(b"a"), data=b"a"))
    member.handle(Configure(config(2, (1, S), (2, O)), 100.0))
    assert member.handle(Persisted(CID, 1, crc32c(b"a"), 1)) == []


def test_a_former_head_sends_its_waiting_and_queued_clients_to_the_new_head():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    head = chain.members[1]
    chain.run(1, head.handle(write(b"a", request_id=1)))
    chain.run(1, head.handle(write(b"b", client_id=8, request_id=1)))  # queued behind the first
    chain.outbox.clear()
    chain.reconfigure(config(2, (2, S), (1, S), (3, S)), 1)
    assert sorted((r.client_id, r.errno) for r in chain.replies) == [(8, errno.ESTALE), (9, errno.ESTALE)]
    chain.replies.clear()
    chain.reconfigure(config(3, (1, S), (2, S), (3, S)))  # head again: nothing left to answer twice, or to start
    chain.deliver_all()
    assert chain.replies == [] and chain.members[3].chunk_versions(CID) == (1, None)


def test_a_client_retry_at_a_new_head_joins_the_pending_write():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    _, update = chain.outbox.pop()
    chain.run(2, chain.members[2].handle(update))
    chain.outbox.clear()  # its forward to 3 is lost too, so the write is still pending when the retry comes
    new = config(2, (2, S), (3, S), (1, O))
    chain.reconfigure(new, 2, 3)
    chain.run(2, chain.members[2].handle(write(b"a", version=2)))
    chain.deliver_all()
    assert [(r.errno, r.version) for r in chain.replies] == [(0, 1)]


def test_the_head_queues_writes_of_several_clients_and_answers_each():
    chain = Chain(config(1, (1, S), (2, S)))
    for client in (7, 8, 9):
        chain.run(1, chain.members[1].handle(write(b"w%d" % client, client_id=client)))
    chain.deliver_all()
    assert sorted((r.client_id, r.version) for r in chain.replies) == [(7, 1), (8, 2), (9, 3)]
    assert chain.members[1]._chunks[CID].queue is None  # emptied, given back: a server holds a record per chunk


def test_a_failed_write_lets_the_queued_one_start():
    chain = Chain(config(1, (1, S), (2, S)))
    chain.full = {2}
    chain.run(1, chain.members[1].handle(write(b"a", client_id=7)))
    chain.run(1, chain.members[1].handle(write(b"b", client_id=8)))  # queued
    (update,) = [m for _, m in chain.outbox]
    chain.outbox.clear()
    chain.run(2, chain.members[2].handle(update))  # refused for lack of space
    chain.full = set()
    chain.deliver_all()
    assert sorted((r.client_id, r.errno, r.version) for r in chain.replies) == [(7, errno.ENOSPC, 0), (8, 0, 1)]
    assert chain.members[1]._chunks[CID].queue is None


def test_a_write_of_several_crc_blocks_passes_the_member_checks():
    data = bytes(range(256)) * 400  # 100 KiB: two 64 KiB CRC blocks, the second short
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(data)))
    chain.deliver_all()
    assert chain.replies[-1].errno == 0 and chain.engines[2].committed[CID].data == data


def test_read_through_the_tail_answers():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    head, mid, tail = chain.members.values()
    chain.run(1, head.handle(write(b"a")))
    chain.run(2, mid.handle(chain.outbox.pop()[1]))  # pending (persisted) at 1 and 2
    chain.outbox.clear()
    first, second = mid.read_decision(CID, 1), mid.read_decision(CID, 1)
    assert first.query.query_id != second.query.query_id  # drivers match answers to reads by this id
    assert mid.answer_version_query(first.query).errno == errno.ESTALE  # only the read tail answers
    assert mid.decide_with_tail(CID, VersionReply(1, 1, CID, 1, 1)) == ServeVersion(1)  # its pending, committed
    assert mid.decide_with_tail(CID, VersionReply(1, 1, CID, 1, 0)) == ServeVersion(0)
    assert mid.decide_with_tail(CID, VersionReply(1, 1, CID, 1, 2)).error.errno == errno.EAGAIN
    assert mid.decide_with_tail(CID, VersionReply(1, 1, CID, 1, errno=errno.EAGAIN)).error.errno == errno.EAGAIN
    assert mid.decide_with_tail(CID, VersionReply(1, 2, CID, 1, 1)).error.errno == errno.ESTALE


def test_an_error_reply_names_no_version():
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a", version=7)))
    assert (chain.replies[-1].errno, chain.replies[-1].version) == (errno.ESTALE, 0)


def test_configs_older_than_or_equal_to_the_current_one_change_nothing():
    chain = Chain(config(2, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a", version=2)))
    assert chain.outbox and chain.members[1].chunk_versions(CID) == (0, 1)
    chain.outbox.clear()
    head = chain.members[1]
    assert head.handle(Configure(config(2, (1, S), (2, S)), 100.0)) == []  # every heartbeat: no re-drive
    assert head.handle(Configure(config(1, (2, S), (1, S)), 100.0)) == [] and head.chain_version == 2
    with pytest.raises(ProtocolError):
        head.handle(Configure(ChainConfig(5, 3, (ChainTarget(1, 1, S),)), 100.0))


def test_a_fresh_member_has_nothing_to_time_and_no_resync():
    member = ChainMember(1, 1)
    assert not member.has_timers() and member.resync_progress() is None


def test_retransmissions_wait_for_their_interval():
    chain = Chain(config(1, (1, S), (2, S)))
    head = chain.members[1]
    head.handle(Tick(5.0))
    chain.run(1, head.handle(write(b"a")))
    chain.outbox.clear()
    assert head.handle(Tick(5.01)) == []  # sent at 5.0: not due yet
    assert len(head.handle(Tick(5.06))) == 1


@pytest.mark.parametrize("status", [AckStatus.BUSY, AckStatus.STALE, AckStatus.CHECKSUM])
def test_an_update_refused_for_now_is_sent_again_soon_not_after_the_retransmit_wait(status):
    """A syncing successor answers BUSY while it stores a resync copy of the chunk, which takes milliseconds; a
    client's write waited the whole retransmit interval (a second in the chunk server) behind it."""
    head = ChainMember(1, 1, retransmit_after=1.0, resend_refused_after=0.02)
    head.handle(Configure(config(1, (1, S), (2, S)), 100.0))
    head.handle(Tick(5.0))
    head.handle(write(b"a"))
    (forward,) = head.handle(Persisted(CID, 1, crc32c(b"a"), 1))
    assert head.handle(Tick(5.01)) == []
    refusal = UpdateAck(1, 1, CID, 2, 1, status, 0, 0, 0)
    assert head.handle(refusal) == []
    assert head.handle(Tick(5.02)) == []  # refused at 5.01: due at 5.03
    (again,) = head.handle(Tick(5.03))
    assert isinstance(again, Send) and again.msg == forward.msg
    assert head.handle(Tick(5.5)) == []  # the resend waits its full interval again
    assert len(head.handle(Tick(6.03))) == 1


def test_a_coarse_retransmit_scan_looks_only_that_often():
    head = ChainMember(1, 1, retransmit_scan_every=1.0)
    head.handle(Configure(config(1, (1, S), (2, S)), 100.0))
    head.handle(Tick(2.0))
    head.handle(write(b"a"))
    head.handle(Persisted(CID, 1, crc32c(b"a"), 1))
    assert head.handle(Tick(2.5)) == []  # due, but the last scan was at 2.0
    assert len(head.handle(Tick(3.0))) == 1


def test_resync_is_resent_only_when_due_and_a_duplicate_answer_is_ignored():
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    chain.deliver_all()
    pred = chain.members[1]
    pred.handle(Tick(5.0))
    query = [Send(2, ResyncQuery(1, 2, 1))]
    assert pred.handle(Configure(config(2, (1, S), (2, Y)), 100.0)) == query
    assert pred.handle(Tick(5.01)) == []  # the query is not due again yet
    assert pred.handle(Tick(5.06)) == query  # lost: asked again
    assert pred.handle(Tick(5.07)) == []
    state = ResyncState(1, 2, 2, ())
    (copy,) = pred.handle(state)  # the successor lacks the chunk: one copy
    assert isinstance(copy, SendChunk) and copy.msg.resync
    assert pred.handle(state) == []  # a duplicate answer (to a retransmitted query)
    assert pred.handle(Tick(5.115)) == []  # the copy went at 5.07, when the answer came
    (again,) = pred.handle(Tick(5.13))  # the copy was lost: sent again
    assert isinstance(again, SendChunk) and again.msg.version == 1


def test_a_resync_copy_names_the_successors_listed_copy_and_goes_whole_once_it_refuses_the_delta():
    """The driver may send only the blocks that differ from the copy the successor listed; a refusal (VERSION_GAP:
    its copy moved on, or a block it would keep is corrupt) makes the next copy of that chunk whole."""
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    chain.deliver_all()
    pred = chain.members[1]
    pred.handle(Configure(config(2, (1, S), (2, Y)), 100.0))
    listed = ChunkSummary(CID, 0, 7, 3, b"\x07\0\0\0")
    (copy,) = pred.handle(ResyncState(1, 2, 2, (listed,)))
    assert isinstance(copy, SendChunk) and copy.theirs == listed and copy.msg.resync
    refused = UpdateAck(1, 2, CID, 2, 1, AckStatus.VERSION_GAP, 0, 7, 3, resync=True)
    (whole,) = pred.handle(refused)
    assert isinstance(whole, SendChunk) and whole.theirs is None and whole.msg.version == 1
    assert pred.handle(refused) == []  # refused again: the tick resends it, whole
    (done,) = pred.handle(UpdateAck(1, 2, CID, 2, 1, AckStatus.OK, 1, crc32c(b"a"), 1, resync=True))
    assert done == ReportToMgmtd(ResyncDone(1, 2, 2))


def _delta(version: int, data: bytes, base: tuple[int, int], new: bytes) -> UpdateReq:
    """A resync copy of ``new`` as the blocks ``data`` at offset 0, made against the receiver's ``base``."""
    return msgspec.structs.replace(_full(version, data), extents=[(0, len(data))],
                                   delta=BlockDelta(*base, len(new), crc32c(new)))


def test_a_delta_is_stored_only_on_the_copy_it_was_made_against():
    member = _syncing_member_with(b"old", 3)
    (ack,) = member.handle(_delta(5, b"new", (3, crc32c(b"other")), b"new"))
    assert ack.msg.status is AckStatus.VERSION_GAP and ack.msg.resync
    (persist,) = member.handle(_delta(5, b"new", (3, crc32c(b"old")), b"new"))
    assert isinstance(persist, PersistPending) and persist.delta == BlockDelta(3, crc32c(b"old"), 3, crc32c(b"new"))
    assert persist.extents == [(0, 3)] and not persist.force
    (commit, ack) = member.handle(Persisted(CID, 5, crc32c(b"new"), 3))
    assert commit == Commit(CID, 5) and ack.msg.status is AckStatus.OK and member.chunk_versions(CID) == (5, None)


def test_a_delta_the_engine_cannot_apply_asks_for_the_whole_chunk():
    """The engine refuses a delta whose kept blocks fail their CRC on the disk: the member drops it and answers
    VERSION_GAP, not FAILED, so the predecessor sends the chunk whole instead of giving up on the version."""
    member = _syncing_member_with(b"old", 3)
    member.handle(_delta(5, b"new", (3, crc32c(b"old")), b"new"))
    (ack,) = member.handle(PersistFailed(CID, 5, errno.EIO, "block 2 is corrupt"))
    assert ack.msg.status is AckStatus.VERSION_GAP and member.chunk_versions(CID) == (3, None)
    (persist,) = member.handle(_full(5, b"new"))
    assert persist.delta is None and persist.full_replace


def test_a_dirty_chunk_counts_as_differing_in_a_resync():
    """Even when the successor holds the same committed version: the pending write must reach it first."""
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    chain.deliver_all()
    pred = chain.members[1]
    chain.run(1, pred.handle(write(b"b", request_id=2)))
    chain.outbox.clear()
    pred.handle(Configure(config(2, (1, S), (2, Y)), 100.0))
    pred.handle(ResyncState(1, 2, 2, (ChunkSummary(CID, 1, crc32c(b"a")),)))
    assert pred.resync_progress() == (2, 1, 1)


@pytest.mark.parametrize("event", [Persisted(CID, 2, 0, 0), PersistFailed(CID, 2, errno.EIO, "io")])
def test_a_completion_for_another_version_is_a_protocol_error(event):
    member = ChainMember(2, 1)
    member.handle(Configure(config(1, (1, S), (2, S)), 100.0))
    member.handle(UpdateReq(1, 1, CID, 1, 1, 0, crc32c(b"a"), data=b"a"))
    with pytest.raises(ProtocolError):
        member.handle(event)


def test_a_resync_answer_from_a_stranger_is_a_protocol_error():
    chain = Chain(config(1, (1, S), (2, S), (3, S)))
    with pytest.raises(ProtocolError):
        chain.members[1].handle(ResyncState(1, 1, 2, ()))  # no resync running
    chain.members[2].handle(Configure(config(2, (1, S), (2, S), (3, Y)), 100.0))
    with pytest.raises(ProtocolError):
        chain.members[2].handle(ResyncState(1, 2, 1, ()))  # from its predecessor, not the syncing target


def test_a_failed_persist_at_a_member_taken_out_of_the_chain_is_dropped_quietly():
    member = ChainMember(2, 1)
    member.handle(Configure(config(1, (1, S), (2, S)), 100.0))
    member.handle(UpdateReq(1, 1, CID, 1, 1, 0, crc32c(b"a"), data=b"a"))
    member.handle(Configure(config(2, (1, S), (3, S)), 100.0))  # replaced: no longer in the chain at all
    assert member.handle(PersistFailed(CID, 1, errno.EIO, "io")) == []
    assert member.chunk_versions(CID) == (0, None)


# ------------------------------------------------------------------------- rule 9: a recovering chain

X, Y_, Z = ChunkId(8, 0), ChunkId(8, 1), ChunkId(8, 2)


def engine(committed: dict[ChunkId, tuple[int, bytes]], pending: dict[ChunkId, tuple[int, bytes]] | None = None) -> MemEngine:
    e = MemEngine()
    e.committed = {cid: _Version(v, data, {}) for cid, (v, data) in committed.items()}
    e.pending = {cid: _Version(v, data, {}) for cid, (v, data) in (pending or {}).items()}
    return e


def recovering(version: int, second: TargetState, recovering: bool = True) -> ChainConfig:
    """Target 1 is the rolled-back last serving one; target 2 returns (syncing) or is still away."""
    return ChainConfig(1, version, (ChainTarget(1, 1, S), ChainTarget(2, 2, second)), recovering)


def test_a_recovering_member_pulls_the_newer_chunks_and_copies_nothing_forward():
    """The seed-68 partition: the returning replica holds acknowledged versions the rolled-back one lost (X, Z),
    and the rolled-back one holds versions acknowledged after the other was removed (Y): each side keeps its newer."""
    chain = Chain(recovering(5, Y), engines={
        1: engine({X: (3, b"x3"), Y_: (5, b"y5")}),
        2: engine({X: (4, b"x4"), Y_: (2, b"y2"), Z: (1, b"z1")}),
    })
    (_, query), = chain.outbox
    assert isinstance(query, ResyncQuery)
    chain.deliver_all()
    assert [chain.members[1].chunk_versions(c) for c in (X, Y_, Z)] == [(4, None), (5, None), (1, None)]
    assert chain.engines[1].committed[X].data == b"x4" and chain.engines[1].committed[Z].data == b"z1"
    assert chain.engines[2].committed[Y_].data == b"y2"  # nothing was copied forward: the target syncs again later
    assert not [m for sender, m in chain.sent if sender == 1 and isinstance(m, UpdateReq)]
    assert chain.mgmtd == [ResyncDone(1, 5, 2)]


def test_a_recovering_member_serves_nothing():
    chain = Chain(recovering(5, O), engines={1: engine({X: (3, b"x3")})})
    member = chain.members[1]
    decision = member.read_decision(X, 5)
    assert isinstance(decision, Retry) and decision.error.errno == errno.EAGAIN
    assert member.answer_version_query(VersionQuery(1, 5, X, 3, 1)).errno == errno.EAGAIN
    (reply,) = [e.msg for e in member.handle(WriteReq(1, 5, X, 9, 1, 0, crc32c(b"w"), b"w"))]
    assert reply.errno == errno.EAGAIN and member.chunk_versions(X) == (3, None)
    chain.reconfigure(recovering(6, O, recovering=False))
    assert member.read_decision(X, 6) == ServeVersion(3)


def test_a_recovering_member_holds_its_pending_version_until_the_chain_serves():
    """Its pending version may be older than what a returning replica committed: neither forward nor commit it."""
    chain = Chain(recovering(5, O), engines={1: engine({X: (1, b"x1")}, pending={X: (2, b"x2")})})
    member = chain.members[1]
    assert member.chunk_versions(X) == (1, 2)
    chain.reconfigure(recovering(6, Y), 1)
    chain.run(1, member.handle(Tick(10.0)))
    assert not [m for _, m in chain.outbox if isinstance(m, UpdateReq)]
    chain.reconfigure(recovering(7, O, recovering=False), 1)
    assert member.chunk_versions(X) == (2, None)  # the chain serves: as the end of the chain it commits it


@pytest.mark.parametrize(("theirs", "after"), [(1, (1, 2)), (2, (2, None)), (3, (3, None))])
def test_a_committed_version_as_new_as_the_pending_one_replaces_it(theirs: int, after: tuple[int, int | None]):
    """The pending version was never acknowledged (it may even be of a write the chain abandoned)."""
    chain = Chain(recovering(5, Y), engines={
        1: engine({X: (1, b"x1")}, pending={X: (2, b"mine")}),
        2: engine({X: (theirs, b"x%d" % theirs)}),
    })
    chain.deliver_all()
    assert chain.members[1].chunk_versions(X) == after
    if theirs > 1:
        assert chain.engines[1].committed[X].data == b"x%d" % theirs
    assert chain.mgmtd == [ResyncDone(1, 5, 2)]


def test_a_lost_pull_is_asked_again_and_a_duplicate_copy_is_ignored():
    chain = Chain(recovering(5, Y), engines={1: engine({}), 2: engine({X: (4, b"x4")})})
    member = chain.members[1]
    chain.run(2, chain.members[2].handle(chain.outbox.pop()[1]))  # the query; the list comes back
    chain.run(1, member.handle(chain.outbox.pop()[1]))
    (_, pull), = chain.outbox
    assert pull == ResyncPull(1, 5, 1, (X,)) and member.resync_progress() == (2, 1, 1)
    chain.outbox.clear()  # lost
    chain.run(1, member.handle(Tick(1.0)))
    (_, again), = chain.outbox
    assert again == pull
    chain.run(2, chain.members[2].handle(chain.outbox.pop()[1]))
    (_, copy), = chain.outbox
    chain.deliver_all()
    assert member.chunk_versions(X) == (4, None) and chain.mgmtd == [ResyncDone(1, 5, 2)]
    assert member.handle(copy) == []  # a second copy of a chunk already pulled


def test_only_the_predecessor_of_a_syncing_member_may_pull_from_it():
    chain = Chain(recovering(5, Y), engines={2: engine({X: (4, b"x4")})})
    with pytest.raises(ProtocolError):
        chain.members[2].handle(ResyncPull(1, 5, 3, (X,)))


def _pulled_copy(chain: Chain) -> UpdateReq:
    """Run the resync of target 2 by target 1 up to the first copy that 2 sends back, and return it undelivered."""
    while not any(isinstance(m, UpdateReq) for _, m in chain.outbox):
        target, msg = chain.outbox.pop(0)
        chain.run(target, chain.members[target].handle(msg))
    (_, copy), = chain.outbox
    chain.outbox.clear()
    return copy


def test_a_pulled_copy_is_stored_once_and_a_corrupt_one_is_dropped():
    chain = Chain(recovering(5, Y), engines={1: engine({}), 2: engine({X: (4, b"x4")})})
    member = chain.members[1]
    copy = _pulled_copy(chain)
    assert member.handle(msgspec.structs.replace(copy, crc=copy.crc ^ 1)) == []  # the next pull asks again
    (persist,) = member.handle(copy)
    assert isinstance(persist, PersistPending) and persist.version == 4
    assert member.handle(copy) == []  # a retransmitted copy while the first one is being stored
    effects = member.handle(Persisted(X, 4, crc32c(b"x4"), 2))
    assert effects == [Commit(X, 4), ReportToMgmtd(ResyncDone(1, 5, 2))]
    assert member.handle(copy) == []  # and after


def test_a_pull_is_asked_again_only_once_its_interval_passed():
    chain = Chain(recovering(5, Y), engines={1: engine({}), 2: engine({X: (4, b"x4")})})
    member = chain.members[1]
    chain.run(1, member.handle(Tick(1.0)))  # the query is asked again (as if lost)
    chain.run(2, chain.members[2].handle(chain.outbox.pop(0)[1]))
    chain.outbox.pop(0)
    chain.run(1, member.handle(Tick(1.04)))
    chain.run(1, member.handle(chain.outbox.pop()[1]))  # the list arrives: the pull goes out at 1.04
    assert [type(m) for _, m in chain.outbox] == [ResyncPull]
    chain.run(1, member.handle(Tick(1.06)))
    assert len(chain.outbox) == 1
    chain.run(1, member.handle(Tick(1.1)))
    assert [type(m) for _, m in chain.outbox] == [ResyncPull, ResyncPull]


def test_a_pulled_copy_stored_after_the_chain_changed_is_committed_without_a_report():
    """The returning target went away again: the pulled version is still one the chain committed; keep it."""
    chain = Chain(recovering(5, Y), engines={1: engine({}), 2: engine({X: (4, b"x4")})})
    member = chain.members[1]
    assert [type(e) for e in member.handle(_pulled_copy(chain))] == [PersistPending]
    chain.reconfigure(recovering(6, O), 1)
    assert member.handle(Persisted(X, 4, crc32c(b"x4"), 2)) == [Commit(X, 4)]


def test_a_pulled_copy_stored_after_the_recovery_ended_goes_down_the_chain_like_any_pending_version():
    chain = Chain(recovering(5, Y), engines={1: engine({}), 2: engine({X: (4, b"x4")})})
    member = chain.members[1]
    member.handle(_pulled_copy(chain))
    chain.reconfigure(recovering(6, Y, recovering=False), 1)
    (forward,) = member.handle(Persisted(X, 4, crc32c(b"x4"), 2))
    assert isinstance(forward, SendChunk) and forward.target == 2 and forward.msg.version == 4


def test_a_resync_does_not_wait_for_chunks_the_engine_removed_meanwhile():
    """File deletion and truncation remove chunks from the engine, not through the chain: the member forgets
    them, and a resync that was to copy them is done without them (it used to wait forever)."""
    chain = Chain(config(1, (1, S), (2, S)))
    other = ChunkId(8, 0)
    chain.run(1, chain.members[1].handle(write(b"a")))
    chain.run(1, chain.members[1].handle(WriteReq(1, 1, other, 9, 2, 0, crc32c(b"b"), b"b")))
    chain.deliver_all()
    pred = chain.members[1]
    pred.handle(Configure(config(2, (1, S), (2, Y)), 100.0))
    copies = pred.handle(ResyncState(1, 2, 2, ()))  # the successor lost both
    assert {c.msg.chunk_id for c in copies} == {CID, other} and pred.resync_progress() == (2, 2, 2)
    assert pred.forget([CID]) == []  # its file was deleted before the copy could be read
    assert pred.chunk_versions(CID) == (0, None) and pred.resync_progress() == (2, 1, 2)
    assert pred.handle(UpdateAck(1, 2, CID, 2, 1, AckStatus.OK, 1, 0, 1, True)) == []  # a late ack is ignored
    assert pred.forget([other, ChunkId(9, 0)]) == [ReportToMgmtd(ResyncDone(1, 2, 2))]
    assert pred.handle(ResyncState(1, 2, 2, ())) == []  # and nothing is left to copy


def _away_while_removed(chain: Chain, removed: ChunkId) -> None:
    """Target 2 goes offline; the chain's file loses ``removed`` (the engine's removal, then ``forget``), which
    target 2 misses; then it returns syncing (chain version 3)."""
    chain.reconfigure(config(2, (1, S), (2, O)), 1)
    chain.engines[1].remove([removed])
    assert chain.members[1].forget([removed]) == []
    chain.reconfigure(config(3, (1, S), (2, Y)))


def test_a_resync_drops_what_the_chain_removed_while_the_target_was_away():
    """Rule 10: removals bypass the chain, so a target that was away still holds a truncated file's tail; its
    resync drops it before the target may serve, and is done only once the drop is confirmed."""
    chain = Chain(config(1, (1, S), (2, S)))
    kept = ChunkId(8, 0)
    chain.run(1, chain.members[1].handle(write(b"a")))
    chain.run(1, chain.members[1].handle(WriteReq(1, 1, kept, 9, 2, 0, crc32c(b"b"), b"b")))
    chain.deliver_all()
    _away_while_removed(chain, CID)
    chain.run(2, chain.members[2].handle(chain.outbox.pop(0)[1]))  # the query; the listing is now in the outbox
    (drop,) = chain.run(1, chain.members[1].handle(chain.outbox.pop(0)[1]))
    assert drop == Send(2, ResyncDrop(1, 3, 1, ((CID, 1),)))  # kept is in step: nothing to copy
    assert chain.members[1].resync_progress() == (2, 1, 1) and not chain.mgmtd
    (gone,) = chain.run(2, chain.members[2].handle(chain.outbox.pop(0)[1]))
    assert gone == DropChunks((CID,), 1, ResyncDropped(1, 3, 2, (CID,)))
    assert CID not in chain.engines[2].committed and chain.members[2].chunk_versions(CID) == (0, None)
    chain.deliver_all()
    assert chain.mgmtd == [ResyncDone(1, 3, 2)]
    assert chain.engines[2].committed[kept].data == b"b"


def test_a_lost_drop_is_asked_again_and_a_repeated_one_is_confirmed_again():
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"a")))
    chain.deliver_all()
    chain.members[1].handle(Tick(5.0))
    _away_while_removed(chain, CID)
    chain.deliver_all()
    assert chain.mgmtd == [ResyncDone(1, 3, 2)]
    drop = ResyncDrop(1, 3, 1, ((CID, 1),))
    assert (1, drop) in chain.sent
    (again,) = chain.members[2].handle(drop)  # a retransmit after the chunk went: the engine is asked again
    assert again == DropChunks((CID,), 1, ResyncDropped(1, 3, 2, (CID,)))
    assert chain.members[2].chunk_versions(CID) == (0, None)
    pred = ChainMember(1, 1)  # a predecessor whose drop was lost asks again when it is due
    pred.handle(Configure(config(3, (1, S), (2, Y)), 100.0))
    pred.handle(Tick(6.0))
    assert pred.handle(ResyncState(1, 3, 2, (ChunkSummary(CID, 1, 0),))) == [Send(2, drop)]
    assert pred.handle(Tick(6.01)) == []
    assert pred.handle(Tick(6.06))[0] == Send(2, drop)
    assert pred.handle(ResyncDropped(1, 3, 2, (CID,))) == [ReportToMgmtd(ResyncDone(1, 3, 2))]


def test_a_drop_spares_a_chunk_the_live_chain_wrote_anew_meanwhile():
    """The file grew again after the truncation: the chain re-created the chunk at version 1, the number the
    returning target listed for its old copy. The live chain's write reached it first, so the late drop leaves
    it (and confirms it)."""
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"old")))
    chain.deliver_all()
    _away_while_removed(chain, CID)
    chain.run(2, chain.members[2].handle(chain.outbox.pop(0)[1]))
    (drop,) = chain.run(1, chain.members[1].handle(chain.outbox.pop(0)[1]))
    chain.outbox.clear()  # the drop is delayed
    chain.run(1, chain.members[1].handle(WriteReq(1, 3, CID, 9, 5, 0, crc32c(b"new"), b"new")))
    chain.deliver_all()  # the write goes whole to the syncing target (rule 3a) and commits everywhere
    assert chain.engines[2].committed[CID].data == b"new" and chain.replies[-1].errno == 0
    (spared,) = chain.run(2, chain.members[2].handle(drop.msg))
    assert spared == DropChunks((), 1, ResyncDropped(1, 3, 2, (CID,)))
    chain.deliver_all()
    assert chain.engines[2].committed[CID].data == b"new" and chain.mgmtd == [ResyncDone(1, 3, 2)]


def test_a_drop_from_a_stranger_is_a_protocol_error():
    member = ChainMember(2, 1)
    member.handle(Configure(config(3, (1, S), (2, Y), (3, S)), 100.0))
    with pytest.raises(ProtocolError):
        member.handle(ResyncDrop(1, 3, 3, ((CID, 1),)))


def test_a_full_replace_write_empties_the_chunk_on_every_replica_and_its_version_goes_on():
    """A truncation empties a chunk past a file's new end through the chain while a chunk server is down, so its
    version goes on (a removal would start it again at 1 on the servers that made it)."""
    chain = Chain(config(1, (1, S), (2, S)))
    chain.run(1, chain.members[1].handle(write(b"old bytes")))
    chain.deliver_all()
    chain.run(1, chain.members[1].handle(WriteReq(1, 1, CID, 9, 2, 0, crc32c(b""), b"", full_replace=True)))
    chain.deliver_all()
    assert [r.errno for r in chain.replies] == [0, 0]
    assert [m.chunk_versions(CID) for m in chain.members.values()] == [(2, None)] * 2
    assert all(e.committed[CID].data == b"" for e in chain.engines.values())
    (refused,) = chain.members[1].handle(WriteReq(1, 1, CID, 9, 3, 10, crc32c(b"x"), b"x", full_replace=True))
    assert refused.msg.errno == errno.EINVAL


def test_forgetting_a_chunk_fails_its_waiting_writes_and_aborts_the_late_persist():
    head = ChainMember(1, 1)
    head.handle(Configure(config(1, (1, S), (2, S)), 100.0))
    (persist,) = head.handle(write(b"a", request_id=1))
    assert head.handle(write(b"b", request_id=2)) == []  # queued behind the first
    replies = head.forget([CID])
    assert [(r.msg.request_id, r.msg.errno) for r in replies] == [(1, errno.ENOENT), (2, errno.ENOENT)]
    assert not head.has_timers()
    assert head.handle(Persisted(CID, persist.version, crc32c(b"a"), 1)) == [Abort(CID, persist.version)]
