"""RPC benchmark: small-call rates and bulk throughput, beside a plain-socket pump in the same run.

    .venv/bin/python benchmarks/rpc_bench.py [--seconds 2] [--cpu-per-call]

The server runs in its own process (as it would in a cluster) so client and server each get a core.
Figures:
  * small calls/s: one connection ping-pong (1 in flight) and pipelined (64 in flight on one connection), beside
    bare trio doing the same between the same two processes (one byte each way over a trio socket: one task
    ping-ponging, or 64 tasks each sending its byte and waiting to be woken by a reader task) as what an RPC core
    on trio can approach; the two take turns in four slices of the measuring time, so both meet the same load;
  * new connections/s: connect, authenticate and make one small call, one at a time;
  * bulk GB/s for 1, 4 and 16 MiB data sections, client -> server (write-like) and server -> client
    (read-like, received with recv_into straight into a reused buffer), 4 in flight;
  * the same sizes through a plain socket pump (sendall / recv_into a reused buffer, 1-byte ack) as the ceiling.

``--cpu-per-call`` measures only small calls (64 in flight, then 1) and prints the CPU each costs the client and
the server process: on a machine shared with other work, rates swing with the load and CPU per call much less.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import socket
import time

import msgspec
import trio

from kvfs.rpc import RpcClient, RpcServer
from kvfs.wire import Limits, Method

TOKEN = "bench"
ROUNDS = 4
SIZES = [1 << 20, 4 << 20, 16 << 20]


class Req(msgspec.Struct, array_like=True):
    want: int = 0


class Resp(msgspec.Struct, array_like=True):
    got: int = 0


PING = Method(9901, "bench.ping", Req, Resp, idempotent=True)
PUT = Method(9902, "bench.put", Req, Resp)
GET = Method(9903, "bench.get", Req, Resp, idempotent=True)
LIMITS = Limits(max_data=64 << 20)


def rpc_server(port_queue: mp.Queue) -> None:
    blob = memoryview(bytes(max(SIZES)))

    async def ping(req, data, ctx):
        return Resp(0)

    async def put(req, data, ctx):
        return Resp(len(data))

    async def get(req, data, ctx):
        return Resp(req.want), blob[: req.want]

    async def main():
        server = RpcServer(TOKEN, limits=LIMITS)
        for method, fn in ((PING, ping), (PUT, put), (GET, get)):
            server.register(method, fn, inline=method is PING)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            port_queue.put(port)

    trio.run(main)


def trio_echo_server(port_queue: mp.Queue) -> None:
    """Echo every byte back: the bare trio side of the ping-pong ceiling."""

    async def echo(stream: trio.SocketStream) -> None:
        stream.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        async for chunk in stream:
            await stream.send_all(chunk)

    async def main():
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port_queue.put(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(echo, listeners)

    trio.run(main)


async def trio_ping_pong(port: int, seconds: float) -> float:
    """Round trips/s of one byte over trio sockets, one in flight: what trio itself costs per round trip."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    stream.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    async with stream:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            await stream.send_all(b"p")
            await stream.receive_some(1)
            count += 1
        return count / (time.perf_counter() - start)


async def trio_pipelined(port: int, seconds: float, in_flight: int = 64) -> float:
    """Round trips/s of ``in_flight`` tasks on one trio socket, each sending one byte and parked until a reader
    task, taking the echoes in order, wakes it: the task switches and a send per call, no framing."""
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    waiting: collections.deque[trio.Event] = collections.deque()

    async def read_echoes() -> None:
        while chunk := await sock.recv(65536):
            for _ in range(len(chunk)):
                waiting.popleft().set()

    async def one_call() -> None:
        done = trio.Event()
        waiting.append(done)
        await sock.send(b"p")
        await done.wait()

    with sock:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_echoes)
            calls_per_s = await rate(seconds, in_flight, one_call)
            nursery.cancel_scope.cancel()
    return calls_per_s


def plain_server(port_queue: mp.Queue) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    buf = memoryview(bytearray(max(SIZES)))
    while True:
        conn, _ = listener.accept()
        with conn:
            header = bytearray(8)
            while conn.recv_into(header, 8) == 8:
                size = int.from_bytes(header, "little")
                got = 0
                while got < size:
                    got += conn.recv_into(buf[got:size])
                conn.sendall(b"k")


def plain_pump(port: int, size: int, seconds: float) -> float:
    payload = memoryview(bytes(size))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        moved, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            sock.sendall(size.to_bytes(8, "little"))
            sock.sendall(payload)
            sock.recv(1)
            moved += size
        return moved / (time.perf_counter() - start)


async def rate(seconds: float, in_flight: int, call) -> float:
    count = 0
    deadline = trio.current_time() + seconds

    async def worker():
        nonlocal count
        while trio.current_time() < deadline:
            await call()
            count += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(in_flight):
            nursery.start_soon(worker)
    return count / (time.perf_counter() - start)


async def rpc_figures(address: str, echo_port: int, seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """The RPC figures, and bare trio's for the small-call ones. Small calls and bare trio take turns in
    ``ROUNDS`` slices of the measuring time each, so a change in the machine's load meets both alike."""
    out: dict[str, float] = {}
    bare: dict[str, float] = {"ping-pong calls/s": 0.0, "pipelined x64 calls/s": 0.0}
    async with RpcClient(TOKEN, limits=LIMITS) as client:
        await client.call(address, PING, Req())
        out.update(bare)
        for _ in range(ROUNDS):
            for name, in_flight, bare_rate in (("ping-pong calls/s", 1, trio_ping_pong),
                                               ("pipelined x64 calls/s", 64, trio_pipelined)):
                out[name] += await rate(seconds / ROUNDS, in_flight, lambda: client.call(address, PING, Req()))
                bare[name] += await bare_rate(echo_port, seconds / ROUNDS)
        for name in bare:
            out[name] /= ROUNDS
            bare[name] /= ROUNDS

        async def reconnect():
            client.close()  # the next call opens (and authenticates) a new connection
            await client.call(address, PING, Req())

        out["new connection + call/s"] = await rate(seconds, 1, reconnect)
        for size in SIZES:
            payload = memoryview(bytes(size))
            put_rate = await rate(seconds, 4, lambda: client.call(address, PUT, Req(), data=payload))
            out[f"put {size >> 20} MiB GB/s"] = put_rate * size / 1e9
            buffers = [memoryview(bytearray(size)) for _ in range(4)]

            async def get(buffers=buffers, size=size):
                buf = buffers.pop()
                try:
                    await client.call_with_data(address, GET, Req(size), into=buf)
                finally:
                    buffers.append(buf)

            out[f"get {size >> 20} MiB GB/s"] = await rate(seconds, 4, get) * size / 1e9
    return out, bare


def process_cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def process_cpu(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    return sum(process_cpu_split(pid))


async def cpu_per_call(address: str, seconds: float, server_pid: int) -> None:
    async with RpcClient(TOKEN, limits=LIMITS) as client:
        for _ in range(200):
            await client.call(address, PING, Req())
        for in_flight in (64, 1):
            client_cpu, server_cpu = time.process_time(), process_cpu(server_pid)
            calls_per_s = await rate(seconds, in_flight, lambda: client.call(address, PING, Req()))
            calls = calls_per_s * seconds
            client_us = (time.process_time() - client_cpu) / calls * 1e6
            server_us = (process_cpu(server_pid) - server_cpu) / calls * 1e6
            print(f"x{in_flight:<3} in flight {calls_per_s:>9,.0f} calls/s   CPU per call: client {client_us:5.1f} us,"
                  f" server {server_us:5.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per figure")
    parser.add_argument("--cpu-per-call", action="store_true", help="only small calls, with their CPU per call")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if args.cpu_per_call:
        server = ctx.Process(target=rpc_server, args=(queue,), daemon=True)
        server.start()
        try:
            trio.run(cpu_per_call, f"127.0.0.1:{queue.get(timeout=30)}", args.seconds, server.pid)
        finally:
            server.terminate()
        return
    servers, ports = [], []
    for target in (rpc_server, plain_server, trio_echo_server):
        servers.append(ctx.Process(target=target, args=(queue,), daemon=True))
        servers[-1].start()
        ports.append(queue.get(timeout=30))
    rpc_port, plain_port, echo_port = ports
    try:
        figures, bare_trio = trio.run(rpc_figures, f"127.0.0.1:{rpc_port}", echo_port, args.seconds)
        plain = {size: plain_pump(plain_port, size, args.seconds) / 1e9 for size in SIZES}
    finally:
        for proc in servers:
            proc.terminate()
    print(f"{'figure':<28}{'kvfs rpc':>12}{'plain socket':>14}{'ratio':>8}")
    bare_what = {"ping-pong calls/s": "bare trio ping-pong", "pipelined x64 calls/s": "bare trio, 64 tasks"}
    for name, value in figures.items():
        size_mib = name.split()[1] if name.startswith(("put", "get")) else None
        if name in bare_trio:
            base = bare_trio[name]
            print(f"{name:<28}{value:>12,.0f}{base:>14,.0f}{value / base:>8.2f}  ({bare_what[name]}, same turns)")
        elif size_mib is None:
            print(f"{name:<28}{value:>12,.0f}")
        else:
            base = plain[int(size_mib) << 20]
            print(f"{name:<28}{value:>12.2f}{base:>14.2f}{value / base:>8.2f}")


if __name__ == "__main__":
    main()
