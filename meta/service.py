"""``kvfs meta``: the stateless metadata service.

Everything it knows lives in the KV store, so any number of instances can serve the same cluster and any
instance can answer any client. Each call runs one store operation (one KV transaction). With SQLite a
transaction is a short local operation, so it runs on the event loop: a worker-thread round trip cost more than
the transaction, and concurrent writers in threads of one process only collided on SQLite's file lock and retried
with sleeps. FoundationDB transactions wait on the
network, so they run in worker threads. Inline transactions also run in the connection's reader task (no task
per call): the handler has nothing to wait for.

``kvfs.meta.watch`` long-polls the change feed (:mod:`kvfs.meta.feed`): a watcher wakes as soon as a call to this instance
by another client commits a change, and re-reads the feed every ``feed_poll`` seconds for changes committed
through other instances, which it has no other way to hear of.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import trio

from kvfs import wire
from kvfs.rpc import CallContext, RpcServer
from kvfs.meta.delegation import DelegationHeld
from kvfs.meta.feed import ORIGIN, long_poll
from kvfs.meta.rpc import MAX_WATCH_WAIT, OPS, WATCH, Operation, WatchRequest, WatchResponse
from kvfs.meta.store import FEED_SECONDS, MetaStore
from kvfs.meta.types import ChangePage

log = logging.getLogger("kvfs.meta")


class MetaService:
    """Serves :class:`MetaStore` operations over RPC and runs its garbage collector."""

    def __init__(self, store: MetaStore, server: RpcServer, *, gc_interval: float = 5.0,
                 feed_poll: float = 0.2) -> None:
        self.store = store
        self.server = server
        self.gc_interval = gc_interval
        self.feed_poll = feed_poll
        self._watchers = _Watchers()
        self._recalled: dict[int, float] = {}  # directory -> when this instance last published its recall
        for op in OPS.values():
            server.register(op.method, functools.partial(self._handle, op), inline=store.db.inline)
        server.register(WATCH, self._watch)

    async def _handle(self, op: Operation, request: Any, data: memoryview | None, ctx: CallContext) -> Any:
        fn = getattr(self.store, op.name)
        args = {name: getattr(request, name) for name in op.params}
        call = functools.partial(fn, request.caller, **args)
        if not op.method.idempotent and request.op_id:
            call = functools.partial(self._once, op, request.op_id, request.op_retry, call)
        appended = self.store.db.appended
        token = ORIGIN.set(request.caller.client)
        try:
            if self.store.db.inline:
                value = call()  # a thread round trip costs more than a local transaction
            else:
                value = await trio.to_thread.run_sync(call)
        except DelegationHeld as held:  # the caller retries (EAGAIN) once the holder has given the directory back
            await self._answer_held(held)
            raise
        finally:
            ORIGIN.reset(token)
            if self.store.db.appended != appended:
                self._watchers.changed(by=request.caller.client)
        return op.method.response(value)

    async def _answer_held(self, held: DelegationHeld) -> None:
        """Break a lapsed grant, or publish a recall of a live one unless one went out in the last ``RECALL_REPEAT``
        seconds (callers retry every few milliseconds; a holder that missed the first record gets another)."""
        now = trio.current_time()
        directory = held.directory
        if not held.lapsed:
            if now - self._recalled.get(directory, -RECALL_REPEAT) < RECALL_REPEAT:
                return
            self._recalled[directory] = now
            if len(self._recalled) > 4096:
                self._recalled = {d: t for d, t in self._recalled.items() if now - t < RECALL_REPEAT}
        call = functools.partial(self.store.answer_held, held)
        if self.store.db.inline:
            call()
        else:
            await trio.to_thread.run_sync(call)

    async def _watch(self, request: WatchRequest, data: memoryview | None, ctx: CallContext) -> WatchResponse:
        """Answer with the first page that holds another client's change (or a gap), or an empty one at the
        deadline. An empty ``since`` is answered at once with the feed's head."""
        me = request.caller.client

        async def read(since: bytes) -> ChangePage:
            call = functools.partial(self.store.changes, since, limit=request.limit, skip_client=me)
            return call() if self.store.db.inline else await trio.to_thread.run_sync(call)

        async def pause(left: float) -> None:
            with trio.move_on_after(min(left, self.feed_poll)):
                await self._watchers.wait(me)

        wait = min(max(request.wait, 0.0), MAX_WATCH_WAIT)
        return WatchResponse(await long_poll(read, request.since, wait, pause))

    def _once(self, op: Operation, op_id: bytes, retry: bool, call: Callable[[], Any]) -> Any:
        response = op.method.response
        with self.store.answering_once(
            op_id,
            lambda value: wire.encode_body(response(value)),
            lambda raw: wire.decode_body(response, raw).value,
            retry=retry,
        ):
            return call()

    async def run_gc(self) -> None:
        """Expire old request answers and the write sessions of clients whose lease lapsed, and delete the chunks
        of removed files (when the store can reach the chunk servers) in the background, forever. After a full
        batch the next follows soon, paced to take at most ``GC_DUTY`` of the time: waiting the whole interval
        would reclaim a large deletion's space at a few files per second, and not waiting at all would take CPU
        from the calls clients are waiting for."""
        while True:
            await trio.sleep(self.gc_interval)
            collected = 0
            try:
                await trio.to_thread.run_sync(self.store.expire_answers)
                while await trio.to_thread.run_sync(self.store.trim_changes, FEED_SECONDS, TRIM_BATCH) >= TRIM_BATCH:
                    pass
                expired = 0
                while True:  # a full batch means the lapsed clients may own more sessions
                    ended = await trio.to_thread.run_sync(self.store.expire_clients, EXPIRE_BATCH)
                    expired += ended
                    if ended < EXPIRE_BATCH:
                        break
                if expired:
                    log.warning("ended %d write sessions of clients whose lease lapsed", expired)
                while self.store.collects_chunks:
                    started = trio.current_time()
                    done = await trio.to_thread.run_sync(self.store.gc_once, GC_BATCH)
                    collected += done
                    if done < GC_BATCH:
                        break
                    await trio.sleep((trio.current_time() - started) * (1 / GC_DUTY - 1))
            except OSError as exc:  # chunk servers or the KV store out of reach: the next round retries
                log.warning("garbage collection round stopped, retrying in %g s: %s", self.gc_interval, exc)
            except Exception:  # a bug; GC must still never take the service down
                log.exception("garbage collection round failed")
            if collected:
                log.info("garbage-collected %s removed files", collected)


class _Watchers:
    """The watch calls waiting on this instance, by client: a change wakes every watcher but its maker's."""

    def __init__(self) -> None:
        self._events: dict[bytes, set[trio.Event]] = {}

    async def wait(self, client: bytes) -> None:
        event = trio.Event()
        waiting = self._events.setdefault(client, set())
        waiting.add(event)
        try:
            await event.wait()
        finally:
            waiting.discard(event)
            if not waiting:
                del self._events[client]

    def changed(self, by: bytes) -> None:
        for client, events in self._events.items():
            if client != by or not client:
                for event in events:
                    event.set()


GC_BATCH = 64
EXPIRE_BATCH = 256  # sessions of lapsed clients ended per transaction
TRIM_BATCH = 4096  # change-feed records dropped per transaction
GC_DUTY = 0.25  # at most this share of the time goes to collecting while a backlog lasts
RECALL_REPEAT = 0.5  # seconds between recalls of one directory that this instance publishes
