"""Client leases: a client's write sessions last while it keeps renewing, so a crashed mount's open files go.

A session opened by a caller with a client id belongs to that client (``("meta", "o", client, ino, session)``);
the client renews every quarter of the lease (``("meta", "k", client)``: when it was last heard from), and the
GC loop ends the sessions of a client silent for longer, so the files it held open can be collected.
"""

from __future__ import annotations

from typing import Callable

from kvfs.kv import Database, Transaction
from kvfs.kv.keys import decode_int, encode_int, unpack
from kvfs.meta import schema


class ClientLeases:
    """Renews and expires clients' leases; ``lease_ns`` is how long a client may stay silent."""

    def __init__(self, db: Database, clock: Callable[[], int], lease_ns: int) -> None:
        self._db = db
        self._clock = clock
        self.lease_ns = lease_ns

    @staticmethod
    def heard_from(tr: Transaction, client: bytes, now: int) -> None:
        """Record in ``tr`` that ``client`` was alive at ``now``."""
        tr.set(schema.client(client), encode_int(now))

    def renew(self, client: bytes) -> float:
        """``client`` (if any) is alive; returns the lease in seconds."""
        if client:
            self._db.run(lambda tr: self.heard_from(tr, client, self._clock()))
        return self.lease_ns / 1e9

    def expire(self, limit: int) -> int:
        """End up to ``limit`` sessions of clients silent for longer than the lease; returns how many."""
        deadline = self._clock() - self.lease_ns

        def fn(tr: Transaction) -> int:
            ended = 0
            for key, value in tr.get_range(*schema.CLIENT_RANGE):
                if decode_int(value) >= deadline:
                    continue
                client_id = unpack(key)[-1]
                owned = tr.get_range(*schema.owned_range(client_id), limit=limit - ended)
                for owned_key, _ in owned:
                    _, _, _, ino, sid = unpack(owned_key)
                    tr.clear(owned_key)
                    tr.clear(schema.session(ino, sid))
                    ended += 1
                if ended >= limit:
                    break  # this client may own more: the next call goes on
                tr.clear(key)
            return ended

        return self._db.run(fn)
