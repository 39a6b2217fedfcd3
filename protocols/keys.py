"""Ed25519 peer ids and signatures, byte-compatible with libp2p, without importing libp2p.

A libp2p Ed25519 peer id is the base58btc text of an *identity* multihash (code 0x00,
length 0x24 = 36) over the protobuf `PublicKey {KeyType Type = 1 (Ed25519); bytes Data = 2}`,
which for a 32-byte key is always `08 01 12 20 || key`
(https://github.com/libp2p/specs/blob/master/peer-ids/peer-ids.md). So the id *is* the
public key: verifying a signature needs nothing but the writer's id string.

From a libp2p `KeyPair`: `Signer(kp.private_key.to_bytes()[:32])`. py-libp2p's
`Ed25519PrivateKey.to_bytes()` is the 32-byte seed (PyNaCl `bytes(SigningKey)`); go-libp2p's
private-key bytes are `seed || public key` (64 bytes), so `[:32]` is right for both.
"""

from __future__ import annotations

import os
from functools import lru_cache

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from protocols.errors import LocalProtocolError, RemoteProtocolError

# identity multihash (0x00, 36 bytes) of protobuf PublicKey{Type: Ed25519 (1), Data: 32 bytes}
_ED25519_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
_KEY_TYPES = {0: "RSA", 1: "Ed25519", 2: "secp256k1", 3: "ECDSA"}
MAX_PEER_ID_CHARS = 128  # an Ed25519 id is 52; refuse long strings before base58 (quadratic)
SIGNATURE_BYTES = 64


def peer_id_from_public_key(raw32: bytes) -> str:
    """The libp2p peer id (`12D3KooW...`) of a raw 32-byte Ed25519 public key."""
    if not isinstance(raw32, bytes | bytearray) or len(raw32) != 32:
        raise LocalProtocolError("an Ed25519 public key is 32 raw bytes")
    return base58.b58encode(_ED25519_ID_PREFIX + bytes(raw32)).decode("ascii")


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw 32-byte Ed25519 key inside `peer_id`; RemoteProtocolError if it has none."""
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_CHARS:
        raise RemoteProtocolError(f"malformed peer id {peer_id!r:.80}")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        raise RemoteProtocolError(f"peer id {peer_id!r} is not base58btc") from None
    if raw.startswith(_ED25519_ID_PREFIX) and len(raw) == 38:
        if base58.b58encode(raw).decode("ascii") != peer_id:  # one key, one spelling
            raise RemoteProtocolError(f"peer id {peer_id!r} is not canonical base58")
        return raw[6:]
    if raw[:2] == b"\x12\x20":
        raise RemoteProtocolError(
            f"peer id {peer_id!r} is a sha2-256 hash of its key (RSA or ECDSA), not Ed25519"
        )
    if raw[:1] == b"\x00" and raw[2:3] == b"\x08" and len(raw) > 3:
        kind = _KEY_TYPES.get(raw[3], f"key type {raw[3]}")
        raise RemoteProtocolError(f"peer id {peer_id!r} holds a {kind} key, not Ed25519")
    raise RemoteProtocolError(f"peer id {peer_id!r} is not an Ed25519 libp2p peer id")


@lru_cache(maxsize=4096)  # merges verify many entries by few writers; parsing costs ~10 µs
def _public_key(peer_id: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(peer_id))


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True if `signature` is `peer_id`'s Ed25519 signature of `data`.

    False for a wrong signature; RemoteProtocolError if `peer_id` is not an Ed25519 id.
    """
    key = _public_key(peer_id)
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        key.verify(signature, data)
    except InvalidSignature:
        return False
    return True


class Signer:
    """An Ed25519 private key, from its 32-byte seed; `.peer_id` is its libp2p peer id."""

    __slots__ = ("_key", "peer_id", "public_key")

    def __init__(self, seed: bytes) -> None:
        if not isinstance(seed, bytes | bytearray) or len(seed) != 32:
            raise LocalProtocolError("an Ed25519 seed is 32 bytes")
        self._key = Ed25519PrivateKey.from_private_bytes(bytes(seed))
        self.public_key = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.peer_id = peer_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Signer:
        return cls(os.urandom(32))

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of `data` (deterministic, RFC 8032)."""
        return self._key.sign(data)

    def __repr__(self) -> str:
        return f"Signer({self.peer_id})"
