"""Write sessions and holds: the sessions that keep a file's chunks (and a removed file's record) alive.

Opening a regular file for writing starts a write session (``("meta", "s", ino, session)``); a read-only open
may take a hold, a session that keeps a removed file readable and may not set lengths. A file with no links is
collected once its last session ends. Sessions of a client with a lease are also filed under that client
(:mod:`.leases`), which renews it.
"""

from __future__ import annotations

import errno
import secrets
import stat
from typing import Callable

import msgspec

from kvfs.kv import Transaction
from kvfs.meta import schema
from kvfs.meta.components.leases import ClientLeases
from kvfs.meta.posix import W_OK, errno_error, open_wants
from kvfs.meta.records import encoder, get_inode, put_inode, touch
from kvfs.meta.types import Caller, Inode, Session

_dec_session = msgspec.msgpack.Decoder(Session)


class Sessions:
    """Starts and ends sessions. ``clock`` stamps a session's start; ``now`` is the time changes happen at."""

    def __init__(self, clock: Callable[[], int], now: Callable[[], int]) -> None:
        self._clock = clock
        self._now = now

    @staticmethod
    def any_open(tr: Transaction, ino: int, snapshot: bool = False) -> bool:
        """Whether ``ino`` has a session (a write session or a hold)."""
        return bool(tr.get_range(*schema.session_range(ino), limit=1, snapshot=snapshot))

    def start(self, tr: Transaction, caller: Caller, inode: Inode, flags: int, sid: int | None = None) -> int | None:
        """The write session of an open with ``flags``, if it writes a regular file (``sid``: its id, else a fresh
        one); None for other opens."""
        if not (open_wants(flags) & W_OK and stat.S_ISREG(inode.attr.mode)):
            return None
        if not inode.written:  # its chunks may exist from now on: the collector must look for them
            inode.written = True
            put_inode(tr, inode)
        return self._add(tr, caller, inode.attr.ino, secrets.randbits(63) if sid is None else sid)

    def hold(self, tr: Transaction, caller: Caller, ino: int) -> int:
        """A fresh hold on ``ino`` (see :meth:`kvfs.meta.store.MetaStore.open`)."""
        return self._add(tr, caller, ino, secrets.randbits(63), hold=True)

    def _add(self, tr: Transaction, caller: Caller, ino: int, sid: int, *, hold: bool = False) -> int:
        now = self._clock()
        tr.set(schema.session(ino, sid), encoder.encode(Session(caller.uid, caller.pid, now, caller.client, hold)))
        if caller.client:
            tr.set(schema.owned_session(caller.client, ino, sid), b"")
            ClientLeases.heard_from(tr, caller.client, now)  # a session start renews the lease
        return sid

    @staticmethod
    def writer_inode(tr: Transaction, ino: int, session: int) -> Inode:
        """The inode that write session ``session`` is open on; EBADF if it is not (or is a hold)."""
        raw = tr.get(schema.session(ino, session))
        if raw is None or _dec_session.decode(raw).hold:
            raise errno_error(errno.EBADF, f"no write session {session} on inode {ino}")
        return get_inode(tr, ino)

    def end(self, tr: Transaction, inode: Inode, session: int, exact_length: int | None) -> bool:
        """End ``session`` on ``inode``, setting the file's length to ``exact_length`` first if given (write
        sessions only). False if it had already ended."""
        key = schema.session(inode.attr.ino, session)
        raw = tr.get(key)
        if raw is None:
            return False
        record = _dec_session.decode(raw)
        if record.hold and exact_length is not None:  # a read-only open may not set the length
            raise errno_error(errno.EBADF, f"session {session} on inode {inode.attr.ino} is a read-only open's")
        tr.clear(key)
        if record.client:
            tr.clear(schema.owned_session(record.client, inode.attr.ino, session))
        if exact_length is not None:
            inode.attr.size = exact_length
            touch(self._now(), inode, mtime=False)
            put_inode(tr, inode)
        return True
