"""Caller-owned memory that a server RDMA-WRITEs answers straight into (GPUDirect RDMA), independent of pyverbs.

The usual RDMA answer lands in a connection-owned slab and is copied into the caller's buffer (link.py). Where the
caller's buffer is GPU memory that the NIC can reach (a dma-buf exported by the CUDA driver, or peer memory through
``nvidia-peermem``), that copy and the host staging around it can go: the request's ``dst`` descriptor names the
caller's own registered region instead of a slab, and the server's WRITE lands in GPU memory.

A caller's buffer is not the connection's to keep, so a :class:`DirectRegion` is a borrow with rules:

* it is registered once per protection domain (the PD of the link a call goes through; all links of one
  ``VerbsFactory`` share one), on first use, and a domain where registration failed is not tried again: its
  calls go through the host staging buffer the caller also supplies (:class:`DirectInto`);
* every call that names it holds it (:meth:`DirectRegion.hold`); :meth:`DirectRegion.close` refuses new holds,
  waits for those in flight, then deregisters, so no rkey outlives the caller's registration;
* a call that names it and is given up before its answer destroys its connection's queue pair at once
  (``kvfs.rpc``), so a late WRITE cannot land in memory the caller has moved on to use.

The server cannot tell a region from a slab: the wire protocol is unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from kvfs.errors import KvfsError
from kvfs.transport.buffers import MemoryRegistration, RemoteBuffer
from kvfs.transport.errors import UnregisteredMemory

log = logging.getLogger("kvfs.transport")


@dataclass(frozen=True, slots=True)
class DmaBuf:
    """A dma-buf file descriptor exported for a device range; the region starts ``offset`` bytes into it."""

    fd: int
    offset: int


class DirectDomain(Protocol):
    """What a region registers with: an endpoint's protection domain (``Endpoint.domain`` in link.py)."""

    def register_direct(self, addr: int, length: int, dmabuf: DmaBuf | None) -> MemoryRegistration: ...


#: Exports a dma-buf for ``(addr, length)``; None where the region is registered as peer memory instead.
ExportFn = Callable[[int, int], DmaBuf]


class DirectRegion:
    """``length`` bytes at ``addr`` (GPU memory) that servers may RDMA-WRITE into, registered per protection domain.

    ``export``: how to get a dma-buf for the range (the CUDA driver's); None registers the address itself, which
    only a peer-memory client in the kernel (``nvidia-peermem``) lets the NIC resolve. Used from one trio thread.
    """

    def __init__(self, addr: int, length: int, *, export: ExportFn | None = None) -> None:
        if addr <= 0 or length <= 0:
            raise ValueError("a direct region needs an address and a positive length")
        self.addr = addr
        self.length = length
        self.method = "dmabuf" if export is not None else "peer-memory"
        self._export = export
        self._registrations: dict[int, tuple[Any, MemoryRegistration]] = {}  # id(domain) -> (domain, MR)
        self._refused: dict[int, str] = {}  # id(domain) -> why registration failed there
        self._holds = 0
        self._idle: trio.Event | None = None
        self.closed = False

    def __repr__(self) -> str:
        return f"DirectRegion({self.addr:#x}, +{self.length}, {self.method})"

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length

    @property
    def registered_domains(self) -> int:
        return len(self._registrations)

    def refusal(self, domain: object) -> str | None:
        """Why registration with ``domain`` failed, or None."""
        return self._refused.get(id(domain))

    def remote(self, domain: DirectDomain, offset: int, length: int) -> RemoteBuffer | None:
        """The descriptor of ``[offset, offset + length)`` for a peer on ``domain``, registering on first use; None
        where this domain cannot register it (logged once per domain; the call then goes through host memory)."""
        if self.closed:
            raise UnregisteredMemory(f"{self!r} was unregistered")
        if offset < 0 or length <= 0 or offset + length > self.length:
            raise ValueError(f"[{offset}, +{length}) is outside {self!r}")
        key = id(domain)
        entry = self._registrations.get(key)
        if entry is None:
            if key in self._refused:
                return None
            try:
                entry = self._registrations[key] = (domain, self._register(domain))
            except (KvfsError, OSError) as exc:
                self._refused[key] = reason = str(getattr(exc, "message", exc))
                log.warning("GPUDirect RDMA: registering %r failed, its reads go through host memory: %s", self,
                            reason)
                return None
        return RemoteBuffer(self.addr + offset, int(entry[1].rkey), length)

    def _register(self, domain: DirectDomain) -> MemoryRegistration:
        dmabuf = None if self._export is None else self._export(self.addr, self.length)
        try:
            return domain.register_direct(self.addr, self.length, dmabuf)
        finally:
            if dmabuf is not None:
                os.close(dmabuf.fd)  # the MR keeps its own reference to the dma-buf

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Keep the registration alive for one call naming it; UnregisteredMemory once it is being closed."""
        if self.closed:
            raise UnregisteredMemory(f"{self!r} was unregistered")
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            if not self._holds and self._idle is not None:
                self._idle.set()

    async def close(self) -> None:
        """Refuse new calls, wait for those in flight, then deregister from every domain."""
        self.closed = True
        while self._holds:
            self._idle = trio.Event()
            await self._idle.wait()
        registrations, self._registrations = self._registrations, {}
        for _, mr in registrations.values():
            close = getattr(mr, "close", None)
            if close is not None:
                close()


class DirectInto:
    """A call's answer destination inside a :class:`DirectRegion`, with the host buffer its data goes to where the
    connection cannot RDMA-WRITE into the region (no link, registration refused, too small, a server fallback).

    After the call, ``written`` says how many bytes the server wrote straight into the region (0: what came is in
    ``staging``); ``filled`` is set by the reader to the bytes the answer held (the rest of the range is a hole)."""

    __slots__ = ("region", "offset", "length", "staging", "written", "filled")

    def __init__(self, region: DirectRegion, offset: int, length: int, staging: memoryview) -> None:
        if len(staging) < length:
            raise ValueError(f"a staging buffer of {len(staging)} bytes for a {length}-byte destination")
        self.region, self.offset, self.length, self.staging = region, offset, length, staging[:length]
        self.written = 0
        self.filled = 0

    def __len__(self) -> int:
        return self.length
