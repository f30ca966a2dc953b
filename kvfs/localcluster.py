"""``kvfs up`` / ``kvfs down`` / ``kvfs status``: a whole cluster on one host, for everyone without Ansible.

Everything lives under one data directory:

* ``cluster.toml`` — the config every process reads (token, addresses, KV store URL), private to the owner;
* ``client.toml`` — what a client needs (addresses and token) for kvclient and other tools;
* ``local.json`` — this tool's own record: ports, chunk server count, replicas, mount point;
* ``logs/<name>.log``, ``run/<name>.pid`` and ``run/<name>.started`` (when it was started, in ns) — one per
  process; ``targets/cs<N>`` — chunk data;
* ``kv.db`` — the KV store (SQLite) of mgmtd and meta, unless ``--kv-dir`` put it on another file system: chunk
  servers leave a reserve of the disk free (``[chunkserver] reserve_bytes``) so that chunk data filling it does
  not take the KV store with it, and a separate disk makes that certain.

``up`` is idempotent: run again on the same directory it restarts only what is not running and keeps all data.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from kvfs.config import ChunkServerSection, ClusterConfig, Timeouts, load_config, new_token, save_config
from kvfs.errors import KvfsError


#: ``kvfs up --memory-mb``'s default: the whole cluster's memory (PSS) while it takes and serves data.
DEFAULT_MEMORY = 1 << 30
#: What the budget sets aside before the chunk servers' share: each process's interpreter, code and working heap
#: (27 MiB idle, more while data moves), and the mount's write buffers (benchmarks/memory_pss.py measures both).
PROCESS_BASE = 48 << 20
MOUNT_BUFFERS = 160 << 20
#: Below this a chunk server's buffers would not hold the chunk writes one client keeps in flight.
MIN_CHUNKSERVER_MEMORY = 64 << 20


def chunkserver_memory(budget: int, chunkservers: int) -> int:
    """Each chunk server's ``[chunkserver] memory_bytes`` when a host's cluster of ``chunkservers`` chunk servers,
    mgmtd, meta and the mount is to stay within ``budget`` bytes: what the others need, then equal shares."""
    share = (budget - (chunkservers + 3) * PROCESS_BASE - MOUNT_BUFFERS) // chunkservers
    if share < MIN_CHUNKSERVER_MEMORY:
        raise KvfsError(f"--memory-mb {budget >> 20} leaves {max(share, 0) >> 20} MiB to each of {chunkservers} chunk"
                        f" servers; they need {MIN_CHUNKSERVER_MEMORY >> 20} MiB each", errno.EINVAL)
    return share


class LocalLayout(msgspec.Struct, kw_only=True):
    mgmtd: str
    meta: str
    chunkservers: dict[int, str]
    replicas: int
    mount: str
    targets_per_server: int = 1


@dataclass(frozen=True)
class Process:
    name: str
    role: str
    address: str
    argv: list[str]
    node_id: int = 0  # chunk servers only


def _free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now. Every socket stays bound until all are chosen: one closed
    before the next was bound let the kernel hand out a port twice (mgmtd and a chunk server got the same)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _absolute(mount: Path) -> str:
    """The mount point as an absolute path, without touching it: stat-ing a live kvfs mount blocks while its
    metadata service is down, which is exactly when ``kvfs up`` is needed."""
    return os.path.abspath(mount)


def process_exists(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own child (up and down in one process)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.3).close()
        return True
    except OSError:
        return False


class LocalCluster:
    def __init__(self, data: Path) -> None:
        self.data = data.resolve()
        self.config_path = self.data / "cluster.toml"
        self.client_config_path = self.data / "client.toml"
        self.layout_path = self.data / "local.json"

    # ------------------------------------------------------------------------------ bookkeeping

    def _init(
        self, mount: Path, chunkservers: int, replicas: int, targets_per_server: int = 1, fsync: bool = True,
        write_through: bool = False, kv_dir: Path | None = None, memory: int = DEFAULT_MEMORY,
    ) -> tuple[ClusterConfig, LocalLayout]:
        kv_url = f"sqlite:///{(kv_dir.resolve() if kv_dir is not None else self.data) / 'kv.db'}"
        if self.layout_path.exists():
            layout = msgspec.json.decode(self.layout_path.read_bytes(), type=LocalLayout)
            config = load_config(self.config_path)
            if kv_dir is not None and config.kv_url != kv_url:
                raise KvfsError(f"--kv-dir {kv_dir}: this cluster keeps its KV store at {config.kv_url} (chosen when"
                                f" {self.data} was created; move it with the cluster down and edit kv_url in"
                                f" {self.config_path})", errno.EINVAL)
            if _absolute(mount) != layout.mount:
                layout.mount = _absolute(mount)
                self.layout_path.write_bytes(msgspec.json.encode(layout))
            return config, layout
        if not 1 <= replicas <= chunkservers:
            raise KvfsError(f"--replicas {replicas} needs at least as many chunk servers (have {chunkservers})",
                            errno.EINVAL)
        memory_bytes = chunkserver_memory(memory, chunkservers)
        for sub in ("logs", "run", "targets"):
            (self.data / sub).mkdir(parents=True, exist_ok=True)
        if kv_dir is not None:
            kv_dir.mkdir(parents=True, exist_ok=True)
        mgmtd_port, meta_port, *chunkserver_ports = _free_ports(2 + chunkservers)
        layout = LocalLayout(
            mgmtd=f"127.0.0.1:{mgmtd_port}",
            meta=f"127.0.0.1:{meta_port}",
            chunkservers={i: f"127.0.0.1:{port}" for i, port in enumerate(chunkserver_ports, 1)},
            replicas=replicas,
            mount=_absolute(mount),
            targets_per_server=targets_per_server,
        )
        config = ClusterConfig(
            token=new_token(), kv_url=kv_url, mgmtd=[layout.mgmtd], meta=[layout.meta],
            timeouts=Timeouts(heartbeat_interval=0.5, heartbeat_timeout=3.0, lease=3.0),
            chunkserver=ChunkServerSection(fsync=fsync, write_through=write_through, memory_bytes=memory_bytes),
        )
        save_config(config, self.config_path)
        save_config(ClusterConfig(token=config.token, mgmtd=config.mgmtd, meta=config.meta), self.client_config_path)
        self.layout_path.write_bytes(msgspec.json.encode(layout))
        return config, layout

    def _load(self) -> tuple[ClusterConfig, LocalLayout]:
        if not self.layout_path.exists():
            raise KvfsError(f"{self.data} holds no kvfs cluster (run kvfs up --data {self.data} first)", errno.ENOENT)
        return load_config(self.config_path), msgspec.json.decode(self.layout_path.read_bytes(), type=LocalLayout)

    def processes(self, layout: LocalLayout) -> list[Process]:
        kvfs = [sys.executable, "-m", "kvfs"]
        cfg = ["--config", str(self.config_path)]
        procs = [Process("mgmtd", "mgmtd", layout.mgmtd, [*kvfs, "mgmtd", *cfg, "--listen", layout.mgmtd])]
        for node, address in sorted(layout.chunkservers.items()):
            targets = [self.data / "targets" / (f"cs{node}" if i == 0 else f"cs{node}.{i}")
                       for i in range(layout.targets_per_server)]
            procs.append(Process(f"cs{node}", "chunkserver", address, [
                *kvfs, "chunkserver", *cfg, "--node-id", str(node), "--listen", address,
                *(arg for target in targets for arg in ("--target", str(target)))], node))
        procs.append(Process("meta", "meta", layout.meta, [*kvfs, "meta", *cfg, "--listen", layout.meta]))
        procs.append(Process("mount", "mount", layout.mount, [*kvfs, "mount", *cfg, layout.mount]))
        return procs

    def _pidfile(self, name: str) -> Path:
        return self.data / "run" / f"{name}.pid"

    def _startfile(self, name: str) -> Path:
        return self.data / "run" / f"{name}.started"

    def _started_ns(self, name: str) -> int:
        """When the running process ``name`` was started (``time.time_ns()`` just before), or 0 if not recorded."""
        try:
            return int(self._startfile(name).read_text())
        except (OSError, ValueError):
            return 0

    def pid_of(self, name: str) -> int | None:
        """The pid of a running process we started, or None (a stale pid file or a reused pid is not ours)."""
        try:
            pid = int(self._pidfile(name).read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if b"kvfs" in cmdline and str(self.config_path).encode() in cmdline else None

    def _start(self, proc: Process) -> subprocess.Popen[bytes]:
        started = time.time_ns()
        with open(self.data / "logs" / f"{proc.name}.log", "ab") as log:
            child = subprocess.Popen(proc.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.data)
        self._pidfile(proc.name).write_text(str(child.pid))
        self._startfile(proc.name).write_text(str(started))
        return child

    def _wait(self, proc: Process, ready: Any, child: subprocess.Popen[bytes] | None, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            alive = child.poll() is None if child is not None else self.pid_of(proc.name) is not None
            if not alive:
                tail = (self.data / "logs" / f"{proc.name}.log").read_text(errors="replace")[-2000:]
                raise KvfsError(f"{proc.name} exited during start-up; its log ends with:\n{tail}")
            if time.monotonic() > deadline:
                raise KvfsError(f"{proc.name} did not become ready in {timeout:g}s (see logs/{proc.name}.log)")
            time.sleep(0.05)

    # --------------------------------------------------------------------------------------- up

    def up(
        self, mount: Path, chunkservers: int = 3, replicas: int = 3, echo: Any = print, *, mounted: bool = True,
        targets_per_server: int = 1, fsync: bool = True, write_through: bool = False, kv_dir: Path | None = None,
        memory: int = DEFAULT_MEMORY,
    ) -> LocalLayout:
        """Start whatever is not running; ``mounted=False`` leaves out the FUSE mount (benchmarks, kvclient).

        The sizes (chunk servers, replicas, targets per server), ``fsync``, ``write_through``, ``kv_dir`` (where
        the KV store goes, by default the data directory) and ``memory`` (the cluster's memory budget in bytes,
        divided by :func:`chunkserver_memory`) apply when the directory is new; a restart keeps what it
        was created with (they live in ``cluster.toml``), and refuses a ``kv_dir`` other than the one it has."""
        from kvfs.fuse.mount import force_unmount, is_mounted

        config, layout = self._init(mount, chunkservers, replicas, targets_per_server, fsync, write_through, kv_dir,
                                    memory)
        daemon_alive = self.pid_of("mount") is not None
        if is_mounted(layout.mount) and not daemon_alive:
            force_unmount(layout.mount)  # a killed daemon's dead mount point: every stat of it fails
        if not is_mounted(layout.mount):  # never stat a live mount: with meta down its daemon cannot answer
            Path(layout.mount).mkdir(parents=True, exist_ok=True)
        started: dict[int, int] = {}  # chunk server node id -> time_ns before it was started
        for proc in self.processes(layout):
            if proc.role == "mount":
                self._ensure_chains(config, layout, echo, started)
                if not mounted or daemon_alive and is_mounted(layout.mount):
                    continue
                self._wait(proc, lambda: is_mounted(layout.mount), self._start(proc))
                echo(f"mounted kvfs at {layout.mount}")
                continue
            child = None
            if self.pid_of(proc.name) is None:
                if _listening(proc.address):  # else it would pass for ready, then die unable to bind
                    port = proc.address.rsplit(":", 1)[1]
                    raise KvfsError(f"{proc.name} cannot start: {proc.address} is in use by a process this cluster"
                                    f" did not start (ss -ltnp 'sport = :{port}' names it)", errno.EADDRINUSE)
                child = self._start(proc)
                echo(f"started {proc.name} (pid {child.pid}) on {proc.address}")
            if proc.role == "chunkserver":
                started[proc.node_id] = self._started_ns(proc.name)
            self._wait(proc, lambda: _listening(proc.address), child)
        return layout

    def _ensure_chains(self, config: ClusterConfig, layout: LocalLayout, echo: Any, started: dict[int, int]) -> None:
        """Create the chain table on first start, then wait until every target serves.

        ``started``: when each chunk server's running process was started (before the incarnation it reports,
        after any earlier one's): its targets count only once mgmtd has heard from that process. A restarted
        mgmtd reports the targets it persisted as serving until a node's first heartbeat shows a new incarnation
        and takes them through a resync, so a table read before that would say ready too soon. That includes
        chunk servers that an earlier ``up`` started before it failed (a port taken)."""
        from kvfs.craq.messages import TargetState
        from kvfs.craq.client import CREATE_CHAINS, STATUS, CreateChains, MgmtdClient
        from kvfs.rpc import RpcClient
        from kvfs.wire import Empty

        async def run() -> None:
            async with RpcClient(config.resolved_token(), connect_timeout=1, call_timeout=5) as rpc:
                mgmtd = MgmtdClient(rpc, config.mgmtd)
                with trio.fail_after(60):
                    while True:
                        status = await mgmtd.call(STATUS, Empty())
                        heard = {n.node_id for n in status.nodes if n.incarnation >= started.get(n.node_id, 0)}
                        if len(heard) >= len(layout.chunkservers):
                            break
                        await trio.sleep(0.1)
                    if not status.routing.chains:
                        created = await mgmtd.call(CREATE_CHAINS, CreateChains(replicas=layout.replicas))
                        echo(f"created chains {created.chain_ids} with {layout.replicas} replicas each")
                    while True:
                        status = await mgmtd.call(STATUS, Empty())
                        states = [t.state for c in status.routing.chains for t in c.targets]
                        if states and all(s is TargetState.SERVING for s in states):
                            return
                        await trio.sleep(0.2)

        try:
            trio.run(run)
        except trio.TooSlowError:
            raise KvfsError("targets did not all become serving within 60 s; see kvfs status and logs/") from None

    # ------------------------------------------------------------------------------------- down

    def down(self, echo: Any = print) -> None:
        """Unmount first (so no writer is cut off mid-flush), then stop meta (its garbage collection calls the
        chunk servers, and would log a failed round if they went first), then the chunk servers and mgmtd."""
        config, layout = self._load()
        from kvfs.fuse.mount import force_unmount, is_mounted

        procs = self.processes(layout)
        if is_mounted(layout.mount):
            subprocess.run(["fusermount3", "-u", layout.mount], capture_output=True)
        self._stop([p for p in procs if p.role == "mount"], echo)
        if is_mounted(layout.mount):
            force_unmount(layout.mount)
        self._stop([p for p in procs if p.role == "meta"], echo)
        self._stop([p for p in procs if p.role not in ("mount", "meta")], echo)

    def _stop(self, procs: list[Process], echo: Any, grace: float = 10.0) -> None:
        """SIGTERM each process group, wait up to ``grace`` seconds for all, then SIGKILL the rest."""
        running = {p.name: pid for p in procs if (pid := self.pid_of(p.name)) is not None}
        for pid in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while running and time.monotonic() < deadline:
            for name, pid in list(running.items()):
                if not process_exists(pid):
                    echo(f"stopped {name} (pid {pid})")
                    del running[name]
            time.sleep(0.05)
        for name, pid in running.items():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            echo(f"killed {name} (pid {pid}): it ignored SIGTERM for {grace:g}s")
        for proc in procs:
            self._pidfile(proc.name).unlink(missing_ok=True)
            self._startfile(proc.name).unlink(missing_ok=True)

    # ----------------------------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        from kvfs.fuse.mount import is_mounted

        config, layout = self._load()
        processes = []
        for proc in self.processes(layout):
            pid = self.pid_of(proc.name)
            alive = pid is not None and (is_mounted(proc.address) if proc.role == "mount" else _listening(proc.address))
            processes.append({"name": proc.name, "role": proc.role, "pid": pid, "address": proc.address, "alive": alive})
        report: dict[str, Any] = {"data": str(self.data), "processes": processes, "targets": [], "chains": []}
        try:
            cluster = trio.run(self._mgmtd_status, config)
        except KvfsError as exc:
            report["error"] = f"mgmtd unreachable: {exc.message}"
            return report
        addresses = {n.node_id: n.address for n in cluster.nodes}
        for chain in cluster.routing.chains:
            report["chains"].append({
                "chain_id": chain.chain_id, "version": chain.chain_version,
                "targets": [t.target_id for t in chain.targets],
            })
            for t in chain.targets:
                target = {
                    "target_id": t.target_id, "node_id": t.node_id, "host": addresses.get(t.node_id, "?"),
                    "chain_id": chain.chain_id, "state": t.state.value,
                }
                if t.target_id in cluster.resync:
                    target["resync_left"], target["resync_total"] = cluster.resync[t.target_id]
                report["targets"].append(target)
        return report

    @staticmethod
    async def _mgmtd_status(config: ClusterConfig) -> Any:
        from kvfs.craq.client import STATUS, MgmtdClient
        from kvfs.rpc import RpcClient
        from kvfs.wire import Empty

        async with RpcClient(config.resolved_token(), connect_timeout=1, call_timeout=3, retries=0) as rpc:
            return await MgmtdClient(rpc, config.mgmtd, rounds=1).call(STATUS, Empty())


def format_status(report: dict[str, Any]) -> str:
    """Human-readable tables for ``kvfs status``."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    out = StringIO()
    console = Console(file=out, width=120)
    table = Table(title=f"processes ({report['data']})")
    for column in ("name", "role", "pid", "address", "alive"):
        table.add_column(column)
    for p in report["processes"]:
        table.add_row(p["name"], p["role"], str(p["pid"] or "-"), p["address"], "yes" if p["alive"] else "NO")
    console.print(table)
    if "error" in report:
        console.print(report["error"])
        return out.getvalue()
    targets = Table(title="targets")
    for column in ("target", "node", "host", "chain", "state"):
        targets.add_column(column)
    for t in report["targets"]:
        state = t["state"]
        if "resync_left" in t:
            left, total = t["resync_left"], t["resync_total"]
            state += " (counting chunks)" if total < 0 else f" ({total - left}/{total} chunks copied)"
        targets.add_row(str(t["target_id"]), str(t["node_id"]), t["host"], str(t["chain_id"]), state)
    console.print(targets)
    chains = Table(title="chains")
    for column in ("chain", "version", "targets (chain order)"):
        chains.add_column(column)
    for c in report["chains"]:
        chains.add_row(str(c["chain_id"]), str(c["version"]), " -> ".join(map(str, c["targets"])))
    console.print(chains)
    return out.getvalue()


def status_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
