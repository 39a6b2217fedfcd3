"""`/peertrain/ckpt/1.0.0`: fetch a checkpoint's manifest and chunks from a peer.

    -> ckpt.manifest {cid}            <- ckpt.manifest {cid, data}   (manifest bytes)
    -> ckpt.chunk {cid, index}        <- ckpt.chunk {cid, index, data}
    <- error {code: "unknown" | "bad-request", message}

One stream carries any number of requests, one at a time. The asker verifies everything:
manifest bytes against the cid, chunk bytes against the manifest's sha256
(node/checkpoints/exchange.py).

The chunks' fast path is a bulk lane (protocols/lane.py), asked for on the stream:

    -> ckpt.lane {cid}                <- ckpt.lane {cid, port, key}  (or error)

The asker connects to `port` and proves it holds `key` (node/transport/lane.py). On the lane each
record is one message: the asker sends `ckpt.chunk {cid, index}` requests, several in
flight, and the server answers them in order, each with a header record

    ckpt.chunk {cid, index, size}     (or error {code, message}: not held here)

followed by the chunk's `size` bytes in records of at most 4 MiB (no envelope, no copy:
they are opened straight into the asker's chunk buffer). `size` is checked against what
the manifest says that chunk has before a byte is read, and the bytes against its sha256.
Why a lane: a provider is usually a trainer, and py-libp2p's Noise + Yamux served a
checkpoint at ~10 MB/s beside the trainer thread, one chunk per round trip
(docs/benchmarks.md, "Joining mid-run").
"""

from __future__ import annotations

from typing import Any

from protocols.checkpoint import CHUNK_BYTES
from protocols.errors import RemoteProtocolError
from protocols.lane import KEY_BYTES
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
#: What the asker reads on a lane before a chunk's bytes: one small header per record.
LANE_HEADER_LIMITS = StreamLimits(PROTOCOL_ID + " lane chunk header", MAX_REQUEST,
                                  deadline_s=DEADLINE_S)


def request_manifest(req_id: int, cid: str) -> bytes:
    return encode_envelope(Envelope("ckpt.manifest", req_id, {"cid": cid}))


def request_chunk(req_id: int, cid: str, index: int) -> bytes:
    return encode_envelope(Envelope("ckpt.chunk", req_id, {"cid": cid, "index": index}))


def request_lane(req_id: int, cid: str) -> bytes:
    return encode_envelope(Envelope("ckpt.lane", req_id, {"cid": cid}))


def parse_request(env: Envelope) -> tuple[str, str, int | None]:
    """(kind, cid, index) of a request; RemoteProtocolError if malformed."""
    body = env.body if isinstance(env.body, dict) else {}
    cid, index = body.get("cid"), body.get("index")
    if env.type not in ("ckpt.manifest", "ckpt.chunk", "ckpt.lane") \
            or not isinstance(cid, str) or len(cid) > 64:
        raise RemoteProtocolError(f"bad checkpoint request {env.type!r}")
    if env.type == "ckpt.chunk" and not (isinstance(index, int) and 0 <= index < 1 << 24):
        raise RemoteProtocolError("chunk request without a valid index")
    return env.type, cid, index if env.type == "ckpt.chunk" else None


def refuse(env: Envelope, message: str = "not held here", code: str = "unknown") -> bytes:
    return encode_envelope(Envelope("error", env.id, {"code": code, "message": message}))


def respond(env: Envelope, data: bytes | None, index: int | None = None) -> bytes:
    if data is None:
        return refuse(env)
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


def respond_lane(env: Envelope, port: int, key: bytes) -> bytes:
    return encode_envelope(Envelope("ckpt.lane", env.id, {"cid": env.body["cid"],
                                                          "port": port, "key": key}))


def parse_lane(env: Envelope, req_id: int) -> tuple[int, bytes]:
    """(port, key) of a lane offer; LookupError if refused, RemoteProtocolError if bad."""
    if env.id != req_id:
        raise RemoteProtocolError(f"response {env.id} to request {req_id}")
    body = env.body if isinstance(env.body, dict) else {}
    if env.type == "error":
        raise LookupError(str(body.get("message", "error"))[:200])
    port, key = body.get("port"), body.get("key")
    if env.type != "ckpt.lane" or not (isinstance(port, int) and 0 < port < 65536) \
            or not (isinstance(key, bytes) and len(key) == KEY_BYTES):
        raise RemoteProtocolError(f"bad lane offer {env.type!r}")
    return port, key


def chunk_header(env: Envelope, size: int) -> bytes:
    """The lane's answer to a chunk request; `size` bytes of the chunk follow it."""
    return encode_envelope(Envelope("ckpt.chunk", env.id, {"cid": env.body["cid"],
                                                           "index": env.body["index"],
                                                           "size": size}))


def parse_chunk_header_record(record: bytes | memoryview, req_id: int, index: int,
                              expected: int) -> None:
    """A lane record that must hold exactly one chunk header envelope; checked as below."""
    if len(record) < 4 or int.from_bytes(record[:4], "big") + 4 != len(record):
        raise RemoteProtocolError("a lane chunk header must be one envelope in one record")
    decoder = LANE_HEADER_LIMITS.decoder()
    decoder.feed(record)
    env = decoder.next_event()
    if not isinstance(env, Envelope):
        raise RemoteProtocolError("a lane chunk header must be an envelope")
    parse_chunk_header(env, req_id, index, expected)


def parse_chunk_header(env: Envelope, req_id: int, index: int, expected: int) -> None:
    """Check a lane's chunk header against the request and the manifest's size for that
    chunk (`expected`): LookupError if not held, RemoteProtocolError if anything differs."""
    if env.id != req_id:
        raise RemoteProtocolError(f"response {env.id} to request {req_id}")
    body = env.body if isinstance(env.body, dict) else {}
    if env.type == "error":
        raise LookupError(str(body.get("message", "error"))[:200])
    if env.type != "ckpt.chunk" or body.get("index") != index:
        raise RemoteProtocolError(f"expected chunk {index}, got {env.type!r} "
                                  f"{body.get('index')!r}")
    if body.get("size") != expected:
        raise RemoteProtocolError(f"chunk {index} of {body.get('size')!r} bytes; the "
                                  f"manifest says {expected}")
