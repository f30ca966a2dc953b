"""The metadata service's client: every operation of :class:`kvfs.meta.api.MetaApi` as an async method.

``await meta.lookup(caller, parent, name)`` calls any of the configured ``kvfs meta`` instances.
:class:`kvfs.meta.local.LocalMeta` has the same surface over a store in this process (tests, benchmarks), so
the mount and kvclient do not care which they hold.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import prometheus_client
import trio

from kvfs.errors import ConnectionLost, RpcTimeout, ServiceUnavailable
from kvfs.rpc import RpcClient
from kvfs.service import Complaint
from kvfs.meta.delegation import retry_while_recalled
from kvfs.meta.rpc import OPS, WATCH, WatchRequest
from kvfs.meta.types import Caller, ChangePage

log = logging.getLogger(__name__)
_FIRST_LEASE_GUESS = 20.0  # seconds; only until meta has answered once
#: What this client asks meta for, by operation: how many calls a cache saves shows here (``kvfs mount --http``).
META_CALLS = prometheus_client.Counter("kvfs_meta_client_calls", "Calls this client made to meta", ["method"])
_meta_call_counter = functools.cache(META_CALLS.labels)


class RemoteMeta:
    """Calls any of several ``kvfs meta`` instances; a dead instance is skipped for the next one."""

    def __init__(self, client: RpcClient, addresses: Sequence[str], *, failover_rounds: int = 20) -> None:
        if not addresses:
            raise ValueError("no metadata service address configured")
        self._client = client
        self._addresses = list(addresses)
        self._next = itertools.cycle(range(len(self._addresses)))
        self._current = next(self._next)
        self._rounds = failover_rounds
        self.client_id = secrets.token_bytes(12)  # names this client's lease; op ids are it + a sequence number
        self._op_ids = (self.client_id + n.to_bytes(8, "big") for n in itertools.count())

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        op = OPS.get(name)
        if op is None:
            raise AttributeError(name)

        async def call(caller: Caller, *args: Any, **kwargs: Any) -> Any:
            op_id = b"" if op.method.idempotent else next(self._op_ids)
            request = op.request(caller, args, kwargs, op_id)
            return (await retry_while_recalled(functools.partial(self._call, op.method, request))).value

        call.__name__ = name
        return call

    async def watch(self, caller: Caller, since: bytes, wait: float, limit: int = 1024) -> ChangePage:
        """The change feed after ``since``, long-polled for up to ``wait`` seconds (``MetaService._watch``)."""
        return (await self._call(WATCH, WatchRequest(caller=caller, since=since, wait=wait, limit=limit))).value

    async def keep_alive(self) -> None:
        """Renew this client's lease every quarter of its length (meta's ``client_lease``, which the renewal
        returns), forever: meta ends the write sessions of a client that stops (crashed, or cut off for longer
        than the lease)."""
        caller = Caller(os.getuid(), os.getgid(), client=self.client_id)
        lease = _FIRST_LEASE_GUESS
        complaint = Complaint(log, "cannot renew the client lease with meta")
        while True:
            try:
                lease = await self.renew_client(caller)
                complaint.succeeded()
            except OSError as exc:  # meta unreachable, or refusing our token, for now: try again at the next beat
                complaint.failed(exc)
            await trio.sleep(lease / 4)

    async def _call(self, method: Any, request: Any) -> Any:
        """Try instances in turn. A call that may have run is retried too: idempotent methods run again
        harmlessly, and the others carry an op id under which meta answers a retry with the first answer
        (:meth:`kvfs.meta.store.MetaStore.answering_once`)."""
        _meta_call_counter(method.name).inc()
        error: Exception | None = None
        retry_safe = method.idempotent or bool(getattr(request, "op_id", b""))
        for attempt in range(self._rounds * len(self._addresses)):
            address = self._addresses[self._current]
            try:
                return await self._client.call(address, method, request)
            except ServiceUnavailable as exc:  # never reached the service: safe to go elsewhere
                error = exc
            except (ConnectionLost, RpcTimeout) as exc:
                if not retry_safe:
                    raise
                error = exc
            if not method.idempotent and not request.op_retry:  # from now on meta may hold an answer
                request = msgspec.structs.replace(request, op_retry=True)
            self._current = next(self._next)
            if self._current == 0:
                await trio.sleep(min(0.05 * (1 + attempt // len(self._addresses)), 0.5))
        assert error is not None
        raise error
