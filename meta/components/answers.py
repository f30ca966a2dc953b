"""Exactly-once answers: a non-idempotent operation retried under the same op id runs once.

The service names the op id a call runs under with :func:`answering_once`; the operations run their transactions
through :meth:`Answers.run`, which records the answer under ``("meta", "r", minute, op_id)`` or returns the one
an earlier try recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import Any, Callable

import msgspec

from kvfs.kv import Database, Transaction
from kvfs.meta import schema

#: How long an answer to a non-idempotent request is kept for retries of it (clients retry for ~30 s).
ANSWER_MINUTES = 10


class _Once(msgspec.Struct):
    op_id: bytes
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    retry: bool


_ONCE: contextvars.ContextVar[_Once | None] = contextvars.ContextVar("kvfs_meta_once", default=None)


@contextlib.contextmanager
def answering_once(
    op_id: bytes, encode: Callable[[Any], bytes], decode: Callable[[bytes], Any], *, retry: bool = True
) -> Iterator[None]:
    """Run the operation called inside at most once for ``op_id``, however often it is retried.

    A client that loses its connection cannot know whether a create or rename ran; it retries with
    the same id. The operation's transaction also records its answer under the id, so a retry that
    finds the record returns that answer instead of running again (a create would say EEXIST, an
    unlink ENOENT). Failed operations record nothing: they changed nothing, so running them again is
    what the retry means. Records expire after ANSWER_MINUTES (:meth:`Answers.expire`). ``retry=False``
    says this is the id's first try, which cannot have a record: it only records (no lookups)."""
    token = _ONCE.set(_Once(op_id, encode, decode, retry))
    try:
        yield
    finally:
        _ONCE.reset(token)


class Answers:
    """Runs non-idempotent transactions so that they record their answers, and expires the records."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``db.run`` for the transaction of a non-idempotent operation (see :func:`answering_once`)."""
        once = _ONCE.get()
        if once is None:
            return self._db.run(fn, *args)

        def run_once(tr: Transaction, *args: Any) -> Any:
            minute = int(time.time() // 60)
            for m in range(minute, minute - 3, -1) if once.retry else ():  # retries come within 1-2 minutes
                raw = tr.get(schema.answer(m, once.op_id))
                if raw is not None:
                    return once.decode(raw)
            result = fn(tr, *args)
            tr.set(schema.answer(minute, once.op_id), once.encode(result))
            return result

        return self._db.run(run_once, *args)

    def expire(self) -> None:
        """Drop answers recorded more than ANSWER_MINUTES ago (one range clear)."""
        minute = int(time.time() // 60)
        self._db.run(lambda tr: tr.clear_range(*schema.answers_before(minute - ANSWER_MINUTES)))
