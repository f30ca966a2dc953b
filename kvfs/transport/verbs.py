"""The pyverbs side of the RDMA transport: device, protection domain, RC queue pair, completions.

This is the only module that imports ``pyverbs``, and only inside functions (:func:`load_pyverbs`), so kvfs
imports and runs on hosts without an RDMA stack. Everything that can be decided without a device is a pure
function here and tested everywhere: building work requests (:func:`build_rdma_wr`), the RTR/RTS
attributes from a handshake (:func:`plan_connect`), and the mapping of work-completion statuses and verbs
exceptions onto the kvfs error family (:func:`wc_error`, :func:`verbs_error`).

Completions: pyverbs exposes neither the completion channel's file descriptor nor a GIL-releasing
``ibv_get_cq_event``, so a trio task cannot ``wait_readable`` on it and blocking on it in a thread would stall
the whole interpreter. Instead one poller thread per CQ polls ``ibv_poll_cq`` (non-blocking, microseconds)
while work requests are outstanding, backing off from spinning to short sleeps, and hands completions to
trio with ``TrioToken.run_sync_soon``; it parks on a ``threading.Event`` when nothing is in flight.
"""

from __future__ import annotations

import enum
import errno
import itertools
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import trio

from kvfs.errors import ConnectionLost, KvfsError, RpcTimeout
from kvfs.transport.buffers import MAX_RDMA_MESSAGE, BufferPool, LocalSge, RemoteBuffer
from kvfs.transport.direct import DmaBuf
from kvfs.transport.errors import RdmaError, RdmaUnavailable
from kvfs.transport.handshake import RdmaOffer, negotiated_mtu
from kvfs.transport.select import ActivePort, RdmaAvailability

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- stable verbs ABI values
# (from <infiniband/verbs.h>; duplicated so the pure functions work without pyverbs, checked against
# pyverbs.enums by the device tests)

IBV_WR_RDMA_WRITE = 0
IBV_WR_RDMA_READ = 4
IBV_SEND_SIGNALED = 2
IBV_PORT_ACTIVE = 4
MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
MTU_BYTES = {v: k for k, v in MTU_ENUM.items()}
LINK_LAYERS = {0: "unknown", 1: "infiniband", 2: "ethernet"}

WC_STATUS_NAMES = {
    0: "SUCCESS", 1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 3: "LOC_EEC_OP_ERR", 4: "LOC_PROT_ERR",
    5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR", 7: "BAD_RESP_ERR", 8: "LOC_ACCESS_ERR", 9: "REM_INV_REQ_ERR",
    10: "REM_ACCESS_ERR", 11: "REM_OP_ERR", 12: "RETRY_EXC_ERR", 13: "RNR_RETRY_EXC_ERR",
    14: "LOC_RDD_VIOL_ERR", 15: "REM_INV_RD_REQ_ERR", 16: "REM_ABORT_ERR", 17: "INV_EECN_ERR",
    18: "INV_EEC_STATE_ERR", 19: "FATAL_ERR", 20: "RESP_TIMEOUT_ERR", 21: "GENERAL_ERR", 22: "TM_ERR",
}  # fmt: skip

#: Work-completion status -> (exception class, errno). The queue pair is in the ERROR state after any
#: failed completion, so every one of them ends RDMA on this connection; the errno says what to tell the user.
_WC_ERRORS: dict[int, tuple[type[KvfsError], int]] = {
    1: (RdmaError, errno.EMSGSIZE),  # LOC_LEN_ERR: local buffer shorter than the message
    4: (RdmaError, errno.EFAULT),  # LOC_PROT_ERR: lkey does not cover the SGE
    5: (ConnectionLost, errno.ECONNRESET),  # WR_FLUSH_ERR: QP went to ERROR, outstanding WRs flushed
    8: (RdmaError, errno.EFAULT),  # LOC_ACCESS_ERR
    9: (RdmaError, errno.EINVAL),  # REM_INV_REQ_ERR: e.g. length beyond the peer's limit
    10: (RdmaError, errno.EACCES),  # REM_ACCESS_ERR: bad rkey / range outside the peer's MR / no permission
    11: (RdmaError, errno.EREMOTEIO),  # REM_OP_ERR
    12: (ConnectionLost, errno.ETIMEDOUT),  # RETRY_EXC_ERR: peer unreachable (transport retries exhausted)
    13: (ConnectionLost, errno.ETIMEDOUT),  # RNR_RETRY_EXC_ERR
    20: (RpcTimeout, errno.ETIMEDOUT),  # RESP_TIMEOUT_ERR
    19: (RdmaError, errno.EIO),  # FATAL_ERR
}


def wc_error(status: int, vendor_err: int = 0, wr_id: int = 0, what: str = "RDMA operation") -> KvfsError | None:
    """The kvfs exception for a work completion, or None when it succeeded."""
    if status == 0:
        return None
    cls, code = _WC_ERRORS.get(status, (RdmaError, errno.EIO))
    name = WC_STATUS_NAMES.get(status, f"status {status}")
    return cls(f"{what} (wr_id {wr_id}) failed: IBV_WC_{name}, vendor error {vendor_err:#x}", code)


def verbs_error(exc: BaseException, what: str) -> KvfsError:
    """Map a pyverbs exception (PyverbsRDMAError carries the errno of the failed verb) to a kvfs error."""
    if isinstance(exc, KvfsError):
        return exc
    code = getattr(exc, "error_code", -1)
    if not isinstance(code, int) or code <= 0:
        code = errno.EIO
    if code in (errno.ENODEV, errno.ENXIO):
        return RdmaUnavailable(f"{what}: {exc}", code)
    return RdmaError(f"{what}: {exc}", code)


# -------------------------------------------------------------------------------------------- loading


def load_pyverbs() -> SimpleNamespace:
    """Import the pyverbs modules this transport uses; raises ImportError (or whatever a broken install raises)."""
    import pyverbs.addr
    import pyverbs.cq
    import pyverbs.device
    import pyverbs.enums
    import pyverbs.mr
    import pyverbs.pd
    import pyverbs.qp
    import pyverbs.wr

    return SimpleNamespace(
        device=pyverbs.device,
        pd=pyverbs.pd,
        mr=pyverbs.mr,
        cq=pyverbs.cq,
        qp=pyverbs.qp,
        wr=pyverbs.wr,
        addr=pyverbs.addr,
        enums=pyverbs.enums,
    )


def _name(dev: Any) -> str:
    name = dev.name
    return name.decode() if isinstance(name, bytes) else str(name)


def probe_ports(pv: SimpleNamespace) -> tuple[list[str], list[ActivePort], list[str]]:
    """(device names, active ports, notes on ports that are not usable). ``get_device_list`` may raise."""
    devices = [_name(d) for d in pv.device.get_device_list()]
    ports: list[ActivePort] = []
    notes: list[str] = []
    for name in devices:
        try:
            ctx = pv.device.Context(name=name)
        except Exception as exc:
            notes.append(f"{name}: cannot open ({exc})")
            continue
        try:
            count = ctx.query_device().phys_port_cnt
            for port in range(1, count + 1):
                attr = ctx.query_port(port)
                if attr.state != IBV_PORT_ACTIVE:
                    notes.append(f"{name} port {port}: state {attr.state}, not ACTIVE")
                    continue
                mtu = MTU_BYTES.get(int(attr.active_mtu), 1024)
                layer = LINK_LAYERS.get(int(attr.link_layer), "unknown")
                ports.append(ActivePort(name, port, int(attr.lid), layer, mtu))
        except Exception as exc:
            notes.append(f"{name}: query failed ({exc})")
        finally:
            ctx.close()
    return devices, ports, notes


def detect_rdma() -> RdmaAvailability:
    """Probe the local RDMA devices; never raises: a missing or broken ``pyverbs``, a host without an RDMA stack
    (where ``get_device_list`` raises rather than returning ``[]``), no devices and no active port each become
    the ``reason`` it is unavailable."""
    try:
        pv = load_pyverbs()
    except Exception as exc:  # ImportError, or a broken install that fails while loading its extension
        return RdmaAvailability(False, f"pyverbs is not importable ({type(exc).__name__}: {exc})")
    try:
        devices, ports, notes = probe_ports(pv)
    except Exception as exc:
        # no RDMA kernel stack: get_device_list raises PyverbsRDMAError("Failed to get devices list")
        return RdmaAvailability(False, f"cannot list RDMA devices ({type(exc).__name__}: {exc})")
    if not devices:
        return RdmaAvailability(False, "no RDMA devices found")
    if not ports:
        detail = "; ".join(notes) if notes else "no port reports ACTIVE"
        return RdmaAvailability(False, f"no active RDMA port on {', '.join(devices)} ({detail})", devices)
    where = ", ".join(f"{p.device}:{p.port}" for p in ports)
    return RdmaAvailability(True, f"active RDMA port(s): {where}", devices, ports)


# ----------------------------------------------------------------------------------- work requests


class WrOp(enum.Enum):
    READ = "read"  # RDMA READ: remote -> local SGEs
    WRITE = "write"  # RDMA WRITE: local SGEs -> remote

    @property
    def opcode(self) -> int:
        return IBV_WR_RDMA_READ if self is WrOp.READ else IBV_WR_RDMA_WRITE


@dataclass(frozen=True, slots=True)
class RdmaWorkRequest:
    """A plain description of one RDMA READ/WRITE work request; :func:`to_pyverbs_wr` makes the real one."""

    wr_id: int
    op: WrOp
    opcode: int
    sges: tuple[LocalSge, ...]
    remote_addr: int
    rkey: int
    length: int
    send_flags: int = IBV_SEND_SIGNALED


def build_rdma_wr(
    op: WrOp | str,
    local_sges: Sequence[LocalSge],
    remote: RemoteBuffer,
    wr_id: int,
    *,
    max_sge: int = 16,
    signaled: bool = True,
) -> RdmaWorkRequest:
    """Validate and describe an RDMA READ/WRITE of ``remote`` from/into ``local_sges`` (which must add up to it)."""
    op = WrOp(op)
    sges = tuple(local_sges)
    if not 0 <= wr_id < 1 << 64:
        raise ValueError(f"wr_id {wr_id} does not fit in 64 bits")
    if not sges:
        raise ValueError("an RDMA work request needs at least one local scatter/gather element")
    if len(sges) > max_sge:
        raise ValueError(f"{len(sges)} scatter/gather elements exceed the queue pair's limit of {max_sge}")
    for sge in sges:
        if sge.length <= 0 or sge.length > MAX_RDMA_MESSAGE:
            raise ValueError(f"scatter/gather element of {sge.length} bytes")
        if not 0 < sge.addr < 1 << 64 or sge.addr + sge.length > 1 << 64:
            raise ValueError(f"scatter/gather element address {sge.addr:#x} is not a user address")
        if not 0 <= sge.lkey < 1 << 32:
            raise ValueError(f"lkey {sge.lkey} does not fit in 32 bits")
    total = sum(s.length for s in sges)
    if total != remote.length:
        raise ValueError(f"local elements hold {total} bytes but the remote buffer is {remote.length}")
    if total > MAX_RDMA_MESSAGE:
        raise ValueError(f"{total} bytes exceed one RDMA message ({MAX_RDMA_MESSAGE})")
    flags = IBV_SEND_SIGNALED if signaled else 0
    return RdmaWorkRequest(wr_id, op, op.opcode, sges, remote.addr, remote.rkey, total, flags)


def to_pyverbs_wr(desc: RdmaWorkRequest, pv: SimpleNamespace | None = None) -> Any:
    """The ``pyverbs.wr.SendWR`` for a description (chained SGEs, ``set_wr_rdma(rkey, addr)``)."""
    pv = pv or load_pyverbs()
    sg = [pv.wr.SGE(s.addr, s.length, s.lkey) for s in desc.sges]
    wr = pv.wr.SendWR(wr_id=desc.wr_id, opcode=desc.opcode, num_sge=len(sg), sg=sg, send_flags=desc.send_flags)
    wr.set_wr_rdma(desc.rkey, desc.remote_addr)
    return wr


# ------------------------------------------------------------------------------- connecting a QP


@dataclass(frozen=True, slots=True)
class ConnectPlan:
    """The INIT->RTR->RTS attributes for connecting a local RC QP to a peer's (pure, from two offers)."""

    port_num: int
    path_mtu: int  # verbs enum
    dest_qp_num: int
    rq_psn: int  # the peer's send PSN: what we expect to receive first
    sq_psn: int  # ours
    dlid: int
    use_grh: bool
    dgid: str  # "xxxx:xxxx:...", the textual form pyverbs' GID takes
    sgid_index: int
    max_dest_rd_atomic: int  # RDMA READs the peer may have outstanding against us
    max_rd_atomic: int  # RDMA READs we may have outstanding against the peer
    timeout: int = 14  # 4.096 us * 2^14 ~ 67 ms per retry
    retry_cnt: int = 7
    rnr_retry: int = 7
    min_rnr_timer: int = 12


def gid_text(gid: bytes) -> str:
    if len(gid) != 16:
        raise ValueError("a GID is 16 bytes")
    h = gid.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def gid_bytes(text: str) -> bytes:
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"GID {text!r} is not 16 bytes")
    return raw


def plan_connect(local: RdmaOffer, peer: RdmaOffer, *, max_rd_atomic: int | None = None) -> ConnectPlan:
    if local.uses_grh != peer.uses_grh:
        raise RdmaUnavailable("one end addresses by GID (RoCE/routed) and the other by LID only", errno.EOPNOTSUPP)
    if not local.uses_grh and peer.lid == 0:
        raise RdmaUnavailable("the peer has neither a LID nor a GID to reach it by", errno.EHOSTUNREACH)
    ours = local.max_rd_atomic if max_rd_atomic is None else max_rd_atomic
    return ConnectPlan(
        port_num=local.port,
        path_mtu=MTU_ENUM[negotiated_mtu(local, peer)],
        dest_qp_num=peer.qp_num,
        rq_psn=peer.psn,
        sq_psn=local.psn,
        dlid=peer.lid,
        use_grh=peer.uses_grh,
        dgid=gid_text(peer.gid),
        sgid_index=local.gid_index,
        max_dest_rd_atomic=local.max_rd_atomic,
        max_rd_atomic=min(ours, peer.max_rd_atomic),
    )


# ----------------------------------------------------------------------------------- device objects


def access_flags(pv: SimpleNamespace) -> int:
    e = pv.enums
    return int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE)


class RdmaDevice:
    """An opened device port: context, protection domain, and memory registration for :class:`BufferPool`."""

    def __init__(self, name: str, port: int = 1, gid_index: int = 0) -> None:
        try:
            pv = load_pyverbs()
        except Exception as exc:
            raise RdmaUnavailable(f"pyverbs is not importable: {exc}") from None
        self.pv = pv
        self.name = name
        self.port = port
        self.gid_index = gid_index
        try:
            self.ctx = pv.device.Context(name=name)
        except Exception as exc:  # no such device, or no RDMA stack at all: this host cannot do RDMA
            code = getattr(exc, "error_code", -1)
            code = code if isinstance(code, int) and code > 0 else errno.ENODEV
            raise RdmaUnavailable(f"opening RDMA device {name}: {exc}", code) from None
        try:
            self.device_attr = self.ctx.query_device()
            self.port_attr = self.ctx.query_port(port)
            if self.port_attr.state != IBV_PORT_ACTIVE:
                raise RdmaUnavailable(f"{name} port {port} is not ACTIVE (state {self.port_attr.state})")
            self.mtu = MTU_BYTES.get(int(self.port_attr.active_mtu), 1024)
            self.lid = int(self.port_attr.lid)
            ethernet = int(self.port_attr.link_layer) == 2
            self.gid = gid_bytes(self.ctx.query_gid(port, gid_index).gid) if ethernet else bytes(16)
            self.pd = pv.pd.PD(self.ctx)
        except BaseException as exc:
            self.ctx.close()
            if isinstance(exc, Exception):
                raise verbs_error(exc, f"setting up RDMA device {name} port {port}") from None
            raise
        self.max_sge = int(min(self.device_attr.max_sge, 16))
        self.max_rd_atomic = int(max(1, min(self.device_attr.max_qp_rd_atom, 16)))

    def register(self, view: memoryview, addr: int) -> Any:
        """``BufferPool``'s registration hook: an MR over caller-owned memory with remote read/write access."""
        try:
            return self.pv.mr.MR(self.pd, view.nbytes, access_flags(self.pv), address=addr)
        except Exception as exc:
            raise verbs_error(exc, f"registering {view.nbytes} bytes with {self.name}") from None

    def register_direct(self, addr: int, length: int, dmabuf: DmaBuf | None) -> Any:
        """An MR over a caller's GPU memory (GPUDirect RDMA; :mod:`kvfs.transport.direct`). With a dma-buf:
        ``mlx5dv_reg_dmabuf_mr`` (pyverbs' generic ``DmaBufMR`` only takes buffers it allocates itself, so the
        mlx5 provider's class is the one that takes a CUDA-exported fd), its iova the GPU address so descriptors
        name GPU addresses as they do host ones. Without one: ``ibv_reg_mr`` on the device address, which the
        kernel resolves only through a peer-memory client (``nvidia-peermem``); elsewhere it fails with EFAULT."""
        access = access_flags(self.pv)
        try:
            if dmabuf is None:
                return self.pv.mr.MR(self.pd, length, access, address=addr)
            from pyverbs.providers.mlx5.mlx5dv_dmabuf import Mlx5DmaBufMR

            return Mlx5DmaBufMR(self.pd, dmabuf.offset, length, iova=addr, fd=dmabuf.fd, access=access)
        except Exception as exc:
            how = "peer memory" if dmabuf is None else "a dma-buf"
            raise verbs_error(exc, f"registering {length} bytes of GPU memory as {how} with {self.name}") from None

    def buffer_pool(self, **kwargs: Any) -> BufferPool:
        return BufferPool(self.register, **kwargs)

    def close(self) -> None:
        self.ctx.close()  # closes PD, MRs, CQs and QPs created under it


class CompletionPoller:
    """Delivers a CQ's completions to the trio tasks waiting on their ``wr_id``s (see the module docstring)."""

    def __init__(
        self, cq: Any, *, spin_s: float = 50e-6, max_sleep_s: float = 1e-3, completion_timeout_s: float = 30.0
    ) -> None:
        self._cq = cq
        self._completion_timeout_s = completion_timeout_s
        self._spin_s = spin_s
        self._max_sleep_s = max_sleep_s
        self._waiters: dict[int, list[Any]] = {}  # wr_id -> [event, status, vendor_err, byte_len]
        self._work = threading.Event()
        self._stop = False
        self._failed: KvfsError | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None

    def expect(self, wr_id: int) -> trio.Event:
        """Register interest in ``wr_id`` before posting it (a fast completion must find its waiter)."""
        if self._failed is not None:
            raise self._failed
        if wr_id in self._waiters:
            raise ValueError(f"wr_id {wr_id} is already in flight")
        if self._thread is None:
            self._token = trio.lowlevel.current_trio_token()
            self._thread = threading.Thread(target=self._run, name="kvfs-rdma-cq", daemon=True)
            self._thread.start()
        event = trio.Event()
        self._waiters[wr_id] = [event, None, 0, 0]
        self._work.set()
        return event

    def forget(self, wr_id: int) -> None:
        """Drop a waiter whose work request was never posted."""
        self._waiters.pop(wr_id, None)

    async def wait(self, wr_id: int, event: trio.Event, what: str) -> int:
        """Wait for ``wr_id``'s completion and return its byte count.

        Shielded from cancellation: the NIC keeps reading or writing the buffers until the completion
        arrives (the QP's retry timeout bounds that, and a QP in ERROR flushes every outstanding request), so
        the caller must not reuse them before. A pending cancellation is delivered at the caller's next
        checkpoint. Should no completion come within ``completion_timeout_s`` (a wedged device), the poller is
        failed for good: its QP must be torn down before its buffers are trusted again.
        """
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self._completion_timeout_s):
                await event.wait()
        if not event.is_set():
            self._fail_all(RdmaError(f"{what} (wr_id {wr_id}): no completion after {self._completion_timeout_s:g}s",
                                     errno.ETIMEDOUT))
        slot = self._waiters.pop(wr_id)
        status, vendor_err, byte_len = slot[1], slot[2], slot[3]
        if isinstance(status, KvfsError):
            raise status
        error = wc_error(status, vendor_err, wr_id, what)
        if error is not None:
            raise error
        return byte_len

    def _deliver(self, completions: list[tuple[int, int, int, int]]) -> None:  # in the trio thread
        for wr_id, status, vendor_err, byte_len in completions:
            slot = self._waiters.get(wr_id)
            if slot is None:
                log.warning("completion for unknown wr_id %d (status %d)", wr_id, status)
                continue
            slot[1:] = [status, vendor_err, byte_len]
            slot[0].set()

    def _fail_all(self, error: KvfsError) -> None:  # in the trio thread
        self._failed = error
        for slot in self._waiters.values():
            if not slot[0].is_set():
                slot[1] = error
                slot[0].set()

    def _run(self) -> None:
        assert self._token is not None
        idle_since = time.monotonic()
        sleep = 0.0
        try:
            while not self._stop:
                if not self._waiters:
                    self._work.wait(0.1)
                    self._work.clear()
                    idle_since = time.monotonic()
                    sleep = 0.0
                    continue
                _, wcs = self._cq.poll(16)
                if wcs:
                    batch = [(int(w.wr_id), int(w.status), int(w.vendor_err), int(w.byte_len)) for w in wcs]
                    self._token.run_sync_soon(self._deliver, batch)
                    idle_since = time.monotonic()
                    sleep = 0.0
                elif time.monotonic() - idle_since > self._spin_s:
                    sleep = min(self._max_sleep_s, max(sleep * 2, 10e-6))
                    time.sleep(sleep)
        except trio.RunFinishedError:
            pass
        except Exception as exc:
            error = verbs_error(exc, "polling the completion queue")
            try:
                self._token.run_sync_soon(self._fail_all, error)
            except trio.RunFinishedError:
                pass

    def close(self) -> None:
        self._stop = True
        self._work.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)


@dataclass(slots=True)
class RdmaQueuePair:
    """An RC queue pair on a device, its CQ and poller; ``offer()`` -> handshake -> ``connect(peer)``."""

    device: RdmaDevice
    depth: int = 256
    psn: int = field(default_factory=lambda: random.getrandbits(24))
    cq: Any = None
    qp: Any = None
    poller: CompletionPoller | None = None
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    connected: bool = False

    def __post_init__(self) -> None:
        pv, dev = self.device.pv, self.device
        try:
            self.cq = pv.cq.CQ(dev.ctx, self.depth, None, None, 0)
            cap = pv.qp.QPCap(max_send_wr=self.depth, max_recv_wr=1, max_send_sge=dev.max_sge, max_recv_sge=1)
            init = pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
            attr = pv.qp.QPAttr(port_num=dev.port)
            attr.qp_access_flags = access_flags(pv)
            self.qp = pv.qp.QP(dev.pd, init, attr)  # RC + attr: returned in INIT
        except Exception as exc:
            raise verbs_error(exc, f"creating an RC queue pair on {dev.name}") from None
        self.poller = CompletionPoller(self.cq)

    def offer(self) -> RdmaOffer:
        dev = self.device
        return RdmaOffer(
            device=dev.name, port=dev.port, lid=dev.lid, gid=dev.gid, gid_index=dev.gid_index,
            qp_num=int(self.qp.qp_num), psn=self.psn, mtu=dev.mtu, max_rd_atomic=dev.max_rd_atomic,
        )  # fmt: skip

    def connect(self, peer: RdmaOffer) -> None:
        """INIT -> RTR -> RTS against the peer's endpoint (pyverbs' ``to_rts`` walks RTR on the way)."""
        plan = plan_connect(self.offer(), peer)
        pv = self.device.pv
        try:
            attr = pv.qp.QPAttr(port_num=plan.port_num)
            attr.qp_access_flags = access_flags(pv)
            attr.path_mtu = plan.path_mtu
            attr.dest_qp_num = plan.dest_qp_num
            attr.rq_psn = plan.rq_psn
            attr.sq_psn = plan.sq_psn
            attr.max_dest_rd_atomic = plan.max_dest_rd_atomic
            attr.max_rd_atomic = plan.max_rd_atomic
            attr.timeout = plan.timeout
            attr.retry_cnt = plan.retry_cnt
            attr.rnr_retry = plan.rnr_retry
            attr.min_rnr_timer = plan.min_rnr_timer
            if plan.use_grh:
                gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(val=plan.dgid), sgid_index=plan.sgid_index)
                attr.ah_attr = pv.addr.AHAttr(port_num=plan.port_num, is_global=1, gr=gr, dlid=plan.dlid)
            else:
                attr.ah_attr = pv.addr.AHAttr(port_num=plan.port_num, is_global=0, dlid=plan.dlid)
            self.qp.to_rts(attr)
        except Exception as exc:
            raise verbs_error(exc, f"connecting queue pair {self.qp.qp_num} to {peer.device}/{peer.qp_num}") from None
        self.connected = True

    async def transfer(self, op: WrOp | str, local: Sequence[LocalSge], remote: RemoteBuffer) -> int:
        """Post one RDMA READ/WRITE and wait for its completion; returns the bytes moved."""
        if not self.connected:
            raise RdmaError("queue pair is not connected", errno.ENOTCONN)
        assert self.poller is not None
        wr_id = next(self._ids) & 0xFFFFFFFFFFFFFFFF
        desc = build_rdma_wr(op, local, remote, wr_id, max_sge=self.device.max_sge)
        what = f"RDMA {desc.op.name} of {desc.length} bytes"
        event = self.poller.expect(wr_id)
        try:
            self.qp.post_send(to_pyverbs_wr(desc, self.device.pv))
        except Exception as exc:
            self.poller.forget(wr_id)
            raise verbs_error(exc, f"posting {what}") from None
        return await self.poller.wait(wr_id, event, what)

    def close(self) -> None:
        if self.poller is not None:
            self.poller.close()
        for obj in (self.qp, self.cq):
            if obj is not None:
                obj.close()


class RdmaEndpoint:
    """One connection's bulk-data path: a connected QP plus the local pool its buffers come from."""

    def __init__(self, qp: RdmaQueuePair, pool: BufferPool) -> None:
        self.qp = qp
        self.pool = pool

    async def read(self, into: memoryview, remote: RemoteBuffer) -> int:
        """RDMA READ ``remote`` into ``into`` (registered memory from the pool, same length)."""
        return await self.qp.transfer(WrOp.READ, [self.pool.lookup(into)], remote)

    async def write(self, data: memoryview, remote: RemoteBuffer) -> int:
        """RDMA WRITE ``data`` (registered memory from the pool) into ``remote``."""
        return await self.qp.transfer(WrOp.WRITE, [self.pool.lookup(data)], remote)
