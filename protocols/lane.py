"""The bulk lane: tensors (and checkpoint chunks) on a raw TCP connection, sealed with
AES-256-GCM.

py-libp2p moves ~210 MB/s per connection, CPU-bound in Noise and Yamux (notes/libp2p.md
§3); raw TCP on the same machine moves ~2 GB/s and AES-GCM (AES-NI) seals several GB/s.
So a pairwise exchange negotiates its lane over the authenticated libp2p stream (the
responder sends a fresh random key and a TCP port in its accept) and the tensor frames then
travel on the lane:

    lane record = length:u32-big-endian  AES-256-GCM(key, nonce, plaintext) (+16-byte tag)
    nonce       = direction byte (0 initiator->responder, 1 back) || 0^3 || counter:u64

Only a holder of the key (handed out over Noise to the authenticated partner) can produce a
record that opens; a replayed, reordered, truncated or forged record fails its tag. Every
length is checked against MAX_RECORD before anything is buffered. Because every record is
authenticated, tensor frames on a lane carry no crc32 (protocols/averaging.py, lane kind
"tcp+aes256gcm/2"); the records themselves are the same as in version 1.

`seal_into` and `open_into` work in the caller's buffers (one per lane, reused for every
record), so a 100 MB vector costs no allocation per record. `open_into` writes the
plaintext before the tag is checked: after a RemoteProtocolError the buffer holds garbage,
to be discarded with the lane.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.limits import StreamLimits

KEY_BYTES = 32
TAG_BYTES = 16
MAX_PLAINTEXT = 4 << 20
MAX_RECORD = MAX_PLAINTEXT + TAG_BYTES

#: One sealed record, checked on its 4-byte length; the frames inside are averaging's.
LIMITS = StreamLimits("tcp+aes256gcm/2 lane record", MAX_RECORD, framed=False,
                      note="averaging: the swap's, derived from the partner's measured rate; "
                           "checkpoints: 30 s per chunk")
_LEN = struct.Struct(">I")
HEADER_BYTES = _LEN.size


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

    def seal_into(self, plaintext: bytes | memoryview, out: bytearray | memoryview) -> int:
        """Write the whole record (length header, then ciphertext) at the start of `out`,
        which must hold HEADER_BYTES + len(plaintext) + TAG_BYTES; return its size."""
        n = len(plaintext)
        if n > MAX_PLAINTEXT:
            raise LocalProtocolError(f"seal at most {MAX_PLAINTEXT} bytes at a time")
        end = HEADER_BYTES + n + TAG_BYTES
        if len(out) < end:
            raise LocalProtocolError(f"a record of {n} bytes needs a buffer of {end}")
        view = memoryview(out)
        _LEN.pack_into(view, 0, n + TAG_BYTES)
        nonce = _nonce(self._direction, self._counter)
        self._aead.encrypt_into(nonce, plaintext, None, view[HEADER_BYTES:end])
        self._counter += 1
        return end


class Opener:
    """Opens the partner's records, in order. The reader takes the 4-byte length, asks
    `check_length`, reads exactly that many bytes, then calls `open`."""

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

    def open_into(self, record: bytes | bytearray | memoryview, out: memoryview) -> int:
        """Open `record` into the start of `out` (at least len(record) - TAG_BYTES bytes);
        return the plaintext's size. On RemoteProtocolError `out` holds garbage."""
        n = len(record) - TAG_BYTES
        if n < 0:
            raise RemoteProtocolError(f"lane record of {len(record)} bytes has no room for a tag")
        if len(out) < n:
            raise LocalProtocolError(f"a record of {len(record)} bytes needs {n} bytes of room")
        try:
            nonce = _nonce(self._direction, self._counter)
            self._aead.decrypt_into(nonce, record, None, out[:n])
        except InvalidTag:
            raise RemoteProtocolError("lane record failed authentication") from None
        self._counter += 1
        return n
