"""Real kvfs processes on loopback for tests: start them, wait for them, always stop them."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from array import array
from pathlib import Path

import trio

from kvfs import wire
from kvfs.chunkserver.engine import BLOCK, BLOCK_CLS, ChunkEngine
from kvfs.rpc import FrameReader, authenticate_client, send_all

REPO = Path(__file__).resolve().parent.parent
TOKEN = "kvfs-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def authenticated(address: str, token: str = TOKEN, sock: trio.socket.SocketType | None = None
                        ) -> tuple[trio.socket.SocketType, wire.Signer]:
    """A raw trio socket to ``address`` that went through the handshake, and its signer, for frames sent by
    hand (``sock``: one already made, e.g. with a small receive buffer)."""
    host, port = address.rsplit(":", 1)
    sock = sock or trio.socket.socket()
    await sock.connect((host, int(port)))
    signer = await authenticate_client(FrameReader(sock), functools.partial(send_all, sock), address, token.encode())
    return sock, signer


class RecordingProxy:
    """Forwards TCP connections to ``upstream`` both ways and records, per connection, what the client sent."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.recorded: list[bytearray] = []
        self.upstream_sockets: list[trio.socket.SocketType] = []

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen()
        task_status.started("127.0.0.1:%d" % listener.getsockname()[1])
        async with trio.open_nursery() as nursery:
            while True:
                down, _ = await listener.accept()
                nursery.start_soon(self._relay, down)

    async def _relay(self, down: trio.socket.SocketType) -> None:
        host, port = self.upstream.rsplit(":", 1)
        up = trio.socket.socket()
        await up.connect((host, int(port)))
        record = bytearray()
        self.recorded.append(record)
        self.upstream_sockets.append(up)
        with down, up:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, down, up, record, nursery.cancel_scope)
                nursery.start_soon(self._pump, up, down, None, nursery.cancel_scope)

    @staticmethod
    async def _pump(src, dst, record: bytearray | None, scope: trio.CancelScope) -> None:
        with contextlib.suppress(OSError):
            while chunk := await src.recv(1 << 16):
                if record is not None:
                    record.extend(chunk)
                await send_all(dst, chunk)
        scope.cancel()  # either side hung up: so does the proxy


async def send_until_closed(sock: trio.socket.SocketType, data: bytes) -> bytes:
    """Send ``data`` and read until the server closes (or resets) the connection; what came back. Closes ``sock``."""
    await send_all(sock, data)
    got = b""
    with sock, trio.fail_after(5), contextlib.suppress(ConnectionResetError):  # reset: closed with bytes unread
        while chunk := await sock.recv(1 << 16):
            got += chunk
    return got


def frames(stream: bytes) -> list[tuple[wire.Header, bytes]]:
    """Split a recorded client stream into its frames (header, and the frame's bytes as sent)."""
    out, pos = [], 0
    while pos < len(stream):
        header = wire.decode_header(stream[pos : pos + wire.HEADER_SIZE], wire.Limits())
        end = pos + wire.HEADER_SIZE + header.body_len + header.data_len
        out.append((header, bytes(stream[pos:end])))
        pos = end
    return out


def wait_for_port(address: str, proc: subprocess.Popen | None = None, timeout: float = 20.0) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {address}")
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {address} after {timeout}s")


class Processes:
    """Starts kvfs commands as real processes and guarantees they are gone at teardown."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        full_env = {**os.environ, "KVFS_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfs", *args], stdout=log, stderr=subprocess.STDOUT, env=full_env,
            cwd=REPO, start_new_session=True,
        )
        proc.name = name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    @staticmethod
    def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=5)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    self.kill(proc)


class Cluster:
    """A real cluster on loopback: mgmtd(s), chunk servers, optionally meta, as separate processes."""

    def __init__(self, processes: Processes, workdir: Path, config: Path) -> None:
        self.processes = processes
        self.workdir = workdir
        self.config = config
        self.mgmtd: list[str] = []
        self.meta: list[str] = []
        self.chunkservers: dict[int, tuple[str, subprocess.Popen]] = {}

    def start_mgmtd(self, name: str = "mgmtd0") -> str:
        address = f"127.0.0.1:{free_port()}"
        proc = self.processes.start("mgmtd", "--config", str(self.config), "--listen", address,
                                    "--kv-url", f"sqlite:///{self.workdir}/kv.db", name=name)
        wait_for_port(address, proc)
        self.mgmtd.append(address)
        return address

    def start_meta(self, name: str = "meta0") -> str:
        address = f"127.0.0.1:{free_port()}"
        args = ["meta", "--config", str(self.config), "--listen", address, "--kv-url", f"sqlite:///{self.workdir}/kv.db"]
        proc = self.processes.start(*args, *[a for m in self.mgmtd for a in ("--mgmtd", m)], name=name)
        wait_for_port(address, proc)
        self.meta.append(address)
        return address

    def start_chunkserver(self, node_id: int, address: str | None = None) -> str:
        address = address or f"127.0.0.1:{free_port()}"
        target = self.workdir / f"cs{node_id}"
        args = ["chunkserver", "--config", str(self.config), "--node-id", str(node_id), "--listen", address,
                "--target", str(target)]
        proc = self.processes.start(*args, *[a for m in self.mgmtd for a in ("--mgmtd", m)], name=f"cs{node_id}")
        wait_for_port(address, proc)
        self.chunkservers[node_id] = (address, proc)
        return address

    def kill_chunkserver(self, node_id: int) -> None:
        self.processes.kill(self.chunkservers[node_id][1])


def write_config(path: Path, capacity_bytes: int | None = None, sync_interval: float | None = None,
                 **timeouts: float) -> Path:
    """A cluster config with short timeouts (fast failover in tests) and no fsync (tests need no power-loss
    safety), unless ``sync_interval`` is given: then write-back chunk servers that flush that often (0: only
    when a client syncs)."""
    settings = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "lease": 1.0, "call": 10.0, "connect": 1.0}
    settings.update(timeouts)
    chunkserver = f"capacity_bytes = {capacity_bytes}\n" if capacity_bytes else ""
    chunkserver += "fsync = false\n" if sync_interval is None else f"sync_interval = {sync_interval}\n"
    path.write_text("[timeouts]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items())
                    + f"\n[chunkserver]\n{chunkserver}\n[meta-service]\ngc_interval = 0.3\n")
    return path


def _block_slots(blob: bytes) -> dict[int, int]:
    """A row's overrides: block -> its slot in the 64 KiB slot file."""
    pairs = array("I", blob)
    return dict(zip(pairs[::2], pairs[1::2]))


def _blocks_read(cls: int, slot: int, length: int, overrides: bytes) -> list[tuple[int, int, int]]:
    """Where a row keeps each of its blocks, in order: (slot file class, slot, block within the slot)."""
    own = _block_slots(overrides)
    return [(BLOCK_CLS, own[b], 0) if b in own else (cls, slot, b) for b in range(-(-length // BLOCK))]


def tear_unsynced(root: Path, rng: random.Random, share: float = 0.5) -> int:
    """What a power loss may leave: rows of versions staged since the last sync, but not all of their data
    (``share`` of them torn, at a byte of the base or of a block slot, wherever the version keeps it). Only a block
    no synced row reads can be torn: one a synced row reads was written before that sync and never since (a
    version shares blocks with the one before it, and a fold writes into a shared base only blocks that every row
    naming it keeps in block slots of its own). Returns how many it tore."""
    db = sqlite3.connect(root / "chunks.sqlite")
    try:
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'unsynced'").fetchone() is None:
            return 0  # no engine got as far as making its tables (a process killed while starting)
        listed = "EXISTS (SELECT 1 FROM unsynced u WHERE v.inode=u.inode AND v.idx=u.idx AND v.version=u.version" \
                 " AND v.pending < 2)"
        rows = db.execute(f"SELECT v.cls, v.slot, v.length, v.overrides FROM versions v WHERE {listed}").fetchall()
        synced = set()  # (slot file class, slot, block in it) that a synced row reads
        for cls, slot, length, overrides in db.execute(
                f"SELECT cls, slot, length, overrides FROM versions v WHERE NOT {listed}"):
            synced.update(_blocks_read(cls, slot, length, overrides))
    finally:
        db.close()
    torn = 0
    for cls, slot, length, overrides in rows:
        where = [(at_cls, at_slot, at * BLOCK, min(BLOCK, length - b * BLOCK))
                 for b, (at_cls, at_slot, at) in enumerate(_blocks_read(cls, slot, length, overrides))
                 if (at_cls, at_slot, at) not in synced]
        if where and rng.random() < share:
            at_cls, at_slot, start, n = rng.choice(where)
            with open(root / "data" / f"{at_cls:02d}.dat", "r+b") as f:
                f.seek((at_slot << at_cls) + start + rng.randrange(n))
                f.write(b"\xff")  # neither a payload byte nor zero fill
            torn += 1
    return torn


def assert_slots_accounted(engine: ChunkEngine) -> None:
    """Every slot of every slot file is either named by a row (a base or a block slot, shared or not) or on its
    file's free list, once, never both; and the engine's bytes in use are those of the named slots: no slot
    leaked, none doubly used."""
    db = sqlite3.connect(engine.root / "chunks.sqlite")
    try:
        named = set()
        for cls, slot, overrides in db.execute("SELECT cls, slot, overrides FROM versions"):
            named.add((cls, slot))
            named.update((BLOCK_CLS, s) for s in _block_slots(overrides).values())
    finally:
        db.close()
    for cls, f in engine._slots.files.items():
        free = {(cls, s) for s in f.free}
        assert len(free) == len(f.free), f"{f.path}: a slot is on the free list twice"
        assert not free & named, f"{f.path}: slots {sorted(free & named)[:5]} are named by a row and free"
        assert len(free) + sum(1 for c, _ in named if c == cls) == f.total, f"{f.path}: slots leaked"
    assert engine.space()[1] == sum(1 << cls for cls, _ in named)