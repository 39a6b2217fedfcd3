"""`/peertrain/webrtc-signal/1.0.0`: SDP offer/answer for a WebRTC data channel.

Two peers that reach each other only through a relay (node/webrtc/) exchange one offer
and one answer over the relayed libp2p connection, in wire envelopes
(protocols/wire.py). aiortc gathers every ICE candidate before it writes its description,
so there is no trickle: one round trip.

    -> webrtc.offer   {"sdp": str}
    <- webrtc.answer  {"sdp": str}
    <- error          {"code": "busy" | "bad-offer" | "refused", "message": str}

The peer with the smaller peer id offers (both sides agree without a message). The SDP is
opaque text here; aiortc parses it, and refuses it if it cannot (`bad-offer`). It is
bounded: a data-channel-only description is ~1 KB plus ~100 B per candidate.
"""

from __future__ import annotations

from protocols.errors import RemoteProtocolError
from protocols.limits import StreamLimits
from protocols.wire import Envelope, encode_envelope

PROTOCOL_ID = "/peertrain/webrtc-signal/1.0.0"
MAX_SDP = 16 * 1024
MAX_ENVELOPE = MAX_SDP + 1024
#: ICE gathering (a STUN round trip per interface) runs before the answer is written.
DEADLINE_S = 20.0
CODES = ("busy", "bad-offer", "refused")

#: Both directions: one envelope holding one description, never a tensor.
LIMITS = StreamLimits(PROTOCOL_ID, MAX_ENVELOPE, deadline_s=DEADLINE_S)


def encode_offer(req_id: int, sdp: str) -> bytes:
    return encode_envelope(Envelope("webrtc.offer", req_id, {"sdp": _check_local(sdp)}))


def encode_answer(req_id: int, sdp: str) -> bytes:
    return encode_envelope(Envelope("webrtc.answer", req_id, {"sdp": _check_local(sdp)}))


def encode_error(req_id: int, code: str, message: str) -> bytes:
    return encode_envelope(Envelope("error", req_id, {"code": code, "message": message[:200]}))


def _check_local(sdp: str) -> str:
    if len(sdp.encode()) > MAX_SDP:
        raise ValueError(f"our own SDP is {len(sdp.encode())} bytes, over {MAX_SDP}")
    return sdp


def _sdp(env: Envelope, kind: str) -> str:
    if env.type != kind or not isinstance(env.body, dict):
        raise RemoteProtocolError(f"expected {kind}, got {str(env.type)[:40]!r}")
    sdp = env.body.get("sdp")
    if not isinstance(sdp, str):
        raise RemoteProtocolError(f"{kind} without an SDP string")
    if len(sdp.encode()) > MAX_SDP:
        raise RemoteProtocolError(f"{kind}: SDP of {len(sdp.encode())} bytes, over {MAX_SDP}")
    if not sdp.startswith("v=0"):
        raise RemoteProtocolError(f"{kind}: not a session description (no 'v=0')")
    if "\nm=application " not in sdp:
        raise RemoteProtocolError(f"{kind}: no data channel section (m=application)")
    return sdp


def parse_offer(env: Envelope) -> str:
    """The offered SDP; RemoteProtocolError if the message is not a bounded offer."""
    return _sdp(env, "webrtc.offer")


def parse_answer(env: Envelope, req_id: int) -> str:
    """The answer to our offer `req_id`; LookupError carries the peer's refusal."""
    if env.id != req_id:
        raise RemoteProtocolError(f"answer id {env.id} does not match offer {req_id}")
    if env.type == "error":
        body = env.body if isinstance(env.body, dict) else {}
        raise LookupError(f"peer refused: {str(body.get('code', '?'))[:40]}: "
                          f"{str(body.get('message', ''))[:200]}")
    return _sdp(env, "webrtc.answer")
