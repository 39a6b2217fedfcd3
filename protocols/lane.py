"""The bulk lane: tensors on a raw TCP connection, sealed with AES-256-GCM.

py-libp2p moves ~210 MB/s per connection, CPU-bound in Noise and Yamux (notes/libp2p.md
§3); raw TCP on the same machine moves ~2 GB/s and AES-GCM (AES-NI) seals several GB/s.
So a pairwise exchange negotiates its lane over the authenticated libp2p stream (the
responder sends a fresh random key and a TCP port in its accept) and the tensor frames then
travel on the lane:

    lane record = length:u32-big-endian  AES-256-GCM(key, nonce, plaintext) (+16-byte tag)
    nonce       = direction byte (0 initiator->responder, 1 back) || 0^3 || counter:u64

Only a holder of the key (handed out over Noise to the authenticated partner) can produce a
record that opens; a replayed, reordered, truncated or forged record fails its tag. Every
length is checked against MAX_RECORD before anything is buffered.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from protocols.errors import LocalProtocolError, RemoteProtocolError

KEY_BYTES = 32
MAX_PLAINTEXT = 4 << 20
MAX_RECORD = MAX_PLAINTEXT + 16
_LEN = struct.Struct(">I")


def _nonce(direction: int, counter: int) -> bytes:
    return bytes([direction, 0, 0, 0]) + counter.to_bytes(8, "big")


class Sealer:
    """Seals our outgoing bytes; `direction` is 0 for the initiator, 1 for the responder."""

    def __init__(self, key: bytes, direction: int) -> None:
        if len(key) != KEY_BYTES:
            raise LocalProtocolError("a lane key is 32 bytes")
        self._aead, self._direction, self._counter = AESGCM(key), direction, 0

    def seal(self, plaintext: bytes | memoryview) -> bytes:
        header, ct = self.seal_parts(plaintext)
        return header + ct

    def seal_parts(self, plaintext: bytes | memoryview) -> tuple[bytes, bytes]:
        """(length header, ciphertext): written one after the other, no concatenation copy."""
        if len(plaintext) > MAX_PLAINTEXT:
            raise LocalProtocolError(f"seal at most {MAX_PLAINTEXT} bytes at a time")
        ct = self._aead.encrypt(_nonce(self._direction, self._counter), plaintext, None)
        self._counter += 1
        return _LEN.pack(len(ct)), ct


class Opener:
    """Opens the partner's records, in order. The reader takes the 4-byte length, asks
    `check_length`, reads exactly that many bytes, then calls `open`."""

    HEADER = 4

    def __init__(self, key: bytes, direction: int) -> None:
        if len(key) != KEY_BYTES:
            raise LocalProtocolError("a lane key is 32 bytes")
        self._aead, self._direction, self._counter = AESGCM(key), direction, 0

    @staticmethod
    def check_length(header: bytes | memoryview) -> int:
        (n,) = _LEN.unpack(header)
        if not 16 <= n <= MAX_RECORD:
            raise RemoteProtocolError(f"lane record of {n} bytes (limit {MAX_RECORD})")
        return n

    def open(self, record: bytes | bytearray | memoryview) -> bytes:
        try:
            plain = self._aead.decrypt(_nonce(self._direction, self._counter), record, None)
        except InvalidTag:
            raise RemoteProtocolError("lane record failed authentication") from None
        self._counter += 1
        return plain
