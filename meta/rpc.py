"""The metadata service's wire surface, derived from :class:`kvfs.meta.api.MetaApi`.

Each operation of the API becomes one RPC method whose request struct holds the operation's parameters (typed
from its annotations) and whose response struct holds its return value. Deriving them keeps the API the single
place an operation's shape is defined: the service and the client cannot drift from it.
Method ids are positions in :data:`OPERATIONS`, so new operations are appended, never inserted.
"""

from __future__ import annotations

import functools
import inspect
import os
import operator
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

from kvfs.wire import Method
from kvfs.meta.api import MetaApi
from kvfs.meta.types import Caller, ChangePage

#: Every operation served over RPC, in method-id order (append only), and whether a blind retry is safe.
OPERATIONS: tuple[tuple[str, bool], ...] = (
    ("lookup", True),
    ("getattr", True),
    ("setattr", False),
    ("create", False),
    ("mknod", False),
    ("mkdir", False),
    ("unlink", False),
    ("rmdir", False),
    ("symlink", False),
    ("readlink", True),
    ("link", False),
    ("rename", False),
    ("readdir", True),
    ("statfs", True),
    ("getxattr", True),
    ("setxattr", False),
    ("listxattr", True),
    ("removexattr", False),
    ("open", False),
    ("close", False),
    ("report_length", True),
    ("set_length", True),
    ("get_layout", True),
    ("set_layout", False),
    ("resolve", True),
    ("access", True),
    ("close_sessions", True),
    ("renew_client", True),
    ("delegate", False),
    ("undelegate", True),
    ("apply_delegated", False),
    ("batch_lookup", True),
    ("begin_puts", False),
    ("commit_puts", False),
    ("batch_unlink", False),
    ("touch_atimes", True),
)
METHOD_BASE = 100


@dataclass(frozen=True, slots=True)
class Operation:
    name: str
    method: Method
    signature: inspect.Signature
    params: tuple[str, ...]
    names: frozenset[str]  # parameters that are names/paths: str accepted, bytes on the wire

    def request(
        self, caller: Caller, args: tuple[Any, ...], kwargs: dict[str, Any], op_id: bytes = b""
    ) -> msgspec.Struct:
        """The request struct for a call; ``op_id`` names a non-idempotent call so its retries run it once."""
        if not kwargs and len(args) == len(self.params):  # every argument by position: no binding to do
            values = dict(zip(self.params, args))
            values["caller"] = caller
        else:
            bound = self.signature.bind(None, caller, *args, **kwargs)
            bound.apply_defaults()
            values = {name: bound.arguments[name] for name in ("caller", *self.params)}
        for name in self.names:
            if isinstance(values[name], str):
                values[name] = os.fsencode(values[name])
        if not self.method.idempotent:
            values["op_id"] = op_id
        return self.method.request(**values)


def _is_name(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and {bytes, str} <= set(typing.get_args(hint))


def _wire_type(hint: Any) -> Any:
    """Names arrive as ``bytes | str`` in the store; on the wire they are always bytes (msgpack can't tell)."""
    if _is_name(hint):
        rest = [a for a in typing.get_args(hint) if a not in (bytes, str)]
        return functools.reduce(operator.or_, rest, bytes)
    return hint


def _derive(name: str, position: int, idempotent: bool) -> Operation:
    fn = getattr(MetaApi, name)
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    params = [p for p in signature.parameters.values()][2:]  # skip self, caller
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [("caller", Caller)]
    for p in params:
        kind = _wire_type(hints.get(p.name, Any))
        fields.append((p.name, kind) if p.default is inspect.Parameter.empty else (p.name, kind, p.default))
    if not idempotent:  # see MetaStore.answering_once; empty: run as sent (an older client)
        fields.append(("op_id", bytes, b""))
        fields.append(("op_retry", bool, False))  # set on re-sends: only those can find a recorded answer
    title = "".join(part.title() for part in name.split("_"))
    request = msgspec.defstruct(f"{title}Request", fields, kw_only=True, module=__name__)
    response = msgspec.defstruct(f"{title}Response", [("value", hints.get("return", Any))], module=__name__)
    method = Method(METHOD_BASE + position, f"meta.{name}", request, response, idempotent=idempotent)
    names = frozenset(p.name for p in params if _is_name(hints.get(p.name)))
    return Operation(name, method, signature, tuple(p.name for p in params), names)


OPS: dict[str, Operation] = {
    name: _derive(name, position, idempotent) for position, (name, idempotent) in enumerate(OPERATIONS)
}


class WatchRequest(msgspec.Struct, kw_only=True):
    """Long-poll the change feed: answered as soon as a change by another client follows ``since``, or after
    ``wait`` seconds with none (then the page is empty and the cursor may still have moved)."""

    caller: Caller
    since: bytes = b""
    wait: float = 0.0
    limit: int = 1024


class WatchResponse(msgspec.Struct):
    value: ChangePage


#: The feed's long poll lives in the service (the store never waits), so it is not derived from the store.
WATCH = Method(METHOD_BASE + 99, "meta.watch", WatchRequest, WatchResponse, idempotent=True)
MAX_WATCH_WAIT = 20.0  # seconds; a longer wait is cut to this, under the clients' call timeout (30 s default)
