"""The signed wire form of one SybilWall history entry (`/peertrain/sybilwall/1.0.0`).

The peer that received the subject's model directly, its *observer*, signs
(run, subject, observer, round, sha256 of the vector's fp32 little-endian bytes). Whoever
forwards the entry later keeps that signature and only changes `distance`, which is not
signed because it grows by one per hop (the receiver bounds it instead). So a peer can
forward histories but not invent one in another peer's name. One entry per message:

    msgpack map {"v": 1, "run": str, "subject": str, "observer": str, "round": int,
                 "distance": int >= 1, "vector": bytes (n x f32 LE), "sig": bytes (64)}

`decode_history` checks the message size before unpacking (and msgpack's own limits bound
every string and byte field while it unpacks), every field's type, the run, the vector's
length before it becomes a tensor, the observer's key and signature, then the values.
HistoryError (a RemoteProtocolError) says what was wrong. No I/O here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from protocols import keys
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.limits import StreamLimits

PROTOCOL_ID = "/peertrain/sybilwall/1.0.0"
VERSION = 1
MAX_ID = 128  # characters of a run or peer id (an Ed25519 peer id has 52)
MAX_INT = 2**63 - 1  # rounds and distances are int64 on the wire
_DOMAIN = "peertrain-history-v1"  # a history signature can never pass for another message's
_OVERHEAD = 3 * MAX_ID + keys.SIGNATURE_BYTES + 256  # ids, signature, msgpack framing

#: One entry per stream, read to its end: the vector (4 B per model value) and the rest.
#: `LIMITS.for_model(numel).max_envelope_bytes` is what `decode_history` takes as max_bytes.
LIMITS = StreamLimits(PROTOCOL_ID, _OVERHEAD, framed=False, per_value_bytes=4,
                      deadline_s=10.0)


class HistoryError(RemoteProtocolError):
    """A history entry we refuse: the message says why."""


@dataclass(frozen=True, slots=True)
class SignedHistory:
    run: str
    subject: str  # whose history
    observer: str  # who received the subject's model and signed this
    round: int
    distance: int  # hops from the sender of this message (1: the sender observed it)
    vector: torch.Tensor  # flat fp32
    sig: bytes


def _signed(run: str, subject: str, observer: str, round: int, digest: bytes) -> bytes:
    return msgpack.packb([_DOMAIN, run, subject, observer, round, digest])


def _vector_bytes(vector: torch.Tensor) -> bytes:
    array = vector.detach().reshape(-1).to(torch.float32).cpu().numpy()
    return array.astype("<f4", copy=False).tobytes()


def encode_history(
    signer: keys.Signer, run: str, subject: str, round: int, distance: int, vector: torch.Tensor
) -> bytes:
    """An entry we observed ourselves (usually at distance 1), signed by us."""
    if subject == signer.peer_id:
        raise LocalProtocolError("a peer does not observe its own history")
    raw = _vector_bytes(vector)
    if not np.isfinite(np.frombuffer(raw, dtype="<f4")).all():
        raise LocalProtocolError("refusing to send a history with NaN or Inf")
    sig = signer.sign(_signed(run, subject, signer.peer_id, round, hashlib.sha256(raw).digest()))
    return _pack(run, subject, signer.peer_id, round, distance, raw, sig)


def forward_history(msg: SignedHistory, distance: int) -> bytes:
    """A gossiped entry passed on with its observer's signature, at our distance."""
    raw = _vector_bytes(msg.vector)
    return _pack(msg.run, msg.subject, msg.observer, msg.round, distance, raw, msg.sig)


def _pack(
    run: str, subject: str, observer: str, round: int, distance: int, raw: bytes, sig: bytes
) -> bytes:
    if type(round) is not int or not 0 <= round <= MAX_INT:
        raise LocalProtocolError(f"round {round!r} is not a non-negative int64")
    if type(distance) is not int or not 1 <= distance <= MAX_INT:
        raise LocalProtocolError(f"distance {distance!r} is not a positive int64")
    doc = {
        "v": VERSION,
        "run": run,
        "subject": subject,
        "observer": observer,
        "round": round,
        "distance": distance,
        "vector": raw,
        "sig": sig,
    }
    return msgpack.packb(doc)


def max_message_bytes(expected_len: int) -> int:
    """The largest honest message for histories of `expected_len` values (a cap to pass
    as `max_bytes`): the vector, three ids, the signature and msgpack framing."""
    return LIMITS.for_model(expected_len).max_envelope_bytes


def decode_history(data: bytes, *, run_id: str, expected_len: int, max_bytes: int) -> SignedHistory:
    """Verify and decode one entry; HistoryError says why it is refused."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise LocalProtocolError(f"decode_history takes bytes, not {type(data).__name__}")
    if len(data) > max_bytes:  # before msgpack allocates anything
        raise HistoryError(f"history message of {len(data)} bytes exceeds {max_bytes}")
    try:
        doc = msgpack.unpackb(
            data,
            max_str_len=MAX_ID,
            max_bin_len=max(keys.SIGNATURE_BYTES, 4 * expected_len),
            max_array_len=0,
            max_map_len=16,
            max_ext_len=0,
            strict_map_key=True,
        )
    except Exception as e:  # msgpack raises several types for truncated or bad input
        raise HistoryError(f"malformed history message ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise HistoryError(f"history message is a {type(doc).__name__}, not a map")
    version = doc.get("v")
    if type(version) is not int or version != VERSION:
        raise HistoryError(f"unknown history message version {version!r:.20} (we speak 1)")
    run, subject, observer = doc.get("run"), doc.get("subject"), doc.get("observer")
    if not (isinstance(run, str) and isinstance(subject, str) and isinstance(observer, str)
            and run and subject and observer):
        raise HistoryError("run, subject and observer must be non-empty strings")
    if run != run_id:
        raise HistoryError(f"entry for another run ({run:.16}...)")
    if subject == observer:
        raise HistoryError("an entry whose observer is its own subject")
    round_, distance = doc.get("round"), doc.get("distance")
    if type(round_) is not int or not 0 <= round_ <= MAX_INT:
        raise HistoryError(f"round must be a non-negative int64, not {round_!r:.20}")
    if type(distance) is not int or not 1 <= distance <= MAX_INT:
        raise HistoryError(f"distance must be a positive int64, not {distance!r:.20}")
    raw, sig = doc.get("vector"), doc.get("sig")
    if not isinstance(raw, bytes) or len(raw) != 4 * expected_len:
        size = f"{len(raw)} bytes" if isinstance(raw, bytes) else f"a {type(raw).__name__}"
        raise HistoryError(f"vector of {size}; {expected_len} values take {4 * expected_len}")
    if not isinstance(sig, bytes) or len(sig) != keys.SIGNATURE_BYTES:
        raise HistoryError(f"signature must be {keys.SIGNATURE_BYTES} bytes")
    try:
        keys.public_key_from_peer_id(observer)
    except RemoteProtocolError as e:
        raise HistoryError(f"observer: {e}") from None
    digest = hashlib.sha256(raw).digest()
    if not keys.verify(observer, _signed(run, subject, observer, round_, digest), sig):
        raise HistoryError(f"bad signature: not signed by its observer ...{observer[-8:]}")
    values = np.frombuffer(raw, dtype="<f4")
    if not np.isfinite(values).all():
        raise HistoryError("history vector holds NaN or Inf")
    vector = torch.from_numpy(values.astype(np.float32))  # a native, writable copy
    return SignedHistory(run, subject, observer, round_, distance, vector, sig)
