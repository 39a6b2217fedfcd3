"""Content ids: base58btc(multihash sha2-256(bytes)), the "Qm..." strings of run-ids and
checkpoint ids. One definition, so the two cannot drift apart."""

from __future__ import annotations

import hashlib
from typing import Final

import base58

SHA256_PREFIX: Final = b"\x12\x20"  # multihash code sha2-256, digest length 32
ID_LENGTH: Final = 46  # base58 of 34 bytes starting 0x12 0x20 is always 46 characters
BASE58_ALPHABET: Final = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


def sha256_id(data: bytes | memoryview) -> str:
    return base58.b58encode(SHA256_PREFIX + hashlib.sha256(data).digest()).decode()


def is_sha256_id(text: str) -> bool:
    """Well formed (46 base58 characters decoding to a sha2-256 multihash); says nothing
    about which bytes it names."""
    if len(text) != ID_LENGTH or not set(text) <= BASE58_ALPHABET:
        return False
    raw = base58.b58decode(text)
    return len(raw) == 34 and raw[:2] == SHA256_PREFIX
