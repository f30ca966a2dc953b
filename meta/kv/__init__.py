"""The transactional ordered KV store under meta (and mgmtd): FoundationDB's model, two engines.

``open_database("sqlite:///var/lib/kvfs/meta.db")`` or ``open_database("fdb:///etc/foundationdb/fdb.cluster")``.
"""

from __future__ import annotations

import errno

from kvfs.errors import KvfsError

from . import keys
from .base import Database, KeyValue, Transaction, transactional
from .fdb_engine import FdbDatabase
from .sqlite import SqliteDatabase


def open_database(url: str) -> Database:
    """Pick the engine by URL: ``sqlite:///abs/path.db`` (``sqlite://rel/path.db`` is relative), ``fdb://`` (default
    cluster file) or ``fdb:///path/to/fdb.cluster``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise KvfsError(f"KV store URL needs a scheme (sqlite:// or fdb://): {url!r}", errno.EINVAL)
    if scheme == "sqlite":
        if not rest:
            raise KvfsError("sqlite:// URL needs a file path", errno.EINVAL)
        return SqliteDatabase(rest)
    if scheme == "fdb":
        return FdbDatabase(rest or None)
    raise KvfsError(f"unknown KV store scheme {scheme!r} (use sqlite:// or fdb://)", errno.EINVAL)


__all__ = [
    "Database",
    "Transaction",
    "KeyValue",
    "transactional",
    "SqliteDatabase",
    "FdbDatabase",
    "open_database",
    "keys",
]
