"""The ``kvfs`` command: one entry point for every server, the mount, the local cluster and admin tools.

Component imports happen inside each command so ``kvfs --help`` stays fast and a host that only runs chunk
servers never imports FUSE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from kvfs.config import ClusterConfig, load_config
from kvfs.errors import KvfsError


def _config_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--log-level", default="INFO", show_default=True, help="Logging level.")(fn)
    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        envvar="KVFS_CONFIG",
        help="Cluster config file (TOML); also $KVFS_CONFIG.",
    )(fn)


def _load(config_path: str | None) -> ClusterConfig:
    try:
        return load_config(config_path)
    except KvfsError as exc:
        raise click.ClickException(exc.message) from None


def _this_command() -> str:
    """How the user ran kvfs (``kvfs``, ``.venv/bin/kvfs``, ``python -m kvfs``), for the hints we print."""
    import os
    import shutil
    import sys

    def short(path: str) -> str:
        relative = os.path.relpath(path)
        return os.path.abspath(path) if relative.startswith("..") else relative

    argv0 = sys.argv[0]
    if argv0.endswith("__main__.py"):
        return f"{short(sys.executable)} -m kvfs"
    if shutil.which("kvfs") == os.path.abspath(argv0):
        return "kvfs"
    return short(argv0)


def _fail_cleanly(fn: Callable[[], Any]) -> Any:
    """Turn kvfs errors into a one-line message and a non-zero exit instead of a traceback."""
    try:
        return fn()
    except KvfsError as exc:
        raise click.ClickException(exc.message) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvfs")
def main() -> None:
    """kvfs: a distributed filesystem and KV-cache store for LLM serving."""


@main.command("meta")
@_config_option
@click.option("--listen", default="127.0.0.1:7200", show_default=True, help="RPC address to serve on.")
@click.option("--http", "http_address", default=None, help="host:port for /metrics and /health.")
@click.option("--kv-url", default=None, help="KV store URL (sqlite:///file or fdb:///cluster-file).")
@click.option("--mgmtd", "mgmtd", multiple=True, help="mgmtd address (repeatable), to free removed files' chunks.")
def meta_cmd(config_path: str | None, log_level: str, listen: str, http_address: str | None, kv_url: str | None,
             mgmtd: tuple[str, ...]) -> None:
    """Run a stateless metadata service."""
    from kvfs.meta.server import serve_meta

    config = _load(config_path)
    if mgmtd:
        config.mgmtd = list(mgmtd)
    _fail_cleanly(lambda: serve_meta(config, listen=listen, http=http_address, kv_url=kv_url, log_level=log_level))



@main.command("mgmtd")
@_config_option
@click.option("--listen", default="127.0.0.1:7100", show_default=True, help="RPC address to serve on.")
@click.option("--http", "http_address", default=None, help="host:port for /metrics and /health.")
@click.option("--kv-url", default=None, help="KV store URL (sqlite:///file or fdb:///cluster-file).")
def mgmtd_cmd(config_path: str | None, log_level: str, listen: str, http_address: str | None, kv_url: str | None) -> None:
    """Run a cluster manager (one of several; the lease holder is primary)."""
    from kvfs.craq.server import serve_mgmtd

    config = _load(config_path)
    _fail_cleanly(lambda: serve_mgmtd(config, listen=listen, http=http_address, kv_url=kv_url, log_level=log_level))


@main.command("chunkserver")
@_config_option
@click.option("--node-id", type=click.IntRange(1, 2**31), required=True, help="This server's node id (stable across restarts).")
@click.option("--listen", default="127.0.0.1:7300", show_default=True, help="RPC address to serve on.")
@click.option("--target", "targets", multiple=True, type=click.Path(file_okay=False), help="Storage target directory (repeatable).")
@click.option("--mgmtd", "mgmtd", multiple=True, help="mgmtd address (repeatable); overrides the config.")
@click.option("--http", "http_address", default=None, help="host:port for /metrics and /health.")
def chunkserver_cmd(config_path: str | None, log_level: str, node_id: int, listen: str, targets: tuple[str, ...],
                    mgmtd: tuple[str, ...], http_address: str | None) -> None:
    """Run a chunk server owning one or more storage targets."""
    from kvfs.chunkserver.server import serve_chunkserver

    config = _load(config_path)
    if mgmtd:
        config.mgmtd = list(mgmtd)
    _fail_cleanly(lambda: serve_chunkserver(config, node_id=node_id, listen=listen, targets=list(targets),
                                            http=http_address, log_level=log_level))


@main.command("mount")
@_config_option
@click.argument("mountpoint", type=click.Path(file_okay=False, exists=True))
@click.option("--read-ahead-kb", default=4096, show_default=True, help="Kernel readahead for the mount.")
@click.option("--max-background", type=click.IntRange(min=0), default=64, show_default=True,
              help="Asynchronous requests (readahead) the kernel keeps in flight to the mount (needs root; "
                   "0: the kernel's default, 12).")
@click.option("--attr-timeout", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds the kernel may keep a file's attributes without asking meta, while the change feed "
                   "is not followed.")
@click.option("--entry-timeout", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds the kernel may keep a name -> inode lookup without asking meta, while the change "
                   "feed is not followed.")
@click.option("--negative-timeout", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds the kernel may remember that a name does not exist, while the change feed is not "
                   "followed (0: never, feed or not).")
@click.option("--read-cache-mb", type=click.IntRange(min=0), default=256, show_default=True,
              help="MiB of recently read 64 KiB blocks kept for small reads (close-to-open coherent; 0: off).")
@click.option("--coherent-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds the kernel may keep entries and attributes while the mount follows meta's change "
                   "feed (0: do not follow it; the timeouts above then always apply).")
@click.option("--delegations/--no-delegations", default=True, show_default=True,
              help="Answer creates and removals in directories meta delegates to this mount without waiting for "
                   "meta (sent in batches within milliseconds; needs the change feed). --no-delegations: every "
                   "namespace change waits for meta.")
@click.option("--http", "http_address", default=None,
              help="host:port for /metrics and /health (port 0: any free one, logged).")
@click.option("--short-circuit/--no-short-circuit", default=None,
              help="Read chunks that have a replica on this host from the chunk server's files, checked against "
                   "their CRCs, instead of asking the server for the bytes  [default: on, unless "
                   "KVFS_SHORT_CIRCUIT=0]")
def mount_cmd(config_path: str | None, log_level: str, mountpoint: str, read_ahead_kb: int, max_background: int,
              attr_timeout: float, entry_timeout: float, negative_timeout: float, read_cache_mb: int,
              coherent_timeout: float, delegations: bool, http_address: str | None, short_circuit: bool | None) -> None:
    """Mount kvfs at MOUNTPOINT (runs in the foreground until unmounted or signalled).

    The mount follows meta's change feed: other clients' changes reach the kernel's caches within
    milliseconds, so entries and attributes are kept for --coherent-timeout. While the feed cannot be
    followed, the --entry/--attr-timeout values apply, and other clients' changes show after them."""
    from kvfs.chunkserver.shortcircuit import enabled_by_environment
    from kvfs.fuse.main import serve_mount

    config = _load(config_path)
    _fail_cleanly(lambda: serve_mount(config, mountpoint, log_level=log_level, http=http_address,
                                      read_ahead_kb=read_ahead_kb,
                                      max_background=max_background,
                                      attr_timeout=attr_timeout, entry_timeout=entry_timeout,
                                      negative_timeout=negative_timeout, read_cache=read_cache_mb << 20,
                                      coherent_timeout=coherent_timeout, delegations=delegations,
                                      short_circuit=enabled_by_environment() if short_circuit is None
                                      else short_circuit))


@main.command("up")
@click.option("--data", type=click.Path(file_okay=False), required=True, help="Directory for config, logs and data.")
@click.option("--mount", "mountpoint", required=True, help="Where to mount (created if missing).")
@click.option("--chunkservers", default=3, show_default=True, type=click.IntRange(1, 64))
@click.option("--replicas", default=3, show_default=True, type=click.IntRange(1, 16))
@click.option("--targets-per-server", default=1, show_default=True, type=click.IntRange(1, 16),
              help="Storage targets per chunk server; chains = servers x targets / replicas.")
@click.option("--fsync/--no-fsync", default=True, show_default=True,
              help="Chunk servers flush to disk: at each client fsync and every few seconds, or every write with "
                   "--write-through (--no-fsync: never; a power loss can lose any acknowledged write).")
@click.option("--write-through", is_flag=True,
              help="Flush every write before acknowledging it (default: write-back, durable at fsync).")
@click.option("--kv-dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the KV store (mgmtd's and meta's SQLite database), e.g. on another disk than the "
                   "chunk data (default: --data). Set when the cluster is created.")
@click.option("--memory-mb", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Memory (PSS) the whole cluster may use while it moves data: the chunk servers' held writes and "
                   "buffer pools get what the other processes leave, in equal shares ([chunkserver] memory_bytes). "
                   "Set when the cluster is created.")
def up_cmd(data: str, mountpoint: str, chunkservers: int, replicas: int, targets_per_server: int,
           fsync: bool, write_through: bool, kv_dir: str | None, memory_mb: int) -> None:
    """Start (or restart what is not running of) a local cluster and mount it."""
    from pathlib import Path

    from kvfs.localcluster import LocalCluster

    cluster = LocalCluster(Path(data))
    layout = _fail_cleanly(lambda: cluster.up(Path(mountpoint), chunkservers, replicas, echo=click.echo,
                                              targets_per_server=targets_per_server, fsync=fsync,
                                              write_through=write_through,
                                              kv_dir=Path(kv_dir) if kv_dir is not None else None,
                                              memory=memory_mb << 20))
    click.echo(f"kvfs is up: {layout.mount} ({len(layout.chunkservers)} chunk servers, {layout.replicas} replicas)")
    kvfs = _this_command()
    click.echo(f"  client config: {cluster.client_config_path}")
    click.echo(f"  status:        {kvfs} status --data {data}")
    click.echo(f"  stop:          {kvfs} down --data {data}")


@main.command("down")
@click.option("--data", type=click.Path(file_okay=False), required=True)
def down_cmd(data: str) -> None:
    """Unmount and stop everything kvfs up started (data is kept)."""
    from pathlib import Path

    from kvfs.localcluster import LocalCluster

    _fail_cleanly(lambda: LocalCluster(Path(data)).down(echo=click.echo))


@main.command("status")
@click.option("--data", type=click.Path(file_okay=False), required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status_cmd(data: str, as_json: bool) -> None:
    """Show each process, target and chain of a local cluster."""
    from pathlib import Path

    from kvfs.localcluster import LocalCluster, format_status, status_json

    report = _fail_cleanly(lambda: LocalCluster(Path(data)).status())
    click.echo(status_json(report) if as_json else format_status(report), nl=not as_json or True)
    if any(not p["alive"] for p in report["processes"]) or "error" in report:
        raise SystemExit(1)


@main.group("admin")
def admin() -> None:
    """Operate a running cluster: status, chain tables, replica checks."""


@admin.command("status")
@_config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def admin_status(config_path: str | None, log_level: str, as_json: bool) -> None:
    """Nodes, targets and chains as the primary mgmtd sees them."""
    import msgspec

    from kvfs import admin as ops

    status = _fail_cleanly(lambda: ops.run(ops.cluster_status, _load(config_path)))
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(status)).decode())
        return
    click.echo(f"primary mgmtd: {status.primary}")
    for node in status.nodes:
        state = "alive" if node.alive else f"DEAD ({node.seconds_since_heartbeat:.0f}s since heartbeat)"
        click.echo(f"node {node.node_id} {node.address} {state} targets={node.targets}")
    for chain in status.routing.chains:
        members = " -> ".join(f"{t.target_id}({t.state.value})" for t in chain.targets)
        recovering = " (recovering: serves once it pulled newer chunks from the others)" if chain.recovering else ""
        click.echo(f"chain {chain.chain_id} v{chain.chain_version}: {members}{recovering}")
    for target, (left, total) in sorted(status.resync.items()):
        click.echo(f"resync of target {target}: " + ("counting chunks" if total < 0 else f"{total - left}/{total} chunks copied"))


@admin.command("create-chains")
@_config_option
@click.option("--replicas", default=3, show_default=True, type=click.IntRange(1, 16))
def admin_create_chains(config_path: str | None, log_level: str, replicas: int) -> None:
    """Group every registered target not yet in a chain into chains of REPLICAS targets on distinct nodes."""
    from kvfs import admin as ops

    created = _fail_cleanly(lambda: ops.run(ops.create_chains, _load(config_path), replicas))
    click.echo(f"created chains {created}")


@admin.command("check-file")
@_config_option
@click.argument("path")
def admin_check_file(config_path: str | None, log_level: str, path: str) -> None:
    """Compare every replica of every chunk of PATH (a path inside the filesystem, e.g. /data/x)."""
    from rich.progress import Progress

    from kvfs import admin as ops

    config = _load(config_path)
    with Progress(transient=True) as progress:
        task = progress.add_task("checking chunks", total=None)
        attr, chunks = _fail_cleanly(lambda: ops.run(
            ops.check_file, config, path, lambda done, total: progress.update(task, completed=done, total=total)))
    bad = [c for c in chunks if not c.consistent]
    for c in chunks:
        replicas = "  ".join(f"{r.target_id}:{r.state}:v{r.version}/{r.length}B/crc{r.crc:08x}{'!' + r.error if r.error else ''}"
                             for r in c.replicas)
        click.echo(f"chunk {c.index} chain {c.chain_id} {'ok' if c.consistent else 'MISMATCH'}  {replicas}")
    click.echo(f"inode {attr.ino}, {attr.size} bytes, {len(chunks)} chunks, {len(bad)} inconsistent")
    if bad:
        raise SystemExit(1)
