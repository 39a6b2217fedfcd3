"""Signed DHT records: `/ptpeer/<peer-id>` says where a peer listens and which run it serves.

The key names the writer, and the value carries the writer's Ed25519 signature over
(key, seq, body), so a record can only be written by the peer it describes and cannot be
moved to another key. Among valid records for one key the highest `seq` (the writer's
milliseconds clock) wins. Values are msgpack, at most MAX_BYTES.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from protocols import keys
from protocols.errors import RemoteProtocolError
from protocols.limits import StreamLimits

NAMESPACE = "ptpeer"
MAX_BYTES = 8192

#: One DHT value, checked on its length before msgpack sees it.
LIMITS = StreamLimits(f"/{NAMESPACE}/<peer-id> DHT record", MAX_BYTES, framed=False,
                      note="the DHT query's")


def peer_key(peer_id: str) -> str:
    return f"/{NAMESPACE}/{peer_id}"


@dataclass(frozen=True, slots=True)
class PeerRecord:
    peer_id: str
    seq: int
    addrs: tuple[str, ...]
    runs: tuple[str, ...]


def _signed_bytes(key: str, seq: int, body: dict) -> bytes:
    return msgpack.packb(["peertrain-record-v1", key, seq, body])


def encode(signer: keys.Signer, seq: int, addrs: list[str], runs: list[str]) -> bytes:
    key = peer_key(signer.peer_id)
    body = {"addrs": list(addrs), "runs": list(runs)}
    sig = signer.sign(_signed_bytes(key, seq, body))
    return msgpack.packb({"seq": seq, "body": body, "sig": sig})


def decode(key: str, value: bytes) -> PeerRecord:
    """Verify a record found under `key`; RemoteProtocolError says why it is refused."""
    if len(value) > MAX_BYTES:
        raise RemoteProtocolError(f"record of {len(value)} bytes exceeds {MAX_BYTES}")
    prefix = f"/{NAMESPACE}/"
    if not key.startswith(prefix):
        raise RemoteProtocolError(f"{key!r} is not in the /{NAMESPACE}/ namespace")
    peer_id = key[len(prefix):]
    try:
        doc = msgpack.unpackb(value, max_str_len=MAX_BYTES, max_bin_len=128,
                              max_array_len=64, max_map_len=16)
        seq, body, sig = doc["seq"], doc["body"], doc["sig"]
        addrs, runs = body["addrs"], body["runs"]
    except Exception as e:
        raise RemoteProtocolError(f"malformed record under {key}: {e!r}") from e
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**63:
        raise RemoteProtocolError("record seq must be a non-negative int64")
    if not (isinstance(addrs, list) and isinstance(runs, list)
            and all(isinstance(x, str) for x in [*addrs, *runs])):
        raise RemoteProtocolError("record addrs and runs must be lists of strings")
    if not isinstance(sig, bytes) or not keys.verify(peer_id, _signed_bytes(key, seq, body), sig):
        raise RemoteProtocolError(f"record under {key} is not signed by {peer_id}")
    return PeerRecord(peer_id, seq, tuple(addrs), tuple(runs))


def select(key: str, values: list[bytes]) -> int:
    """Index of the newest valid record; invalid ones never win."""
    best, best_seq = 0, -1
    for i, value in enumerate(values):
        try:
            seq = decode(key, value).seq
        except RemoteProtocolError:
            continue
        if seq > best_seq:
            best, best_seq = i, seq
    return best
