"""What every kvfs server process shares: logging, signals, the metrics/health endpoint, and how the process's
garbage collector treats long-lived state.

The HTTP endpoint is a few lines of trio rather than ``prometheus_client.start_http_server`` so that it lives
in the service's nursery like every other task, instead of in a stray thread.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import prometheus_client
import trio
from prometheus_client.core import HistogramMetricFamily

from kvfs.errors import KvfsError

log = logging.getLogger("kvfs.service")


class _CollectorPauses:
    """``kvfs_gc_pause_seconds{generation}``, kept in plain lists rather than a prometheus_client Histogram: the
    garbage collector may run inside any allocation, including one that a metric makes while holding its own lock
    (a scrape copies a labelled metric's children under it), and a callback that then took that lock would wait
    for itself forever. Updating lists takes no lock; a scrape reads them as they are."""

    BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
    GENERATIONS = 3

    def __init__(self) -> None:
        self.counts = [[0] * (len(self.BUCKETS) + 1) for _ in range(self.GENERATIONS)]  # the last: over them all
        self.sums = [0.0] * self.GENERATIONS

    def observe(self, generation: int, seconds: float) -> None:
        self.counts[generation][bisect.bisect_left(self.BUCKETS, seconds)] += 1
        self.sums[generation] += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "kvfs_gc_pause_seconds", "Garbage collections of this process by generation, and how long each stopped it",
            labels=["generation"])
        bounds = [str(b) for b in self.BUCKETS] + ["+Inf"]
        for generation in range(self.GENERATIONS):
            cumulative = list(itertools.accumulate(self.counts[generation]))
            family.add_metric([str(generation)], list(zip(bounds, cumulative)), self.sums[generation])
        yield family


GC_PAUSES = _CollectorPauses()


def freeze_after_full_collections() -> None:
    """Keep what survives a full collection out of every later one.

    A server's long-lived state is Python objects, several per chunk or inode (a chunk engine's versions, a chain
    member's chunk records), and a full collection walks all of them: its pause grows with the data a server
    holds (``benchmarks/gc_pause.py``) until it stalls every chain through the server and, past the heartbeat
    timeout, mgmtd takes the server for dead. Everything alive at the end of a full collection has just been
    found reachable, so it is frozen (``gc.freeze``): later full collections walk only what was made since.
    The price: a reference cycle among objects frozen while alive that becomes garbage later is never freed.
    The servers' long-lived state is freed by reference counting, and such cycles are rare (benchmarks/RESULTS.md
    counts what full collections of busy chunk servers find). Only for processes kvfs owns: kvclient, a library
    inside someone else's process, leaves that process's collector alone (and its metrics: the pauses are
    registered here, not when the module is imported)."""
    global _pauses_registered
    if not _pauses_registered:
        prometheus_client.REGISTRY.register(GC_PAUSES)  # type: ignore[arg-type]
        _pauses_registered = True
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


_pauses_registered = False


_collection_started = 0.0


def _on_collection(phase: str, info: dict[str, int]) -> None:
    global _collection_started
    if phase == "start":
        _collection_started = time.perf_counter()
        return
    generation = info["generation"]
    GC_PAUSES.observe(generation, time.perf_counter() - _collection_started)
    if generation == 2:
        gc.freeze()


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class Complaint:
    """A condition that a loop meets again and again (a peer refusing us, a service unreachable): logged when it
    starts or changes, and once more when it ends, not at every retry."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self._last: str | None = None

    def failed(self, exc: BaseException) -> None:
        text = exc.message if isinstance(exc, KvfsError) else str(exc)
        if text != self._last:
            self._log.warning("%s: %s (said once until it changes)", self._what, text)
            self._last = text

    def succeeded(self) -> None:
        if self._last is not None:
            self._log.info("%s: working again", self._what)
            self._last = None


async def _http_connection(stream: trio.SocketStream, health: Callable[[], dict[str, Any]]) -> None:
    async with stream:
        request = b""
        with trio.move_on_after(5):
            while b"\r\n\r\n" not in request and len(request) < 8192:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                request += chunk
        parts = request.split(b" ", 2)
        path = parts[1].decode("latin-1", "replace") if len(parts) > 1 else ""
        if path == "/metrics":
            status, ctype, body = "200 OK", prometheus_client.CONTENT_TYPE_LATEST, prometheus_client.generate_latest()
        elif path == "/health":
            state = health()
            status = "200 OK" if state.get("ok", True) else "503 Service Unavailable"
            ctype, body = "application/json", json.dumps(state).encode()
        else:
            status, ctype, body = "404 Not Found", "text/plain", b"try /metrics or /health\n"
        head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
        try:
            await stream.send_all(head.encode() + body)
        except trio.BrokenResourceError:
            pass


async def serve_http(
    host: str,
    port: int,
    health: Callable[[], dict[str, Any]],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` (Prometheus) and ``/health`` (JSON) until cancelled."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(lambda s: _http_connection(s, health), listeners)


#: RPC servers of this process, drained before it exits (see RpcServer.drain).
_servers: list[Any] = []
DRAIN_GRACE = 10.0


async def until_signalled(scope: trio.CancelScope) -> None:
    """On SIGTERM or SIGINT, let running calls finish, then cancel ``scope`` so the service unwinds."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            async with trio.open_nursery() as nursery:
                for server in _servers:
                    nursery.start_soon(server.drain, DRAIN_GRACE)
            scope.cancel()
            return


def run_service(main: Callable[[], Awaitable[None]]) -> None:
    """Run a service's main coroutine under trio until it returns or a stop signal arrives."""
    freeze_after_full_collections()

    async def wrapper() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(until_signalled, nursery.cancel_scope)
            await main()
            nursery.cancel_scope.cancel()

    trio.run(wrapper)


async def serve_rpc(
    server: Any,
    listen: str,
    *,
    http: str | None = None,
    health: Callable[[], dict[str, Any]] = lambda: {"ok": True},
    background: tuple[Callable[[], Awaitable[None]], ...] = (),
) -> None:
    """Serve ``server`` (an RpcServer) on ``listen`` with its background tasks and HTTP endpoint until cancelled."""
    from kvfs.rpc import parse_address

    host, port = parse_address(listen)
    _servers.append(server)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(server.serve, host, port)
        log.info("%s serving on %s:%s", server.log.name, host, bound)
        if http:
            http_host, http_port = parse_address(http)
            await nursery.start(serve_http, http_host, http_port, health)
        for task in background:
            nursery.start_soon(task)
