"""Connection authentication: who may talk to a kvfs service, and why a recording of the talk is worth nothing.

Every TCP connection opens with a handshake before any RPC frame, in frames of its own (untagged, request id 0):

1. the client sends :data:`AUTH_HELLO` with a fresh random nonce;
2. the server answers with a fresh random nonce of its own;
3. the client sends :data:`AUTH_PROVE` with its proof, an HMAC keyed (through HKDF) by the cluster token over both
   nonces and the role ``client``;
4. the server checks it and answers with its own proof (role ``server``), or refuses the connection.

The token itself never travels. Each proof covers a nonce the other side just chose and names its role, so neither
side answers a challenge of the other's choosing with something the other could use: a peer without the token
learns nothing it can replay, on this connection or another. From the same HKDF pseudo-random key come two frame
keys, one per direction, that :class:`kvfs.wire.Signer` tags every later frame with, together with a sequence
number each side counts for itself. A frame replayed on its own connection carries a stale sequence number, one
replayed on another connection a foreign key: either fails its tag and ends that connection.

Primitives: HMAC-SHA256 and HKDF (RFC 5869) built on it from :mod:`hmac`; nothing home-made. Payloads are not
encrypted: anyone on the path still reads them (see the README's security section).
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated

import msgspec

from kvfs.wire import Method, Signer

NONCE_SIZE = 32
PROOF_SIZE = 32
_HASH = "sha256"
_LABEL = b"kvfs-auth-v1 "

Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_SIZE, max_length=NONCE_SIZE)]
Mac = Annotated[bytes, msgspec.Meta(min_length=PROOF_SIZE, max_length=PROOF_SIZE)]


class Hello(msgspec.Struct, array_like=True):
    """Client to server first, server to client second: each side's fresh nonce."""

    nonce: Nonce


class Proof(msgspec.Struct, array_like=True):
    """Client to server third, server to client last: an HMAC that only a holder of the token can compute."""

    mac: Mac


AUTH_HELLO = Method(7010, "transport.auth_hello", Hello, Hello)
AUTH_PROVE = Method(7011, "transport.auth_prove", Proof, Proof)


def token_key(token: bytes | str) -> bytes:
    """The token as key material; an empty token would make every proof public, so it is refused."""
    key = token.encode() if isinstance(token, str) else bytes(token)
    if not key:
        raise ValueError("the cluster token must not be empty")
    return key


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def _expand(prk: bytes, label: bytes) -> bytes:
    """HKDF-Expand for one hash-length block (RFC 5869, L = 32)."""
    return hmac.digest(prk, _LABEL + label + b"\x01", _HASH)


@dataclass(frozen=True, slots=True)
class Session:
    """What one handshake derives from the token and both nonces; the same on both sides iff the tokens match."""

    client_proof: bytes
    server_proof: bytes
    client_key: bytes  # tags client -> server frames
    server_key: bytes  # tags server -> client frames

    @classmethod
    def derive(cls, token: bytes, client_nonce: bytes, server_nonce: bytes) -> Session:
        prk = hmac.digest(client_nonce + server_nonce, token, _HASH)  # HKDF-Extract(salt = both nonces, IKM = token)
        return cls(
            client_proof=_expand(prk, b"client proof"),
            server_proof=_expand(prk, b"server proof"),
            client_key=_expand(prk, b"client frames"),
            server_key=_expand(prk, b"server frames"),
        )

    def client_signer(self) -> Signer:
        return Signer(send_key=self.client_key, receive_key=self.server_key)

    def server_signer(self) -> Signer:
        return Signer(send_key=self.server_key, receive_key=self.client_key)


def proof_matches(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


__all__ = [
    "AUTH_HELLO",
    "AUTH_PROVE",
    "Hello",
    "NONCE_SIZE",
    "Proof",
    "Session",
    "new_nonce",
    "proof_matches",
    "token_key",
]
