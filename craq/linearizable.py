"""A linearizability checker for one read/write register (Wing & Gong search with Lowe's memoisation).

Histories are checked per chunk: CRAQ orders writes per chunk and a chunk is an independent register, so the
whole history is linearizable iff each chunk's is. Writes carry unique values. A write that was never answered
(the client timed out and gave up) may or may not have taken effect: it may be linearized anywhere after its
invocation, or left out. Reads that were never answered have no effect and are dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Op:
    kind: Literal["write", "read"]
    value: bytes  # the value written, or the value the read returned
    invoke: float
    response: float | None  # None: no answer came back
    label: str = ""


def check_register(ops: list[Op], initial: bytes = b"") -> bool:
    """True if some total order of ``ops`` respects real time and register semantics."""
    ops = sorted((o for o in ops if o.kind == "write" or o.response is not None), key=lambda o: o.invoke)
    resp = [math.inf if o.response is None else o.response for o in ops]
    must = sum(1 << i for i, o in enumerate(ops) if o.response is not None)
    seen: set[tuple[int, bytes]] = set()
    stack = [(0, initial)]
    while stack:
        done, value = stack.pop()
        if done & must == must:
            return True
        if (done, value) in seen:
            continue
        seen.add((done, value))
        todo = [i for i in range(len(ops)) if not done >> i & 1]
        horizon = min(resp[i] for i in todo)  # an op invoked after some op answered cannot go before it
        for i in todo:
            op = ops[i]
            if op.invoke > horizon:
                break
            if op.kind == "write":
                stack.append((done | 1 << i, op.value))
            elif op.value == value:
                stack.append((done | 1 << i, value))
    return False
