"""The kvfs wire format, without any I/O.

A frame is ``header | body | data``:

* ``header`` — fixed 48 bytes (:data:`HEADER`): magic, protocol version, frame type, flags, request id,
  method id, body length, data length and a 16-byte authentication tag.
* ``body`` — one msgspec struct encoded as msgpack: the typed part of a request or response.
* ``data`` — raw bytes (chunk contents) that the receiver reads straight into a buffer it owns, so bulk
  data never passes through the message decoder. Bulk data is protected by the CRC32C that travels in the
  body, not by the tag.

The tag is an HMAC-SHA256 (truncated to 16 bytes) over a sequence number and the frame (header with its tag
field zeroed, and body), keyed by one direction's key of the connection (:class:`Signer`). The keys come from the
handshake that opens every connection (:mod:`kvfs.auth`), so a peer without the cluster token is refused before
any handler runs, and a frame recorded on one connection is refused when replayed on it or on any other. The
sequence number is not sent: each side counts the frames it sends and receives. Lengths are checked against
configured limits as soon as a header arrives, before anything is allocated for the frame.
"""

from __future__ import annotations

import enum
import hmac
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import msgspec

from kvfs.errors import AuthError, ProtocolError

MAGIC = b"KVFS"
PROTOCOL_VERSION = 3  # 2: per-connection keys and sequence numbers (kvfs.auth); 3: chunk writes of several runs
# (WriteReq.extents), which a server of protocol 2 would ignore and store as one contiguous write
TAG_SIZE = 16
HEADER = struct.Struct("<4sBBHQIIQ16s")
HEADER_SIZE = HEADER.size
_SIGNED = HEADER_SIZE - TAG_SIZE
_NO_TAG = bytes(TAG_SIZE)
_UNTAGGED_HEADER = struct.Struct("<4sBBHQIIQ16x")
_SEQUENCE = struct.Struct("<Q")


class FrameType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    ERROR = 3


class Flags(enum.IntFlag):
    NONE = 0
    #: An ERROR frame telling the peer its own frame failed authentication. It cannot be signed with a
    #: token the peer does not have, so it is the one frame accepted without a valid tag.
    AUTH_REFUSED = 1
    #: The body ends with an RDMA descriptor trailer and the data section moved (or is to move) by RDMA instead
    #: of following the body; see :mod:`kvfs.transport.link`. Never set on a TCP-only connection.
    RDMA = 2
    #: An ERROR frame (request id 0, errno ESHUTDOWN) telling a client the server is going away: every request it
    #: read has been answered, later ones are refused unrun, and the client must send no more on this connection.
    GOAWAY = 4
    #: A REQUEST its sender wants no answer to: the server runs the handler and sends nothing back (a failure
    #: is logged there). For messages whose loss the sender repairs itself, e.g. by retransmitting.
    ONEWAY = 8
    #: The body ends with a shared-memory trailer naming where in the sender's arena the data section lies
    #: (``data_len`` is 0); the receiver copies it from there. See :mod:`kvfs.transport.shm`.
    SHM = 16
    #: On a REQUEST: the body ends with a shared-memory trailer naming a buffer in the sender's arena (offset,
    #: capacity) the answer's data section may be written into. On a RESPONSE: the body ends with a trailer
    #: (offset, length) saying the data section was written there (``data_len`` is 0). See :mod:`kvfs.transport.shm`.
    SHM_REPLY = 32


# Enum construction and Flag arithmetic cost microseconds each: a header is decoded with table lookups instead.
_FRAME_TYPES = {t.value: t for t in FrameType}
_KNOWN_FLAGS = int(Flags.AUTH_REFUSED | Flags.RDMA | Flags.GOAWAY | Flags.ONEWAY | Flags.SHM | Flags.SHM_REPLY)
_FLAG_SETS = tuple(Flags(bits) for bits in range(_KNOWN_FLAGS + 1))


@dataclass(frozen=True, slots=True)
class Limits:
    """Upper bounds a receiver enforces before allocating anything for a frame."""

    max_body: int = 4 << 20
    max_data: int = 256 << 20


class Header(NamedTuple):
    """A decoded frame header (a tuple: a frozen dataclass took most of a microsecond to build, once per frame)."""

    type: FrameType
    flags: Flags
    request_id: int
    method: int
    body_len: int
    data_len: int
    tag: bytes


class ErrorBody(msgspec.Struct, array_like=True):
    """Body of an ERROR frame: the failure travels as ``(errno, message)``."""

    errno: int
    message: str


class Empty(msgspec.Struct, array_like=True):
    """A request or response with nothing to say beyond its method."""


class _Keyed:
    """HMAC-SHA256 under one key with the key's pads hashed once: each tag copies the keyed state, where
    ``hmac.digest`` hashes both pads again for every frame, half of what a small frame's tag cost."""

    __slots__ = ("_keyed",)

    def __init__(self, key: bytes) -> None:
        self._keyed = hmac.new(key, digestmod="sha256")

    def tag(self, sequence: int, *parts: bytes | memoryview) -> bytes:
        """The truncated MAC of the sequence number followed by ``parts``."""
        mac = self._keyed.copy()
        mac.update(_SEQUENCE.pack(sequence))
        for part in parts:
            mac.update(part)
        return mac.digest()[:TAG_SIZE]


class Signer:
    """Tags one connection's outgoing frames and checks its incoming ones.

    One key per direction (from the connection's handshake) and a count of the frames sent and received so far,
    which is the sequence number each tag covers. A frame must therefore be tagged in the order it goes on the
    wire (the RPC writer seals frames as it queues them), and a receiver that refuses one frame must close the
    connection: its count no longer matches the sender's.
    """

    __slots__ = ("_send", "_receive", "_sent", "_received")

    def __init__(self, *, send_key: bytes, receive_key: bytes) -> None:
        self._send = _Keyed(send_key)
        self._receive = _Keyed(receive_key)
        self._sent = 0
        self._received = 0

    def seal(self, frame: bytes) -> bytes:
        """``frame`` (from :func:`encode_frame`, tag field zero) with its tag, as the next frame this side sends."""
        tag = self._send.tag(self._sent, frame)
        self._sent += 1
        return frame[:_SIGNED] + tag + frame[HEADER_SIZE:]

    def verify(self, header_bytes: bytes | memoryview, body: bytes | memoryview) -> bool:
        """Whether this is the next frame the peer sent; counts it if so."""
        expected = self._receive.tag(self._received, header_bytes[:_SIGNED], _NO_TAG, body)
        if not hmac.compare_digest(expected, bytes(header_bytes[_SIGNED:HEADER_SIZE])):
            return False
        self._received += 1
        return True


def encode_frame(
    type: FrameType,
    request_id: int,
    method: int,
    body: bytes,
    data_len: int = 0,
    flags: Flags = Flags.NONE,
) -> bytes:
    """Return header + body with the tag field zero (:meth:`Signer.seal` fills it in); the caller sends the
    ``data_len`` data bytes after it."""
    return _UNTAGGED_HEADER.pack(MAGIC, PROTOCOL_VERSION, type, flags, request_id, method, len(body), data_len) + body


def decode_header(raw: bytes | memoryview, limits: Limits) -> Header:
    """Parse and bounds-check a header; raise ProtocolError for anything a well-behaved peer never sends."""
    magic, version, ftype, flags, request_id, method, body_len, data_len, tag = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})")
    frame_type = _FRAME_TYPES.get(ftype)
    if frame_type is None:
        raise ProtocolError(f"unknown frame type {ftype}")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown flags {flags:#x}")
    if body_len > limits.max_body:
        raise ProtocolError(f"body of {body_len} bytes exceeds the limit of {limits.max_body}")
    if data_len > limits.max_data:
        raise ProtocolError(f"data section of {data_len} bytes exceeds the limit of {limits.max_data}")
    return Header(frame_type, _FLAG_SETS[flags], request_id, method, body_len, data_len, tag)


def check_tag(signer: Signer, raw_header: bytes | memoryview, header: Header, body: bytes | memoryview) -> None:
    """Raise AuthError unless the frame is the next one the peer tagged with this connection's key (or is a
    peer's auth refusal)."""
    if header.type is FrameType.ERROR and Flags.AUTH_REFUSED in header.flags:
        return
    if header.tag == _NO_TAG:
        raise AuthError("frame carries no authentication tag")
    if not signer.verify(raw_header, body):
        raise AuthError("frame authentication tag does not match this connection's key and sequence"
                        " (a replayed, reordered, altered or forged frame)")


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: a stable numeric id, typed request/response bodies, and whether blind retry is safe.

    Ids are allocated by component and never reused: 100-199 ``meta`` (derived from MetaStore, see meta/rpc.py),
    200-299 ``mgmtd`` (craq/mgmtd.py), 300-399 chunk server (chunkserver/protocol.py), 7000-7099 transport
    handshakes (kvfs/transport), 9000-9999 tests and benchmarks. A clash raises at import."""

    id: int
    name: str
    request: type[msgspec.Struct]
    response: type[msgspec.Struct]
    idempotent: bool = False

    registry: ClassVar[dict[int, Method]] = {}

    def __post_init__(self) -> None:
        other = Method.registry.get(self.id)
        if other is not None and other.name != self.name:
            raise ValueError(f"method id {self.id} is used by both {other.name} and {self.name}")
        Method.registry[self.id] = self
        for kind in (self.request, self.response):  # fail at import, not on the first call
            _decoder_for(kind)


_encoder = msgspec.msgpack.Encoder()
_error_decoder = msgspec.msgpack.Decoder(ErrorBody)
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode_body(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def _decoder_for(kind: type[msgspec.Struct]) -> msgspec.msgpack.Decoder[Any]:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return decoder


def decode_body(kind: type[msgspec.Struct], raw: bytes | memoryview) -> Any:
    """Decode a body into ``kind``; malformed or mistyped bodies become ProtocolError."""
    try:
        return _decoder_for(kind).decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {kind.__name__} body: {exc}") from None


def decode_error(raw: bytes | memoryview) -> ErrorBody:
    try:
        return _error_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed error body: {exc}") from None
