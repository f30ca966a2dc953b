"""Eviction of a kvclient namespace: by capacity and by age (TTL), least recently used first, by ordinary deletion
in the background; and removal of the temporary files of puts whose client died (orphans).

A get writes no metadata: the client records the keys it read in memory (:class:`AccessLog`) and sends them as
one ``touch_atimes`` per batch every ``access_flush`` seconds, and when it closes. An entry's last use is the later
of its access time and its modification time (its put), so the order is approximate by up to that interval.
A namespace's limits are its own: extended attributes of its directory (``user.kvfs.capacity_bytes``,
``user.kvfs.ttl`` in seconds; ``setfattr`` on the mount, or :meth:`KVClient.set_limits`), read by every client of it
at start and before each sweep; a limit a client is given when it is made is its own and wins over the stored one.
Every ``evict_interval`` seconds a client with a limit lists its namespace (``readdir`` pages with attributes)
and removes, in one ``batch_unlink`` per batch: temporary ``.put-*`` files older than ``orphan_grace``, entries
unused for ``ttl`` seconds, then, while the namespace holds more than ``capacity_bytes``, the least recently used
until it holds at most ``LOW_WATER`` of that (so that a full namespace is not swept on every put). Between sweeps a
namespace may exceed its capacity by what was put meanwhile. Several clients may sweep one namespace: a name
already removed by another is simply skipped. Times come from meta's clock and are compared with this host's, so
clocks are assumed to be in step (NTP) to well within the TTL.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from prometheus_client import Counter

from kvfs.meta.api import MAX_BATCH
from kvfs.meta.client import RemoteMeta
from kvfs.meta.types import Attr, Caller, Entry
from kvfs.kvclient.metabatch import TEMP_PREFIX, per_batch
from kvfs.service import Complaint

log = logging.getLogger(__name__)

EVICTIONS = Counter("kvfs_kvclient_evictions", "kvclient entries removed in the background", ["reason"])
LOW_WATER = 0.9
#: The namespace directory's extended attributes that hold its limits (decimal text).
CAPACITY_XATTR = b"user.kvfs.capacity_bytes"
TTL_XATTR = b"user.kvfs.ttl"
_PAGE = 1024  # readdir entries per call while listing a namespace
_NS = 1_000_000_000


@dataclass(frozen=True)
class EvictionPolicy:
    """What one client enforces on its namespace; ``None`` turns a limit off (orphans are always collected)."""

    capacity_bytes: int | None = None
    ttl: float | None = None
    orphan_grace: float = 600.0
    interval: float = 10.0

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, not {self.capacity_bytes}")
        if self.ttl is not None and self.ttl <= 0:
            raise ValueError(f"ttl must be positive seconds, not {self.ttl}")
        if self.orphan_grace < 0 or self.interval <= 0:
            raise ValueError("orphan_grace must be >= 0 and evict_interval > 0 seconds")

    @property
    def limited(self) -> bool:
        return self.capacity_bytes is not None or self.ttl is not None

    def over(self, stored: EvictionPolicy) -> EvictionPolicy:
        """This policy, with the namespace's stored limits where it sets none of its own."""
        return dataclasses.replace(self, capacity_bytes=self.capacity_bytes if self.capacity_bytes is not None
                                   else stored.capacity_bytes, ttl=self.ttl if self.ttl is not None else stored.ttl)


async def stored_limits(meta: RemoteMeta, caller: Caller, directory: int) -> EvictionPolicy:
    """The limits kept on the namespace directory; a value that is not a valid limit is logged and left out."""
    found: dict[str, float] = {}
    for field, name, kind in (("capacity_bytes", CAPACITY_XATTR, int), ("ttl", TTL_XATTR, float)):
        try:
            text = await meta.getxattr(caller, directory, name)
        except OSError as exc:
            if exc.errno == errno.ENODATA:
                continue
            raise
        try:
            found[field] = kind(text.decode())
            EvictionPolicy(**{field: found[field]})
        except (UnicodeDecodeError, ValueError):
            log.warning("namespace limit %s=%r is not a positive %s; ignored", name.decode(), text, kind.__name__)
            found.pop(field, None)
    return EvictionPolicy(**found)  # type: ignore[arg-type]


def last_use(attr: Attr) -> int:
    return max(attr.atime_ns, attr.mtime_ns)


def choose_victims(entries: list[Entry], policy: EvictionPolicy, now_ns: int) -> dict[str, list[bytes]]:
    """The names to remove and why ("orphan", "ttl", "capacity"); directories and other non-files stay."""
    files = [e for e in entries if stat.S_ISREG(e.attr.mode)]
    orphans = [e.name for e in files
               if e.name.startswith(TEMP_PREFIX) and now_ns - e.attr.ctime_ns >= policy.orphan_grace * _NS]
    kept = sorted((e for e in files if not e.name.startswith(TEMP_PREFIX)), key=lambda e: (last_use(e.attr), e.name))
    expired: list[bytes] = []
    if policy.ttl is not None:
        expired = [e.name for e in kept if now_ns - last_use(e.attr) >= policy.ttl * _NS]
        kept = kept[len(expired):]  # sorted by last use: the expired ones lead
    over: list[bytes] = []
    if policy.capacity_bytes is not None:
        total = sum(e.attr.size for e in kept)
        if total > policy.capacity_bytes:
            for e in kept:
                if total <= policy.capacity_bytes * LOW_WATER:
                    break
                over.append(e.name)
                total -= e.attr.size
    return {"orphan": orphans, "ttl": expired, "capacity": over}


class AccessLog:
    """Keys read since the last flush; a set, so a hot key costs one record per flush however often it is read."""

    def __init__(self) -> None:
        self._keys: set[bytes] = set()

    def record(self, key: bytes) -> None:
        self._keys.add(key)

    async def flush(self, meta: RemoteMeta, caller: Caller, directory: int | None) -> None:
        keys, self._keys = sorted(self._keys), set()
        if directory is not None:
            for start in range(0, len(keys), MAX_BATCH):
                await meta.touch_atimes(caller, directory, keys[start:start + MAX_BATCH])


class Maintenance:
    """The background work of one client on its namespace: access-time flushes and, under a limit, sweeps.

    ``own`` is the policy the client was made with; :attr:`policy` is what applies, the namespace's stored limits
    filling in those it does not set (:meth:`refresh`)."""

    def __init__(self, meta: RemoteMeta, caller: Caller, ns_dir: Callable[[], Awaitable[int | None]],
                 accesses: AccessLog, own: EvictionPolicy, *, access_flush: float = 1.0) -> None:
        self.meta, self.caller, self.ns_dir = meta, caller, ns_dir
        self.accesses, self.own, self.policy, self.access_flush = accesses, own, own, access_flush

    async def run(self, *, sweep: bool | None) -> None:
        """``sweep``: True sweeps every interval, False never, None while a limit applies."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._every, self.access_flush, self.flush, "cannot record accesses with meta")
            if sweep is not False:
                nursery.start_soon(self._every, self.own.interval, lambda: self._sweep_pass(sweep), "cannot evict")

    async def refresh(self) -> None:
        """Read the namespace's stored limits again (a namespace not made yet has none)."""
        directory = await self.ns_dir()
        stored = EvictionPolicy() if directory is None else await stored_limits(self.meta, self.caller, directory)
        self.policy = self.own.over(stored)

    async def _sweep_pass(self, sweep: bool | None) -> None:
        await self.refresh()
        if sweep or self.policy.limited:
            await self.sweep()

    @staticmethod
    async def _every(seconds: float, work: Callable[[], Awaitable[object]], what: str) -> None:
        complaint = Complaint(log, what)
        while True:
            await trio.sleep(seconds)
            try:
                await work()
                complaint.succeeded()
            except OSError as exc:  # meta unreachable for now: the next round retries
                complaint.failed(exc)
            except Exception:  # a bug; it must still not take the client down
                log.exception("%s: unexpected failure", what)

    async def flush(self) -> None:
        await self.accesses.flush(self.meta, self.caller, await self.ns_dir())

    async def sweep(self) -> dict[str, int]:
        """One pass over the namespace; returns how many names each reason removed."""
        directory = await self.ns_dir()
        if directory is None:
            return {}
        await self.accesses.flush(self.meta, self.caller, directory)  # this client's own reads count too
        entries: list[Entry] = []
        cookie, eof = b"", False
        while not eof:
            page = await self.meta.readdir(self.caller, directory, cookie, _PAGE)
            entries += page.entries
            cookie, eof = page.cookie, page.eof
        removed: dict[str, int] = {}
        for reason, names in choose_victims(entries, self.policy, time.time_ns()).items():
            if names:
                answers = await per_batch(self.meta.batch_unlink, self.caller, directory, names)
                removed[reason] = sum(1 for a in answers if a == 0)  # -ENOENT: another sweeper was first
                EVICTIONS.labels(reason).inc(removed[reason])
        if removed:
            log.info("namespace sweep removed %s", removed)
        return removed
