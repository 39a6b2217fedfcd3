"""`/peertrain/avg/1.0.0`: one symmetric pairwise exchange of flat weight vectors.

Both peers send their current parameter vector θ for round r and receive the partner's.
Messages are wire frames (protocols/wire.py):

    initiator -> avg.offer  {run, round, numel, codecs: [preferred first], chunk, lanes}
    responder -> avg.accept {round, codec, lane?}  |  avg.reject {round, reason}
    both      -> tensor frames "theta/0", "theta/1", ... (`chunk` values each, in order,
                 encoded with the accepted codec, protocols/codecs.py), then
                 avg.done {round, frames}

States (`Exchange.state`), one table per role; anything else is a RemoteProtocolError and
the exchange is dead:

    initiator: IDLE --initiate()--> OFFERED --Accepted--> SWAPPING --PeerDone--> DONE
                                    OFFERED --Rejected--> CLOSED
    responder: IDLE --OfferReceived--> DECIDING --accept()--> SWAPPING --PeerDone--> DONE
                                       DECIDING --reject()--> CLOSED

Lanes: if the offer lists "tcp+aes256gcm" and the responder agrees, its accept carries a
TCP port and a fresh 32-byte key, and everything after the accept (tensor frames and done,
both ways) travels on that TCP connection sealed with AES-256-GCM (protocols/lane.py)
instead of the libp2p stream: the same bytes, several times faster than Noise + Yamux in
Python.

Limits: `max_numel` (the offer's size is refused above it before anything is allocated;
the receive buffer is allocated once, at accept), chunks of at most MAX_CHUNK values,
envelopes of at most 64 KiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from protocols import codecs
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.wire import (
    NEED_DATA,
    Envelope,
    FrameDecoder,
    TensorFrame,
    encode_envelope,
    encode_tensor_frame,
    make_tensor_header,
)

PROTOCOL_ID = "/peertrain/avg/1.0.0"
DEFAULT_CHUNK = 1 << 20  # values per tensor frame: 4 MiB of fp32
MAX_CHUNK = 1 << 24
MAX_ENVELOPE = 64 * 1024
DEFAULT_MAX_NUMEL = 1 << 31

negotiate = codecs.negotiate


LANE_TCP = "tcp+aes256gcm"


@dataclass(frozen=True, slots=True)
class OfferReceived:
    round: int
    numel: int
    codecs: list[str]
    chunk: int
    lanes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Lane:
    """Where the tensors go after the accept: a TCP port on the responder, and the key."""

    kind: str
    port: int
    key: bytes


@dataclass(frozen=True, slots=True)
class Accepted:
    codec: str
    lane: Lane | None = None


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str


@dataclass(frozen=True, slots=True)
class ChunkReceived:
    index: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PeerDone:
    frames: int


class Exchange:
    def __init__(self, role: str, run_id: str, round: int | None, numel: int | None,
                 offered_codecs: list[str], *, chunk: int = DEFAULT_CHUNK,
                 max_numel: int = DEFAULT_MAX_NUMEL, lanes: tuple[str, ...] = ()) -> None:
        if role not in ("initiator", "responder"):
            raise LocalProtocolError(f"unknown role {role!r}")
        if role == "initiator" and (round is None or numel is None):
            raise LocalProtocolError("an initiator knows its round and size")
        self.role, self.run_id = role, run_id
        self.round, self.numel = round, numel
        self.codecs = [c for c in offered_codecs if c in codecs.CODECS] or ["fp32"]
        self.chunk, self.max_numel = chunk, max_numel
        self.lanes = lanes
        self.codec: str | None = None
        self.state = "IDLE"
        self._decoder = FrameDecoder(max_frame_bytes=MAX_ENVELOPE,
                                     max_tensor_bytes=codecs.encoded_size("int8", MAX_CHUNK)
                                     + 4 * MAX_CHUNK, allowed_codecs=frozenset(codecs.CODECS))
        self._received: torch.Tensor | None = None
        self._next_index = 0
        self._filled = 0
        self._dead: RemoteProtocolError | None = None

    # -- sending ------------------------------------------------------------------------

    def initiate(self) -> bytes:
        self._expect_state("IDLE", "initiator")
        self.state = "OFFERED"
        return encode_envelope(Envelope("avg.offer", self.round or 0, {
            "run": self.run_id, "round": self.round, "numel": self.numel,
            "codecs": self.codecs, "chunk": self.chunk, "lanes": list(self.lanes)}))

    def accept(self, codec: str, lane: Lane | None = None) -> bytes:
        self._expect_state("DECIDING", "responder")
        if codec not in codecs.CODECS:
            raise LocalProtocolError(f"unknown codec {codec!r}")
        self._start_swap(codec)
        body: dict[str, Any] = {"round": self.round, "codec": codec}
        if lane is not None:
            body["lane"] = {"kind": lane.kind, "port": lane.port, "key": lane.key}
        return encode_envelope(Envelope("avg.accept", self.round or 0, body))

    def reject(self, reason: str) -> bytes:
        self._expect_state("DECIDING", "responder")
        self.state = "CLOSED"
        return encode_envelope(Envelope("avg.reject", self.round or 0,
                                        {"round": self.round, "reason": reason[:200]}))

    def send_vector(self, vec: torch.Tensor) -> list[bytes | memoryview]:
        """Every frame of our vector plus avg.done, as one gather list."""
        if self.state not in ("SWAPPING", "DONE") or self.codec is None:
            raise LocalProtocolError("send_vector before the offer was accepted")
        if vec.numel() != self.numel:
            raise LocalProtocolError(f"vector has {vec.numel()} values, exchange is {self.numel}")
        flat = vec.detach().to(torch.float32).contiguous().view(-1)
        out: list[bytes | memoryview] = []
        frames = 0
        for frames, start in enumerate(range(0, flat.numel(), self.chunk), start=1):
            enc = codecs.encode(flat[start:start + self.chunk], self.codec)
            header = make_tensor_header(f"theta/{frames - 1}", "uint8", (len(enc.payload),),
                                        self.codec, enc.payload)
            out.extend(encode_tensor_frame(header, enc.payload))
        out.append(encode_envelope(Envelope("avg.done", self.round or 0,
                                            {"round": self.round, "frames": frames})))
        return out

    # -- receiving ----------------------------------------------------------------------

    def receive_data(self, data: bytes | memoryview) -> None:
        self._decoder.feed(data)

    def next_event(self) -> Any:
        if self._dead is not None:
            raise self._dead
        try:
            frame = self._decoder.next_event()
            if frame is NEED_DATA:
                return NEED_DATA
            return self._handle(frame)
        except RemoteProtocolError as e:
            self._dead = e
            self.state = "DEAD"
            raise

    def received_vector(self) -> torch.Tensor:
        if self.state != "DONE" or self._received is None:
            raise LocalProtocolError("the partner's vector is not complete")
        return self._received

    # -- internals ----------------------------------------------------------------------

    def _handle(self, frame: Envelope | TensorFrame) -> Any:
        if isinstance(frame, TensorFrame):
            return self._on_chunk(frame)
        body = frame.body if isinstance(frame.body, dict) else {}
        kind = frame.type
        if kind == "avg.offer" and self.role == "responder" and self.state == "IDLE":
            return self._on_offer(body)
        if kind == "avg.accept" and self.state == "OFFERED":
            self._check_round(body)
            codec = body.get("codec")
            if codec not in self.codecs:
                raise RemoteProtocolError(
                    f"partner chose codec {codec!r}, we offered {self.codecs}")
            lane = _parse_lane(body.get("lane"), self.lanes)
            self._start_swap(codec)
            return Accepted(codec, lane)
        if kind == "avg.reject" and self.state == "OFFERED":
            self.state = "CLOSED"
            return Rejected(str(body.get("reason", ""))[:200])
        if kind == "avg.done" and self.state == "SWAPPING":
            self._check_round(body)
            if body.get("frames") != self._next_index or self._filled != self.numel:
                raise RemoteProtocolError(f"partner finished after {self._next_index} frames "
                                          f"({self._filled} of {self.numel} values)")
            self.state = "DONE"
            return PeerDone(self._next_index)
        raise RemoteProtocolError(f"unexpected {kind!r} in state {self.state}")

    def _on_offer(self, body: dict) -> OfferReceived:
        r, numel, offered, chunk = (body.get(k) for k in ("round", "numel", "codecs", "chunk"))
        if body.get("run") != self.run_id:
            raise RemoteProtocolError(f"offer for another run ({str(body.get('run'))[:60]})")
        if not _is_int(r) or r < 0:
            raise RemoteProtocolError("offer without a valid round")
        if not _is_int(numel) or not 0 < numel <= self.max_numel:
            raise RemoteProtocolError(f"offer of {numel!r} values (limit {self.max_numel})")
        if not _is_int(chunk) or not 0 < chunk <= MAX_CHUNK:
            raise RemoteProtocolError(f"chunk of {chunk!r} values (limit {MAX_CHUNK})")
        if not isinstance(offered, list) or not all(isinstance(c, str) for c in offered):
            raise RemoteProtocolError("offer codecs must be a list of strings")
        lanes = body.get("lanes", [])
        if not isinstance(lanes, list):
            raise RemoteProtocolError("offer lanes must be a list")
        self.round, self.numel, self.chunk = r, numel, chunk
        self.state = "DECIDING"
        return OfferReceived(r, numel, offered[:16], chunk,
                             tuple(x for x in lanes[:8] if isinstance(x, str)))

    def _start_swap(self, codec: str) -> None:
        assert self.numel is not None
        self.codec = codec
        self.state = "SWAPPING"
        self._received = torch.empty(self.numel, dtype=torch.float32)

    def _on_chunk(self, frame: TensorFrame) -> ChunkReceived:
        if self.state != "SWAPPING" or self._received is None:
            raise RemoteProtocolError(f"tensor frame in state {self.state}")
        h = frame.header
        if h.name != f"theta/{self._next_index}":
            raise RemoteProtocolError(f"expected theta/{self._next_index}, got {h.name[:40]!r}")
        if h.dtype != "uint8" or len(h.shape) != 1:
            raise RemoteProtocolError(f"frame of dtype {h.dtype} shape {list(h.shape)[:4]}; "
                                      "encoded chunks travel as 1-d uint8")
        if h.codec != self.codec:
            raise RemoteProtocolError(f"frame codec {h.codec!r}, agreed {self.codec!r}")
        count = min(self.chunk, self.numel - self._filled)
        if count <= 0:
            raise RemoteProtocolError("more frames than the vector has values")
        codecs.decode(self.codec, count, frame.payload,
                      out=self._received[self._filled:self._filled + count])
        self._filled += count
        self._next_index += 1
        return ChunkReceived(self._next_index - 1, len(frame.payload))

    def _check_round(self, body: dict) -> None:
        if body.get("round") != self.round:
            raise RemoteProtocolError(f"message for round {body.get('round')!r}, "
                                      f"exchange is round {self.round}")

    def _expect_state(self, state: str, role: str) -> None:
        if self.state != state or self.role != role:
            raise LocalProtocolError(f"{role} call in state {self.state} as {self.role}")


def _parse_lane(doc: Any, offered: tuple[str, ...]) -> Lane | None:
    if doc is None:
        return None
    if not isinstance(doc, dict) or doc.get("kind") not in offered:
        raise RemoteProtocolError("partner chose a lane we did not offer")
    port, key = doc.get("port"), doc.get("key")
    if not _is_int(port) or not 0 < port < 65536 or not isinstance(key, bytes) or len(key) != 32:
        raise RemoteProtocolError("lane needs a TCP port and a 32-byte key")
    return Lane(doc["kind"], port, key)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
