"""Same-host bulk data through shared memory instead of loopback TCP.

Between two processes of one host, loopback TCP copies a data section twice (into the kernel and out again) and
runs the TCP stack on both sides for it: about 30% of all CPU while a ``kvfs up`` cluster takes sequential writes
(mount, then three chain members, three hops). Here a process keeps the buffers it sends from in an *arena*: one
memfd, sealed against shrinking and mapped once per buffer. A receiver on the same host maps the sender's arena
(``/proc/PID/fd/FD``, after checking the handshake's nonce in its first page) and copies a data section out of it
when the frame that names it arrives: one memcpy per hop, with the GIL released, and no kernel in between.

Only *lent* data goes this way (``lend=True`` on a call or one-way send): the caller promises that the bytes stay
as they are until the call is answered or, for a one-way message, until the receiver has handled it, and the
receiver checks them against a CRC that travels with the message (chunk writes and their forwards). A sender that
breaks the promise (one that gave up on a call and reused its buffer) at worst has that write refused by the
receiver's CRC check. Anything else, another host, or a refused handshake, stays on TCP, byte for byte as before.

The arena is sealed against shrinking so that no client can make a server's mapping fault (SIGBUS) under it.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import struct
import threading
import weakref
from functools import cache
from typing import Annotated, Any

import msgspec
import prometheus_client
import trio

from kvfs.errors import ProtocolError
from kvfs.pool import RECEIVED, BufferPool
from kvfs.transport.buffers import buffer_address
from kvfs.transport.errors import UnregisteredMemory
from kvfs.wire import Method

log = logging.getLogger("kvfs.transport")

ENV_SHM = "KVFS_SHM"
#: A data section this small costs more in the descriptor and its lookup than it saves.
SHM_MIN_BYTES = 16 << 10
#: The arena's address space; pages are only used as buffers are touched, and pooled buffers are reused.
ARENA_CAPACITY = 1 << 30
_HEADER_PAGE = mmap.PAGESIZE
_MAGIC = b"kvfs-arena-1\0\0\0\0"
_NONCE = 16
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

TRAILER = struct.Struct("<QQ")  # arena offset, length of the data section it names

SHM_BYTES = prometheus_client.Counter(
    "kvfs_shm_bytes", "Data-section bytes a server copied out of (or answered into) same-host clients' arenas"
    " instead of TCP"
)


def resolve_enabled(value: bool | None, default: bool = True) -> bool:
    """Shared memory on or off: an explicit value, else ``$KVFS_SHM`` (``0``/``off``/``false``/``no`` turn it off),
    else ``default`` (the config file's ``shared_memory``)."""
    if value is not None:
        return value
    env = os.environ.get(ENV_SHM)
    return default if not env else env.strip().lower() not in ("0", "off", "false", "no")


@cache
def boot_id() -> str:
    """This host's boot id: two processes that read the same one share a kernel, and so can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------ handshake


class ShmOffer(msgspec.Struct, array_like=True, frozen=True):
    """A client's arena, as a server on the same host finds and checks it."""

    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    pid: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    fd: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
    size: Annotated[int, msgspec.Meta(gt=_HEADER_PAGE, le=1 << 40)]
    nonce: Annotated[bytes, msgspec.Meta(min_length=_NONCE, max_length=_NONCE)]


class ShmAccept(msgspec.Struct, array_like=True, frozen=True):
    """``replies``: the server also writes answers' data into buffers the client names (``Flags.SHM_REPLY``); a
    server that predates them leaves it out, and gets no such request."""

    accepted: bool
    reason: Annotated[str, msgspec.Meta(max_length=512)] = ""
    replies: bool = False


#: Asked by a client on its first lent call to a server; not idempotent (the server maps the arena per connection).
SHM_CONNECT = Method(7002, "transport.shm_connect", ShmOffer, ShmAccept)


def encode_trailer(offset: int, length: int) -> bytes:
    return TRAILER.pack(offset, length)


def split_trailer(body: bytes | memoryview, max_data: int) -> tuple[bytes | memoryview, int, int]:
    """``(message body, offset, length)`` of a frame flagged SHM; ProtocolError for anything malformed."""
    if len(body) < TRAILER.size:
        raise ProtocolError(f"shared-memory request body of {len(body)} bytes is shorter than its trailer")
    cut = len(body) - TRAILER.size
    offset, length = TRAILER.unpack(body[cut:])
    if not 0 < length <= max_data:
        raise ProtocolError(f"shared-memory data section of {length} bytes (limit {max_data})")
    return body[:cut], offset, length


# ------------------------------------------------------------------------------------------ arenas


class Arena:
    """This process's shared buffers: one sealed memfd, carved into buffers that are never given back.

    ``allocate`` is what :class:`~kvfs.pool.BufferPool` calls for a new buffer; the pool reuses buffers once
    nothing refers to them, so the arena only grows to the pool's working set."""

    def __init__(self, capacity: int = ARENA_CAPACITY) -> None:
        self.capacity = capacity
        self.pid = os.getpid()
        self.nonce = secrets.token_bytes(_NONCE)
        self.fd = os.memfd_create("kvfs-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, capacity)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            with mmap.mmap(self.fd, _HEADER_PAGE) as header:
                header[: len(_MAGIC) + _NONCE] = _MAGIC + self.nonce
        except BaseException:
            os.close(self.fd)
            raise
        self._next = _HEADER_PAGE
        #: each buffer's (address, arena offset); weak, since a buffer's address is reused once it is unmapped
        self._buffers: weakref.WeakKeyDictionary[mmap.mmap, tuple[int, int]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def allocate(self, size: int) -> mmap.mmap | None:
        """A new buffer of ``size`` bytes (whole pages), or None once the arena is used up."""
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._lock:
            if self._next + size > self.capacity:
                return None
            offset = self._next
            self._next += size
            buf = mmap.mmap(self.fd, size, offset=offset)
            self._buffers[buf] = (buffer_address(memoryview(buf)), offset)
        return buf

    def locate(self, data: object) -> int | None:
        """The arena offset of ``data``'s bytes when they lie in one of this arena's buffers (``data`` is one of
        them or a view of one), else None."""
        try:
            view = memoryview(data)  # type: ignore[arg-type]
            start, offset = self._buffers[view.obj]  # type: ignore[index]
            address = buffer_address(view)
        except (TypeError, KeyError, UnregisteredMemory):  # not weak-referenceable, not ours, or read-only
            return None
        return offset + address - start  # a view lies inside the buffer it was made from

    def offer(self) -> ShmOffer:
        return ShmOffer(boot_id(), self.pid, self.fd, self.capacity, self.nonce)


def contiguous_offset(arena: Arena, buffers: list[Any]) -> int | None:
    """The arena offset of the first of ``buffers`` when all of them lie in ``arena``, each right after the one
    before, so one trailer names them all; else None."""
    start = end = arena.locate(buffers[0])
    for buf in buffers:
        if end is None or arena.locate(buf) != end:
            return None
        end += memoryview(buf).nbytes
    return start


class ShmRefused(Exception):
    """A server cannot map the arena a client offered; the reason goes back in the refusal."""


class PeerArena:
    """A same-host client's arena as its server maps it, to copy lent data sections out of."""

    def __init__(self, offer: ShmOffer) -> None:
        if offer.boot_id != boot_id() or not offer.boot_id:
            raise ShmRefused("the client runs on another host")
        try:
            fd = os.open(f"/proc/{offer.pid}/fd/{offer.fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmRefused(f"cannot open the client's arena: {exc.strerror}") from None
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise ShmRefused("the offered descriptor is not a sealed memfd") from None
            if not seals & fcntl.F_SEAL_SHRINK:
                raise ShmRefused("the client's arena is not sealed against shrinking")
            if os.fstat(fd).st_size != offer.size:
                raise ShmRefused("the client's arena is not the size it offered")
            self._map = mmap.mmap(fd, offer.size)
        finally:
            os.close(fd)
        if self._map[: len(_MAGIC) + _NONCE] != _MAGIC + offer.nonce:
            self._map.close()
            raise ShmRefused("the offered descriptor is not the client's arena")
        self.size = offer.size
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._map)
        self._base = ctypes.addressof(self._anchor)

    def copy_out(self, offset: int, into: memoryview) -> None:
        """Copy the client's bytes at ``offset`` into ``into`` (a writable buffer of the section's length)."""
        if self._anchor is None:
            raise ProtocolError("shared-memory data section after the arena was unmapped")
        if offset < _HEADER_PAGE or offset + into.nbytes > self.size:
            raise ProtocolError(f"shared-memory section [{offset}, +{into.nbytes}) is outside the client's arena")
        ctypes.memmove(buffer_address(into), self._base + offset, into.nbytes)  # releases the GIL
        SHM_BYTES.inc(into.nbytes)

    def copy_in(self, offset: int, capacity: int, buffers: list[Any]) -> int:
        """Write ``buffers`` one after another into the client's arena at ``offset`` (an answer's data section, into
        the buffer the client named, of ``capacity`` bytes); returns the bytes written."""
        if self._anchor is None:
            raise ProtocolError("shared-memory answer after the arena was unmapped")
        total = sum(memoryview(b).nbytes for b in buffers)
        if offset < _HEADER_PAGE or offset + capacity > self.size or total > capacity:
            raise ProtocolError(f"shared-memory answer of {total} bytes does not fit [{offset}, +{capacity}) of the"
                                " client's arena")
        at = offset
        for b in buffers:
            view = memoryview(b).cast("B")
            self._map[at : at + view.nbytes] = view  # read-only sources too (a loan of a slot file's mapping)
            at += view.nbytes
        SHM_BYTES.inc(total)
        return total

    def close(self) -> None:
        if self._anchor is not None:
            self._anchor = None
            self._map.close()


# ------------------------------------------------------------------------------------------ the process's arena


class _ProcessArena:
    """The arena of this process, made on first use (none at all where memfds cannot be made).

    A forked child gets its own: sharing the parent's would let both carve the same pages."""

    def __init__(self) -> None:
        self._arena: Arena | None = None
        self._failed = False
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._arena, self._failed, self._lock = None, False, threading.Lock()

    def get(self) -> Arena | None:
        if self._arena is None and not self._failed:
            with self._lock:
                if self._arena is None and not self._failed:
                    try:
                        self._arena = Arena()
                    except OSError as exc:
                        self._failed = True
                        log.info("no shared-memory arena (bulk data stays on TCP): %s", exc)
        return self._arena

    def allocate(self, size: int) -> mmap.mmap | None:
        arena = self.get()
        return None if arena is None else arena.allocate(size)


PROCESS_ARENA = _ProcessArena()

SHARED = BufferPool(capacity=ARENA_CAPACITY // 2, allocate=PROCESS_ARENA.allocate)
"""Buffers in this process's arena: what the process sends lent data from (the mount's write buffers) and what
a server copies lent data into (so a chain member forwards it on without another copy)."""


async def give_back_idle(every: float = 30.0, idle: float | None = None) -> None:
    """Hand the pages of this process's idle pooled buffers (its arena's, and the received pool's) back to the
    system, checking every ``every`` seconds, once nothing was taken from a pool for ``idle`` seconds (default
    ``every``; run in a service's nursery): a mount that wrote a large file, or a chunk server that took it, would
    otherwise keep their memory while they idle."""
    while True:
        await trio.sleep(every)
        for name, pool in (("shared-memory", SHARED), ("received", RECEIVED)):
            given = pool.trim(idle=every if idle is None else idle)
            if given:
                log.debug("gave back %d MiB of idle %s buffers", given >> 20, name)
