"""`/peertrain/ckpt/1.0.0`: fetch a checkpoint's manifest and chunks from a peer.

    -> ckpt.manifest {cid}            <- ckpt.manifest {cid, data}   (manifest bytes)
    -> ckpt.chunk {cid, index}        <- ckpt.chunk {cid, index, data}
    <- error {code: "unknown" | "bad-request", message}

One stream carries any number of requests, one at a time. The asker verifies everything:
manifest bytes against the cid, chunk bytes against the manifest's sha256
(node/checkpoints/exchange.py).
"""

from __future__ import annotations

from typing import Any

from protocols.checkpoint import CHUNK_BYTES
from protocols.errors import RemoteProtocolError
from protocols.limits import StreamLimits
from protocols.wire import Envelope, encode_envelope

PROTOCOL_ID = "/peertrain/ckpt/1.0.0"
MAX_FRAME = CHUNK_BYTES + 64 * 1024  # one chunk's bytes (msgpack bin) and its envelope
MAX_REQUEST = 4096  # ckpt.manifest / ckpt.chunk: a cid (<= 64 chars) and an index
DEADLINE_S = 30.0  # per request and per response (node/checkpoints/exchange.pull chunk_timeout)

#: What the server reads: small requests, any number in sequence, never a tensor.
REQUEST_LIMITS = StreamLimits(PROTOCOL_ID + " request", MAX_REQUEST, deadline_s=DEADLINE_S)
#: What the asker reads: a manifest or one chunk per envelope (bin, not a tensor frame).
RESPONSE_LIMITS = StreamLimits(PROTOCOL_ID + " response", MAX_FRAME, deadline_s=DEADLINE_S)


def request_manifest(req_id: int, cid: str) -> bytes:
    return encode_envelope(Envelope("ckpt.manifest", req_id, {"cid": cid}))


def request_chunk(req_id: int, cid: str, index: int) -> bytes:
    return encode_envelope(Envelope("ckpt.chunk", req_id, {"cid": cid, "index": index}))


def parse_request(env: Envelope) -> tuple[str, str, int | None]:
    """(kind, cid, index) of a request; RemoteProtocolError if malformed."""
    body = env.body if isinstance(env.body, dict) else {}
    cid, index = body.get("cid"), body.get("index")
    if env.type not in ("ckpt.manifest", "ckpt.chunk") or not isinstance(cid, str) \
            or len(cid) > 64:
        raise RemoteProtocolError(f"bad checkpoint request {env.type!r}")
    if env.type == "ckpt.chunk" and not (isinstance(index, int) and 0 <= index < 1 << 24):
        raise RemoteProtocolError("chunk request without a valid index")
    return env.type, cid, index if env.type == "ckpt.chunk" else None


def respond(env: Envelope, data: bytes | None, index: int | None = None) -> bytes:
    if data is None:
        return encode_envelope(Envelope("error", env.id, {"code": "unknown",
                                                          "message": "not held here"}))
    body: dict[str, Any] = {"cid": env.body["cid"], "data": data}
    if index is not None:
        body["index"] = index
    return encode_envelope(Envelope(env.type, env.id, body), max_frame_bytes=MAX_FRAME)


def parse_response(env: Envelope, req_id: int, kind: str) -> bytes:
    if env.id != req_id:
        raise RemoteProtocolError(f"response {env.id} to request {req_id}")
    body = env.body if isinstance(env.body, dict) else {}
    if env.type == "error":
        raise LookupError(str(body.get("message", "error"))[:200])
    if env.type != kind or not isinstance(body.get("data"), bytes):
        raise RemoteProtocolError(f"expected {kind}, got {env.type!r}")
    return body["data"]
