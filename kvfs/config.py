"""Configuration: one TOML file per cluster, typed and validated by msgspec.

Every process reads the same file (sections it does not use are ignored), so one file describes a whole
cluster. Command-line flags override file values; the cluster token may come from the ``KVFS_TOKEN``
environment variable or a ``token_file`` so it need not sit in a world-readable config.

Example::

    token_file = "/etc/kvfs/token"
    kv_url = "sqlite:///var/lib/kvfs/meta.db"     # or "fdb:///etc/foundationdb/fdb.cluster"
    mgmtd = ["10.0.0.1:7100", "10.0.0.2:7100"]
    meta = ["10.0.0.1:7200", "10.0.0.2:7200"]
    transport = "auto"                             # bulk data: "auto" | "tcp" | "rdma"; also $KVFS_TRANSPORT
    shared_memory = true                           # same-host chunk writes through shared memory; also $KVFS_SHM

    [timeouts]
    heartbeat_interval = 1.0

    [chunkserver]
    targets = ["/srv/kvfs/disk0", "/srv/kvfs/disk1"]
"""

from __future__ import annotations

import os
import secrets
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomli_w

from kvfs.errors import KvfsError


class Timeouts(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Failure-detection and call timing; tests shrink these to make failover fast."""

    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    lease: float = 5.0
    #: How long mgmtd waits for the other replicas of a chain whose last serving target came back after it may have
    #: lost unflushed writes, before it lets that target serve without them (losing what only they held).
    recovery_wait: float = 600.0
    call: float = 30.0
    connect: float = 5.0


_DEFAULT_HOLD = 384 << 20


class ChunkServerSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    targets: list[str] = []
    #: False: never flush to disk (tests, scratch clusters); nothing survives a power loss.
    fsync: bool = True
    #: True: flush every write before acknowledging it. False (write-back): acknowledge once written, unflushed, and
    #: flush at a client's fsync and every ``sync_interval`` seconds; a power loss loses at most the writes since.
    write_through: bool = False
    sync_interval: float = 5.0
    #: Write chunk data, and read large ranges, around the page cache (O_DIRECT) where the file system allows.
    direct_io: bool = True
    #: Write-back only: bytes of whole-chunk writes a chunk server keeps in memory until the next sync instead of
    #: writing them at once (split across its targets), so a chunk rewritten meanwhile reaches the disk once.
    #: None: 384 MiB or a 32nd of the host's memory, whichever is less; 0: write every chunk at once.
    hold_bytes: int | None = None
    #: The memory budget of one chunk server's data buffers: held writes (half of it, unless ``hold_bytes`` says
    #: otherwise) and the pools that received and read chunks land in (three quarters of it for shared memory,
    #: which same-host writes and held writes use, a quarter for reads and other hosts' writes). None: no budget
    #: (pools of 512 and 256 MiB, each grown by ``hold_bytes``). ``kvfs up`` sets it from ``--memory-mb``.
    memory_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    capacity_bytes: int | None = None
    #: Bytes of each target's file system that chunk data leaves free, for what shares the disk (the KV store, logs):
    #: past it, writes fail with ENOSPC while metadata, reads and deletes go on. None: 256 MiB, or a tenth of a
    #: file system smaller than 2.5 GiB.
    reserve_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def resolved_hold_bytes(self) -> int:
        """``hold_bytes``, its default worked out for this host; 0 without write-back (nothing waits for a sync)."""
        if self.write_through or not self.fsync:
            return 0
        if self.hold_bytes is not None:
            if self.hold_bytes < 0:
                raise KvfsError(f"[chunkserver] hold_bytes must be 0 or more, not {self.hold_bytes}")
            return self.hold_bytes
        hold = min(_DEFAULT_HOLD, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 32)
        return hold if self.memory_bytes is None else min(hold, self.memory_bytes // 2)

    def pool_capacities(self, hold: int, shared: int, received: int) -> tuple[int, int]:
        """(shared-memory pool, received pool) capacities for a chunk server whose pools default to ``shared`` and
        ``received`` bytes and that holds up to ``hold`` bytes of writes: within ``memory_bytes`` where set, else
        the defaults grown by ``hold`` (held writes keep their buffers; the pools make room beside them)."""
        if self.memory_bytes is None:
            return shared + hold, received + hold
        return self.memory_bytes - self.memory_bytes // 4, self.memory_bytes // 4


class MetaSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    gc_interval: float = 5.0
    #: Seconds a client (mount, kvclient) may go without renewing before meta ends its write sessions, so the
    #: files a crashed client held open can be collected. Clients learn it from meta and renew every quarter.
    client_lease: float = 60.0


class ClusterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    token: str | None = None
    token_file: str | None = None
    kv_url: str = "sqlite:///var/lib/kvfs/meta.db"
    mgmtd: list[str] = []
    meta: list[str] = []
    #: How bulk data moves: ``auto`` (RDMA where both ends can, else TCP), ``tcp``, or ``rdma`` (required:
    #: start-up fails without a device). ``$KVFS_TRANSPORT`` overrides it.
    transport: Literal["auto", "tcp", "rdma"] = "auto"
    #: Chunk writes between processes of one host (mount, chunk servers) go through shared memory instead of
    #: loopback TCP (:mod:`kvfs.transport.shm`). ``$KVFS_SHM`` (``0``/``1``) overrides it.
    shared_memory: bool = True
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    chunkserver: ChunkServerSection = msgspec.field(default_factory=ChunkServerSection)
    meta_service: MetaSection = msgspec.field(default_factory=MetaSection, name="meta-service")

    def resolved_token(self) -> str:
        """The cluster token: ``KVFS_TOKEN``, then ``token``, then the contents of ``token_file``."""
        token = os.environ.get("KVFS_TOKEN") or self.token
        if not token and self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise KvfsError(f"cannot read token_file {self.token_file}: {exc.strerror}") from None
        if not token:
            raise KvfsError("no cluster token: set KVFS_TOKEN, or token/token_file in the config file")
        return token

    def resolved_shared_memory(self) -> bool:
        """Whether same-host bulk data may go through shared memory: ``KVFS_SHM``, then ``shared_memory``."""
        from kvfs.transport import shm

        return shm.resolve_enabled(None, default=self.shared_memory)

    def resolved_transport(self) -> str:
        """The transport mode: ``KVFS_TRANSPORT``, then ``transport``. Checked here, at start-up: a bad spelling,
        or ``rdma`` on a host that cannot do RDMA, is a KvfsError saying why."""
        from kvfs.transport import link

        env = os.environ.get(link.ENV_TRANSPORT)
        mode = link.resolve_mode(env, source=link.ENV_TRANSPORT) if env else link.resolve_mode(self.transport)
        if mode.value == "rdma":
            link.require_available(mode, link.default_factory().detect())
        return mode.value


def load_config(path: str | os.PathLike[str] | None) -> ClusterConfig:
    """Read and validate a config file; a missing path gives the defaults."""
    if path is None:
        return ClusterConfig()
    try:
        raw = tomllib.loads(Path(path).read_text())
        return msgspec.convert(raw, ClusterConfig)
    except OSError as exc:
        raise KvfsError(f"cannot read config {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise KvfsError(f"invalid config {path}: {exc}") from None


def save_config(config: ClusterConfig, path: str | os.PathLike[str], *, private: bool = True) -> None:
    """Write ``config`` as TOML; ``private`` keeps it readable by the owner only, since it may hold the token."""
    data = _without_none(msgspec.to_builtins(config))
    target = Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(tomli_w.dumps(data))
    if private:
        tmp.chmod(0o600)
    tmp.replace(target)


def _without_none(value: Any) -> Any:
    """TOML has no null: leave unset options out so they take their defaults when read back."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def new_token() -> str:
    return secrets.token_urlsafe(32)
