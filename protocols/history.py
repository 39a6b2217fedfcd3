"""The signed wire form of one SybilWall history entry (`/peertrain/sybilwall/1.0.0`).

The peer that received the subject's model directly, its *observer*, signs
(run, subject, observer, round, sha256 of the vector's fp32 little-endian bytes). Whoever
forwards the entry later keeps that signature and only changes `distance`, which is not
signed because it grows by one per hop (the receiver bounds it instead). So a peer can
forward histories but not invent one in another peer's name.

    msgpack map {"v": 1, "run": str, "subject": str, "observer": str, "round": int,
                 "distance": int, "vector": bytes (n x f32 LE), "sig": bytes (64)}

`decode_history` checks the message size before unpacking, every field's type, the run, the
vector's length (before it is turned into a tensor) and values, and the signature;
HistoryError (a RemoteProtocolError) says what was wrong. No I/O here.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import msgpack
import torch

from protocols import keys
from protocols.errors import RemoteProtocolError

VERSION = 1
MAX_ID = 128  # characters of a run or peer id
MAX_ROUND = 2**63 - 1


class HistoryError(RemoteProtocolError):
    """A history entry we refuse: the message says why."""


@dataclass(frozen=True)
class SignedHistory:
    run: str
    subject: str
    observer: str
    round: int
    distance: int
    vector: torch.Tensor  # flat fp32
    sig: bytes


def _signed(run: str, subject: str, observer: str, round: int, digest: bytes) -> bytes:
    return msgpack.packb(["peertrain-history-v1", run, subject, observer, round, digest])


def _vector_bytes(vector: torch.Tensor) -> bytes:
    return vector.detach().reshape(-1).to(torch.float32).contiguous().numpy().tobytes()


def encode_history(signer: keys.Signer, run: str, subject: str, round: int, distance: int,
                   vector: torch.Tensor) -> bytes:
    """An entry we observed ourselves, signed by us."""
    raw = _vector_bytes(vector)
    sig = signer.sign(_signed(run, subject, signer.peer_id, round,
                              hashlib.sha256(raw).digest()))
    return _pack(run, subject, signer.peer_id, round, distance, raw, sig)


def forward_history(msg: SignedHistory, distance: int) -> bytes:
    """A gossiped entry passed on with its observer's signature, at our distance."""
    return _pack(msg.run, msg.subject, msg.observer, msg.round, distance,
                 _vector_bytes(msg.vector), msg.sig)


def _pack(run: str, subject: str, observer: str, round: int, distance: int, raw: bytes,
          sig: bytes) -> bytes:
    return msgpack.packb({"v": VERSION, "run": run, "subject": subject, "observer": observer,
                          "round": round, "distance": distance, "vector": raw, "sig": sig})


def decode_history(data: bytes, *, run_id: str, expected_len: int,
                   max_bytes: int) -> SignedHistory:
    """Verify and decode one entry; HistoryError says why it is refused."""
    if len(data) > max_bytes:
        raise HistoryError(f"history message of {len(data)} bytes exceeds {max_bytes}")
    try:
        doc = msgpack.unpackb(data, max_str_len=MAX_ID, max_bin_len=max(64, 4 * expected_len),
                              max_array_len=0, max_map_len=8, strict_map_key=True)
    except Exception as e:
        raise HistoryError(f"malformed history message: {type(e).__name__}") from None
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise HistoryError(f"not a version-{VERSION} history message")
    run, subject, observer = doc.get("run"), doc.get("subject"), doc.get("observer")
    round_, distance = doc.get("round"), doc.get("distance")
    raw, sig = doc.get("vector"), doc.get("sig")
    if not all(isinstance(x, str) and x for x in (run, subject, observer)):
        raise HistoryError("run, subject and observer must be non-empty strings")
    if run != run_id:
        raise HistoryError(f"entry for another run ({run[:16]}...)")
    for name, value in (("round", round_), ("distance", distance)):
        if type(value) is not int or not 0 <= value <= MAX_ROUND:
            raise HistoryError(f"{name} must be a non-negative int64")
    if not isinstance(raw, bytes) or len(raw) != 4 * expected_len:
        size = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise HistoryError(f"vector of {size} bytes; {expected_len} values take "
                           f"{4 * expected_len}")
    if not isinstance(sig, bytes) or len(sig) != 64:
        raise HistoryError("signature must be 64 bytes")
    try:
        ok = keys.verify(observer, _signed(run, subject, observer, round_,
                                           hashlib.sha256(raw).digest()), sig)
    except Exception:
        ok = False
    if not ok:
        raise HistoryError(f"bad signature: not signed by its observer {observer[-8:]}")
    vector = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    if expected_len and not math.isfinite(float(vector.abs().max())):
        raise HistoryError("history vector holds NaN or Inf")
    return SignedHistory(run, subject, observer, round_, distance, vector, sig)
