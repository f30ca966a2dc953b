"""The engine-neutral KV interface: FoundationDB's transaction model, synchronous.

Services run a whole transaction function in a worker thread (``trio.to_thread.run_sync``),
so the interface is blocking on purpose.
"""

from __future__ import annotations

import abc
import functools
import random
import time
from collections.abc import Sequence
from typing import Any, Callable, Concatenate, ParamSpec, TypeVar

from kvfs.errors import TransactionConflict, TransactionTooOld

P = ParamSpec("P")
R = TypeVar("R")

KeyValue = tuple[bytes, bytes]

DEFAULT_MAX_BYTES = 10_000_000  # FoundationDB's transaction size limit
DEFAULT_MAX_AGE_S = 5.0  # FoundationDB's transaction lifetime limit
RETRYABLE = (TransactionConflict, TransactionTooOld)
STAMP_BYTES = 10  # FoundationDB's versionstamp: 8-byte commit version, 2-byte order within the commit


class Transaction(abc.ABC):
    """One optimistic, serializable transaction with read-your-writes.

    Atomic ``add``/``max`` work on 8-byte little-endian integers (see :mod:`kvfs.kv.keys`), wrap
    modulo 2**64 and compare unsigned, exactly like FoundationDB; they add no read conflict.
    """

    @abc.abstractmethod
    def get(self, key: bytes, snapshot: bool = False) -> bytes | None: ...

    @abc.abstractmethod
    def get_many(self, keys: Sequence[bytes], snapshot: bool = False) -> list[bytes | None]:
        """:meth:`get` of each key, in order, read together: FoundationDB in parallel (a get is a round trip to a
        storage server), SQLite in one statement."""

    @abc.abstractmethod
    def get_range(
        self, begin: bytes, end: bytes, limit: int = 0, reverse: bool = False, snapshot: bool = False
    ) -> list[KeyValue]:
        """Pairs with ``begin <= key < end`` in key order (descending if ``reverse``); ``limit`` 0 = all."""

    @abc.abstractmethod
    def set(self, key: bytes, value: bytes) -> None: ...

    @abc.abstractmethod
    def clear(self, key: bytes) -> None: ...

    @abc.abstractmethod
    def clear_range(self, begin: bytes, end: bytes) -> None: ...

    @abc.abstractmethod
    def add(self, key: bytes, delta: int) -> None: ...

    @abc.abstractmethod
    def max(self, key: bytes, value: int) -> None: ...

    @abc.abstractmethod
    def set_stamped(self, prefix: bytes, value: bytes) -> None:
        """Write ``value`` under ``prefix`` + a :data:`STAMP_BYTES`-byte stamp that grows in commit order across
        every transaction (FoundationDB's versionstamped key). A reader that range-reads past the last stamp it
        saw therefore never misses a committed record, which makes the keys a log; it adds no conflicts. At most
        one per transaction; the key is not readable in the transaction that writes it."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Apply the writes atomically; raises TransactionConflict/TooOld/TooLarge."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop all reads and writes so the object can be used again from scratch."""

    def cancel(self) -> None:
        """Abandon the transaction; nothing it wrote becomes visible."""
        self.reset()


class Database(abc.ABC):
    """A KV store handle; thread-safe, shareable by all the threads of a process."""

    #: True when a transaction is a short local operation (SQLite: a read never waits, a write waits at most for
    #: another process's short write), so a service may run it on its event loop instead of paying a
    #: worker-thread round trip; False when transactions wait on the network (FoundationDB).
    inline: bool = False

    @abc.abstractmethod
    def create_transaction(self) -> Transaction: ...

    def close(self) -> None:
        """Release engine resources (connections); the default holds none."""

    def run(self, fn: Callable[Concatenate[Transaction, P], R], *args: P.args, **kw: P.kwargs) -> R:
        """Run ``fn(tr, ...)`` and commit, retrying from scratch on conflict or age with backoff.

        ``fn`` may run several times, so it must have no side effects outside the transaction.
        Every other exception propagates unchanged and the transaction's writes are dropped.
        """
        delay = 0.001
        tr = self.create_transaction()
        try:
            while True:
                try:
                    result = fn(tr, *args, **kw)
                    tr.commit()
                    return result
                except RETRYABLE:
                    tr.reset()
                    time.sleep(random.uniform(0, delay))  # jitter keeps racing retries apart
                    delay = min(delay * 2, 0.1)
        finally:
            tr.cancel()


def transactional(fn: Callable[Concatenate[Transaction, P], R]) -> Callable[Concatenate[Database | Transaction, P], R]:
    """Decorator like ``@fdb.transactional``: given a Database it runs ``fn`` in a retried
    transaction; given a Transaction it just calls ``fn`` in it, so transactional functions compose."""

    @functools.wraps(fn)
    def wrapper(db_or_tr: Database | Transaction, *args: Any, **kw: Any) -> R:
        if isinstance(db_or_tr, Transaction):
            return fn(db_or_tr, *args, **kw)
        return db_or_tr.run(fn, *args, **kw)

    return wrapper
