"""Errors of the bulk-data transport, members of the kvfs family so they cross the wire as ``(errno, message)``."""

from __future__ import annotations

import errno as _errno

from kvfs.errors import KvfsError


class RdmaUnavailable(KvfsError):
    """RDMA was required (forced by configuration or by a peer) but this host or the peer cannot do it."""

    default_errno = _errno.ENODEV


class RdmaError(KvfsError):
    """A verbs call or a work completion failed; ``errno`` says how (see :func:`kvfs.transport.verbs.wc_error`)."""

    default_errno = _errno.EIO


class BufferExhausted(KvfsError):
    """Every registered slab is in use; the caller waits, retries, or falls back to TCP for this transfer."""

    default_errno = _errno.ENOBUFS


class UnregisteredMemory(KvfsError):
    """A buffer handed to RDMA is not inside memory registered with the device."""

    default_errno = _errno.EFAULT
