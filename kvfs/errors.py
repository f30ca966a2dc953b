"""One exception family for every kvfs component.

Failures cross process boundaries as ``(errno, message)`` pairs, so the family is rooted in
:class:`OSError`: a filesystem caller gets the errno it expects, and an API caller can catch
:class:`KvfsError` (or a narrower subclass) without caring which process raised it.
"""

from __future__ import annotations

import errno as _errno


class KvfsError(OSError):
    """Base of all kvfs errors; ``errno`` is always set so it can travel over the wire."""

    default_errno: int = _errno.EIO

    def __init__(self, message: str = "", errno: int | None = None) -> None:
        code = self.default_errno if errno is None else errno
        super().__init__(code, message or _errno.errorcode.get(code, "error"))

    @property
    def message(self) -> str:
        return str(self.strerror)

    def __reduce__(self):  # keep subclasses picklable across process pools
        return (type(self), (self.message, self.errno))


class ProtocolError(KvfsError):
    """A peer sent a frame or message that violates the wire protocol."""

    default_errno = _errno.EPROTO


class AuthError(KvfsError):
    """A frame's authentication tag was missing or wrong."""

    default_errno = _errno.EACCES


class RpcTimeout(KvfsError):
    """A call's deadline passed before its answer arrived."""

    default_errno = _errno.ETIMEDOUT


class ConnectionLost(KvfsError):
    """The connection broke while a call was in flight; the call may or may not have run."""

    default_errno = _errno.ECONNRESET


class ServiceUnavailable(KvfsError):
    """No instance of a service could be reached."""

    default_errno = _errno.EHOSTUNREACH


class StaleRouting(KvfsError):
    """The caller's chain version differs from the server's; refresh routing from mgmtd and retry."""

    default_errno = _errno.ESTALE


class ChecksumMismatch(KvfsError):
    """Data did not match its CRC32C."""

    default_errno = _errno.EBADMSG


class NotCommitted(KvfsError):
    """A replica holds an uncommitted version and cannot answer the read itself; retry elsewhere."""

    default_errno = _errno.EAGAIN


class TransactionConflict(KvfsError):
    """An optimistic transaction lost a conflict; the retry helper runs it again."""

    default_errno = _errno.EAGAIN


class TransactionTooLarge(KvfsError):
    """A transaction wrote more than the engine accepts in one commit."""

    default_errno = _errno.E2BIG


class TransactionTooOld(KvfsError):
    """A transaction ran longer than the engine's limit; it is retried from the start."""

    default_errno = _errno.ETIMEDOUT


_BY_ERRNO: dict[int, type[KvfsError]] = {
    _errno.ESHUTDOWN: ServiceUnavailable,  # a draining server refused the call before running it
    _errno.EPROTO: ProtocolError,
    _errno.ESTALE: StaleRouting,
    _errno.EBADMSG: ChecksumMismatch,
}


def from_wire(code: int, message: str) -> KvfsError:
    """Rebuild the most specific exception for an ``(errno, message)`` pair received from a peer."""
    return _BY_ERRNO.get(code, KvfsError)(message, code)
