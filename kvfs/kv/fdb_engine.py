"""FoundationDB engine over the official ``fdb`` bindings (the production multi-host engine).

FoundationDB does read-your-writes, conflict detection, size and age limits itself; this module
only adapts its API and errors.  It needs ``libfdb_c`` and a reachable cluster; where either is
missing, opening raises a :class:`KvfsError` that says which.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any, Callable, Concatenate, ParamSpec, TypeVar

from kvfs.errors import KvfsError, TransactionConflict, TransactionTooLarge, TransactionTooOld

from .base import DEFAULT_MAX_BYTES, STAMP_BYTES, Database, KeyValue, Transaction
from .keys import encode_int

P = ParamSpec("P")
R = TypeVar("R")

# fdb error codes that have an exception of their own in kvfs
_ERRORS: dict[int, type[KvfsError]] = {
    1020: TransactionConflict,  # not_committed
    1007: TransactionTooOld,  # transaction_too_old
    2101: TransactionTooLarge,  # transaction_too_large
}
_api_lock = threading.Lock()


def load_fdb(api_version: int = 710) -> Any:
    """Import the bindings and select the API version, or raise a KvfsError naming what is missing."""
    try:
        import fdb
    except ImportError as exc:
        raise KvfsError("FoundationDB engine needs the 'foundationdb' Python package", errno.ENOSYS) from exc
    with _api_lock:
        try:
            if not fdb.is_api_version_selected():
                fdb.api_version(api_version)
        except Exception as exc:  # the bindings raise a bare Exception when libfdb_c is absent
            raise KvfsError(
                f"FoundationDB engine needs the libfdb_c client library (install foundationdb-clients): {exc}",
                errno.ENOSYS,
            ) from exc
    return fdb


def _convert(fdb: Any, exc: BaseException) -> BaseException:
    if isinstance(exc, fdb.FDBError):
        err = _ERRORS.get(exc.code, KvfsError)(f"fdb error {exc.code}: {exc.description}")
        err.__cause__ = exc
        return err
    return exc


class FdbTransaction(Transaction):
    def __init__(self, fdb: Any, tr: Any) -> None:
        self._fdb = fdb
        self.tr = tr

    def _call(self, fn: Callable[[], R]) -> R:
        try:
            return fn()
        except self._fdb.FDBError as exc:
            raise _convert(self._fdb, exc) from exc

    def _view(self, snapshot: bool) -> Any:
        return self.tr.snapshot if snapshot else self.tr

    def get(self, key: bytes, snapshot: bool = False) -> bytes | None:
        def read() -> bytes | None:
            v = self._view(snapshot).get(key)
            return bytes(v) if v.present() else None

        return self._call(read)

    def get_many(self, keys: Sequence[bytes], snapshot: bool = False) -> list[bytes | None]:
        def read() -> list[bytes | None]:
            view = self._view(snapshot)
            futures = [view.get(key) for key in keys]  # all in flight before the first wait
            return [bytes(v) if v.present() else None for v in futures]

        return self._call(read)

    def get_range(
        self, begin: bytes, end: bytes, limit: int = 0, reverse: bool = False, snapshot: bool = False
    ) -> list[KeyValue]:
        view = self._view(snapshot)
        return self._call(
            lambda: [(bytes(kv.key), bytes(kv.value)) for kv in view.get_range(begin, end, limit=limit, reverse=reverse)]
        )

    def set(self, key: bytes, value: bytes) -> None:
        self.tr.set(key, value)

    def clear(self, key: bytes) -> None:
        self.tr.clear(key)

    def clear_range(self, begin: bytes, end: bytes) -> None:
        self.tr.clear_range(begin, end)

    def add(self, key: bytes, delta: int) -> None:
        self.tr.add(key, encode_int(delta))

    def max(self, key: bytes, value: int) -> None:
        self.tr.max(key, encode_int(value))

    def set_stamped(self, prefix: bytes, value: bytes) -> None:
        # the incomplete versionstamp's position follows the key as 4 bytes little-endian (API >= 520)
        self.tr.set_versionstamped_key(prefix + b"\xff" * STAMP_BYTES + struct.pack("<I", len(prefix)), value)

    def commit(self) -> None:
        self._call(lambda: self.tr.commit().wait())

    def reset(self) -> None:
        self.tr.reset()

    def cancel(self) -> None:
        self.tr.cancel()


class FdbDatabase(Database):
    """A FoundationDB cluster.  ``cluster_file`` None means the default (or ``FDB_CLUSTER_FILE``).

    The 5 s transaction lifetime is FoundationDB's own and not configurable here.
    """

    def __init__(self, cluster_file: str | None = None, api_version: int = 710, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._fdb = load_fdb(api_version)
        if cluster_file is not None and not os.path.exists(cluster_file):
            raise KvfsError(f"FoundationDB cluster file {cluster_file} does not exist", errno.ENOENT)
        try:
            self._db = self._fdb.open(cluster_file)
            self._db.options.set_transaction_size_limit(max_bytes)
        except self._fdb.FDBError as exc:
            raise KvfsError(f"cannot open FoundationDB cluster {cluster_file or '(default)'}: {exc}", errno.EHOSTUNREACH) from exc

    def create_transaction(self) -> FdbTransaction:
        return FdbTransaction(self._fdb, self._db.create_transaction())

    def run(self, fn: Callable[Concatenate[Transaction, P], R], *args: P.args, **kw: P.kwargs) -> R:
        """FoundationDB's own retry loop: ``on_error`` decides what is retryable and backs off."""
        tr = self.create_transaction()
        while True:
            try:
                result = fn(tr, *args, **kw)
                tr.commit()
                return result
            except KvfsError as exc:
                cause = exc.__cause__
                if not isinstance(cause, self._fdb.FDBError):
                    raise
                tr._call(lambda: tr.tr.on_error(cause).wait())  # re-raises if not retryable
