"""`/peertrain/manifest/1.0.0`: ask a peer for a run's manifest by run-id.

One request, one response, over wire envelopes (protocols/wire.py):

    -> manifest.get   {"run": <run-id>}
    <- manifest       {"run": <run-id>, "data": <canonical manifest bytes>}
    <- error          {"code": "unknown-run" | "bad-request", "message": str}

The asker verifies that `data` hashes to the run-id it asked for (protocols/manifest.py);
the response is never trusted on the server's word.
"""

from __future__ import annotations

from protocols import manifest as mf
from protocols.errors import RemoteProtocolError
from protocols.limits import StreamLimits
from protocols.wire import Envelope, encode_envelope

PROTOCOL_ID = "/peertrain/manifest/1.0.0"
MAX_FRAME = 128 * 1024  # a manifest is at most 64 KiB (protocols/manifest.py)
MAX_REQUEST = 4096  # manifest.get carries one run-id (~50 chars)
DEADLINE_S = 10.0

#: What the server reads: one small request, never a tensor.
REQUEST_LIMITS = StreamLimits(PROTOCOL_ID + " request", MAX_REQUEST, deadline_s=DEADLINE_S)
#: What the asker reads: the manifest's canonical bytes in one envelope, never a tensor.
RESPONSE_LIMITS = StreamLimits(PROTOCOL_ID + " response", MAX_FRAME, deadline_s=DEADLINE_S)


def encode_request(req_id: int, run_id: str) -> bytes:
    return encode_envelope(Envelope("manifest.get", req_id, {"run": run_id}))


def parse_request(env: Envelope) -> str:
    """The run-id a peer asked for; RemoteProtocolError if the request is malformed."""
    if env.type != "manifest.get" or not isinstance(env.body, dict):
        raise RemoteProtocolError(f"expected manifest.get, got {env.type!r}")
    run_id = env.body.get("run")
    if not isinstance(run_id, str):
        raise RemoteProtocolError("manifest.get without a run-id")
    try:
        return mf.validate_run_id(run_id)
    except mf.ManifestError as e:
        raise RemoteProtocolError(str(e)) from e


def encode_response(req_id: int, run_id: str, canonical: bytes) -> bytes:
    return encode_envelope(Envelope("manifest", req_id, {"run": run_id, "data": canonical}))


def encode_error(req_id: int, code: str, message: str) -> bytes:
    return encode_envelope(Envelope("error", req_id, {"code": code, "message": message}))


def parse_response(env: Envelope, req_id: int, run_id: str) -> mf.Manifest:
    """Check the response answers our request and hashes to `run_id`.

    Raises RemoteProtocolError for a malformed answer, `mf.ManifestMismatch` for bytes that
    are not the run's manifest, and LookupError when the peer does not hold the run.
    """
    if env.id != req_id:
        raise RemoteProtocolError(f"response id {env.id} does not match request {req_id}")
    body = env.body if isinstance(env.body, dict) else {}
    if env.type == "error":
        message = str(body.get("message", ""))[:200]
        raise LookupError(f"peer answered {body.get('code', '?')!s:.40}: {message}")
    if env.type != "manifest" or not isinstance(body.get("data"), bytes):
        raise RemoteProtocolError(f"expected a manifest, got {env.type!r}")
    return mf.parse_canonical(body["data"], expected_run_id=run_id)
