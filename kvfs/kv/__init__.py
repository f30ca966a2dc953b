"""The transactional ordered KV store under meta (and mgmtd): FoundationDB's model, two engines.

``open_database("sqlite:///var/lib/kvfs/meta.db")`` or ``open_database("fdb:///etc/foundationdb/fdb.cluster")``.
"""

from __future__ import annotations

import errno
import urllib.parse

from kvfs.errors import KvfsError

from . import keys
from .base import Database, KeyValue, Transaction, transactional
from .fdb_engine import FdbDatabase
from .sqlite import SqliteDatabase


def open_database(url: str) -> Database:
    """Pick the engine by URL: ``sqlite:///abs/path.db`` (``sqlite://rel/path.db`` is relative), ``fdb://`` (default
    cluster file) or ``fdb:///path/to/fdb.cluster``, optionally with ``?api_version=710`` (the default)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise KvfsError(f"KV store URL needs a scheme (sqlite:// or fdb://): {url!r}", errno.EINVAL)
    if scheme == "sqlite":
        if not rest:
            raise KvfsError("sqlite:// URL needs a file path", errno.EINVAL)
        return SqliteDatabase(rest)
    if scheme == "fdb":
        path, _, query = rest.partition("?")
        params = urllib.parse.parse_qs(query)
        unknown = set(params) - {"api_version"}
        if unknown:
            raise KvfsError(f"unknown fdb:// URL parameters {sorted(unknown)}", errno.EINVAL)
        try:
            api_version = int(params.get("api_version", ["710"])[-1])
        except ValueError:
            raise KvfsError(f"api_version in {url!r} is not a number", errno.EINVAL) from None
        return FdbDatabase(path or None, api_version=api_version)
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
