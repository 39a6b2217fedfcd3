"""`/peertrain/avg/1.0.0`: one symmetric pairwise exchange of flat weight vectors.

NoLoCo (specs/algorithms.md §1) needs only the current weights θ of each group member
(β = γ), so for round r both peers send their flat θ_r and receive the partner's. The full
spec, with the measured codecs, is docs/averaging-protocol.md. Messages are wire frames
(protocols/wire.py); every envelope's id is the round:

    initiator -> avg.offer  {run, round, numel, codecs: [preferred first], chunk, lanes}
    responder -> avg.accept {round, codec, lane?}  |  avg.reject {round, reason}
    both      -> tensor frames "theta/0", "theta/1", ...: frame k holds values
                 [k*chunk, min((k+1)*chunk, numel)) encoded with the accepted codec
                 (protocols/codecs.py; the header's dtype and shape describe the decoded
                 values), then avg.done {round, frames}

Both directions use the offer's `chunk`. Chunking bounds what one frame may allocate and
lets the receiver verify (size, NaN/Inf) as the vector arrives.

Codec "topk" (protocols/sparse.py; a run whose manifest says `outer.codec = "topk"`) sends
encoded sparse frames instead of a vector: a bundle of 1 (NoLoCo) to `max_bundle` (DiLoCo's
all-gather) of them, each as tensor frames of uint8 bytes in the codec "topk":

    "topk/i"    exactly sparse.HEADER_SIZE bytes: frame i's header
    "topk/i/j"  piece j of the rest of frame i: min(4 * chunk, what is left) bytes

The receiver checks frame i's header against the offer's numel and its run's bounds
(`sparse.frame_size`) before it allocates the frame, and every piece's length on its tensor
header before buffering it (pieces land in place); a whole frame is decoded and checked
(indices in range, strictly increasing, finite scales: `sparse.decode`) when its last piece
arrives. `received_frames()` returns the bundle, decoded.

States (`Exchange.state`) and their transitions are the data in `TRANSITIONS`: a peer
message with no entry for the current state is a RemoteProtocolError, a local call with
none a LocalProtocolError. After a RemoteProtocolError the exchange is DEAD: every later
call raises again, and the caller closes the stream.

    initiator: IDLE -initiate()-> OFFERED -avg.accept-> SWAPPING -avg.done-> DONE
                                  OFFERED -avg.reject-> CLOSED
    responder: IDLE -avg.offer-> DECIDING -accept()-> SWAPPING -avg.done-> DONE
                                 DECIDING -reject()-> CLOSED
    both:      SWAPPING -tensor frame-> SWAPPING; send_vector() once, in SWAPPING or DONE

Pairing is the caller's: a responder learns the offer's round and size from
`OfferReceived` and answers with `accept()` or `reject()` (node/averaging/service.py knows the
membership). A responder built with a round or a size refuses other offers itself.

Lanes: if the offer lists LANE_TCP and the responder agrees, its accept carries a TCP port
and a fresh 32-byte key, and everything after the accept (tensor frames and done, both
ways) travels on that TCP connection sealed with AES-256-GCM (protocols/lane.py) instead
of the libp2p stream: the same frames, several times faster than Noise + Yamux in Python,
except that their tensor headers leave out the crc32. GCM's tag already authenticates
every record, and the crc32 would cost a pass over the vector on each side. (Lane kind
"tcp+aes256gcm", version 1, kept the crc32; it is no longer offered or accepted, so an
older peer and this one exchange over the libp2p stream.)

Receiving: every tensor frame is checked on its header (order, codec, shape, size) before
its payload is buffered, and an fp32 payload is received straight into its slot of the
receive vector: no buffer of its own, no copy when it is decoded.

Limits (constructor arguments, checked before anything is allocated): `max_numel` values
per vector (the receive buffer, 4 bytes a value, is allocated once, when the codec is
agreed), `max_frames` frames per vector, chunks of at most MAX_CHUNK_ELEMS values (a
frame's payload may be at most `codecs.max_encoded_size(codec, chunk)` bytes, refused on
its header otherwise), envelopes of at most MAX_ENVELOPE_BYTES, offers of at most
MAX_OFFERED codecs and lanes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, TypeGuard

import torch

from protocols import codecs as _codecs  # `codecs` is also an Exchange argument
from protocols import sparse
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.limits import StreamLimits
from protocols.wire import (
    MAX_ID,
    NEED_DATA,
    Envelope,
    TensorFrame,
    TensorHeader,
    encode_envelope,
    encode_tensor_frame,
    make_tensor_header,
)

if TYPE_CHECKING:
    from protocols.wire import _NeedData

PROTOCOL_ID: Final = "/peertrain/avg/1.0.0"
LANE_TCP: Final = "tcp+aes256gcm/2"  # version 2: tensor headers without crc32

DEFAULT_CHUNK_ELEMS: Final = 1 << 20  # 4 MiB of fp32 per frame
MAX_CHUNK_ELEMS: Final = 1 << 24  # 64 MiB of fp32: the most one frame may make us buffer
DEFAULT_MAX_NUMEL: Final = 1 << 31  # an 8 GiB receive buffer
DEFAULT_MAX_FRAMES: Final = 1 << 16  # ~100 B of framing each: tiny chunks cannot flood us
MAX_ENVELOPE_BYTES: Final = 64 << 10
MAX_OFFERED: Final = 16  # codecs, or lanes, in one offer
MAX_REASON: Final = 200  # characters of a reject's reason that are kept
TOPK: Final = sparse.CODEC  # "topk": sparse frames, not a vector (module docstring)
MAX_BUNDLE: Final = 1024  # topk frames in one direction of one exchange (DiLoCo's all-gather)

#: The ceilings of one exchange's stream. An Exchange narrows them as it goes: no tensor
#: before a codec is agreed or after the peer's avg.done, then only the agreed codec and at
#: most one chunk's encoded size (`codecs.max_encoded_size(codec, chunk)`).
LIMITS: Final = StreamLimits(
    PROTOCOL_ID,
    MAX_ENVELOPE_BYTES,
    max(_codecs.max_encoded_size(c, MAX_CHUNK_ELEMS) for c in _codecs.CODECS),
    frozenset((*_codecs.CODECS, TOPK)),
    deadline_s=10.0,
    note="for the offer; the swap's is derived from the partner's measured rate",
)

negotiate = _codecs.negotiate

Role = Literal["initiator", "responder"]


class State(enum.StrEnum):
    IDLE = "IDLE"  # nothing sent or received yet
    OFFERED = "OFFERED"  # initiator: offer sent, waiting for accept or reject
    DECIDING = "DECIDING"  # responder: offer received, the caller must accept or reject
    SWAPPING = "SWAPPING"  # codec agreed: vectors flow both ways
    DONE = "DONE"  # the partner's vector arrived whole; received_vector() is ready
    CLOSED = "CLOSED"  # rejected: nothing more may arrive
    DEAD = "DEAD"  # the peer violated the protocol (RemoteProtocolError)


_S = State
#: (role, state, cause) -> next state. Causes are our calls ("initiate()", ...) and the
#: peer's messages (envelope types, and "tensor" for a tensor frame). This table is the
#: whole state machine: docs/averaging-protocol.md prints it, tests enumerate it.
TRANSITIONS: Final[Mapping[tuple[str, State, str], State]] = MappingProxyType(
    {
        ("initiator", _S.IDLE, "initiate()"): _S.OFFERED,
        ("initiator", _S.OFFERED, "avg.accept"): _S.SWAPPING,
        ("initiator", _S.OFFERED, "avg.reject"): _S.CLOSED,
        ("responder", _S.IDLE, "avg.offer"): _S.DECIDING,
        ("responder", _S.DECIDING, "accept()"): _S.SWAPPING,
        ("responder", _S.DECIDING, "reject()"): _S.CLOSED,
        **{
            (role, state, cause): after
            for role in ("initiator", "responder")
            for state, cause, after in (
                (_S.SWAPPING, "tensor", _S.SWAPPING),
                (_S.SWAPPING, "avg.done", _S.DONE),
                (_S.SWAPPING, "send_vector()", _S.SWAPPING),
                (_S.DONE, "send_vector()", _S.DONE),
            )
        },
    }
)
#: Every cause the peer can produce (any other message type is refused in every state).
PEER_CAUSES: Final = ("avg.offer", "avg.accept", "avg.reject", "tensor", "avg.done")
LOCAL_CAUSES: Final = ("initiate()", "accept()", "reject()", "send_vector()")


# --- events: frozen and slotted; don't subclass -----------------------------------------


@dataclass(frozen=True, slots=True)
class OfferReceived:
    """Responder: the initiator offers round `round`'s vector of `numel` values."""

    round: int
    numel: int
    codecs: tuple[str, ...]  # the initiator's preference order (unknown names included)
    chunk: int
    lanes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Lane:
    """Where the tensors go after the accept: a TCP port on the responder, and the key."""

    kind: str
    port: int
    key: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class Accepted:
    """Initiator: the responder agreed on `codec`; send the vector (on `lane` if given)."""

    codec: str
    lane: Lane | None = None


@dataclass(frozen=True, slots=True)
class Rejected:
    """Initiator: the responder declined; `reason` is its text, cut to MAX_REASON chars."""

    reason: str


@dataclass(frozen=True, slots=True)
class ChunkReceived:
    """Frame `index` arrived and was verified: `tensor` holds its decoded values (a view
    into what `received_vector()` returns); `nbytes` is its payload's size on the wire."""

    index: int
    tensor: torch.Tensor = field(compare=False, repr=False)
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class PeerDone:
    """The partner's whole vector arrived, in `frames` frames: received_vector() is ready."""

    frames: int


Event = OfferReceived | Accepted | Rejected | ChunkReceived | PeerDone


class Exchange:
    """One side of one round's exchange: feed the peer's bytes to `receive_data`, take
    events from `next_event`, write what `initiate`/`accept`/`reject`/`send_vector` return.

    The initiator knows its `round` and `numel`. A responder may leave them None: it then
    takes them from the offer and its caller checks them (OfferReceived); if given, an
    offer that disagrees is a RemoteProtocolError. `codecs` is the initiator's preference
    list, or what a responder supports (for the caller's `negotiate`); "fp32" is always
    acceptable as the fallback. `chunk_elems` is the initiator's values per frame.
    """

    def __init__(
        self,
        role: Role,
        run_id: str,
        round: int | None,
        numel: int | None,
        codecs: Sequence[str],
        *,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        max_numel: int = DEFAULT_MAX_NUMEL,
        max_frames: int = DEFAULT_MAX_FRAMES,
        lanes: Sequence[str] = (),
        topk_bounds: sparse.Bounds | None = None,
        max_bundle: int = 1,
    ) -> None:
        if role not in ("initiator", "responder"):
            raise LocalProtocolError(f"role must be 'initiator' or 'responder', not {role!r}")
        if type(run_id) is not str or not run_id:
            raise LocalProtocolError("run_id must be a non-empty str")
        for name, value, high in (
            ("max_numel", max_numel, None),
            ("max_frames", max_frames, None),
            ("chunk_elems", chunk_elems, MAX_CHUNK_ELEMS),
            ("max_bundle", max_bundle, MAX_BUNDLE),
        ):
            if not _int_in(value, 1, high):
                raise LocalProtocolError(f"{name} must be an int in [1, {high}], not {value!r}")
        if role == "initiator" and (round is None or numel is None):
            raise LocalProtocolError("an initiator knows its round and size")
        if round is not None and not _int_in(round, 0, MAX_ID - 1):
            raise LocalProtocolError(f"round must be an int in [0, 2**63), not {round!r}")
        if numel is not None and not _int_in(numel, 1, max_numel):
            raise LocalProtocolError(f"numel must be an int in [1, {max_numel}], not {numel!r}")
        if role == "initiator" and _frames(numel, chunk_elems) > max_frames:
            raise LocalProtocolError(
                f"{numel} values in chunks of {chunk_elems} exceed max_frames={max_frames}"
            )
        codecs = tuple(codecs)
        if not codecs or not all(c in _codecs.CODECS or c == TOPK for c in codecs):
            raise LocalProtocolError(
                f"codecs must be a non-empty list of {[*_codecs.CODECS, TOPK]}, not {list(codecs)}"
            )
        if TOPK in codecs and topk_bounds is None:
            raise LocalProtocolError("the topk codec needs the run's bounds (topk_bounds)")
        self.role: Role = role
        self.run_id = run_id
        self.round = round
        self.numel = numel
        self.codecs: tuple[str, ...] = codecs
        self.chunk = chunk_elems
        self.max_numel = max_numel
        self.max_frames = max_frames
        self.lanes: tuple[str, ...] = tuple(lanes)
        self.state = State.IDLE
        self.codec: str | None = None  # once agreed
        self.offer: OfferReceived | None = None  # responder, once received
        # No tensor frame is acceptable before a codec is agreed (or after the peer's done):
        # a 0-byte limit refuses one on its header, before its payload is buffered.
        self._decoder = LIMITS.decoder()
        self._decoder.max_tensor_bytes = 0
        self._received: torch.Tensor | None = None
        self._crc32 = True  # put a crc32 in our tensor headers (not on an AEAD lane)
        self._frames_in = 0
        self._filled = 0
        self._sent = False
        self._error: RemoteProtocolError | None = None
        # topk: the run's bounds, the most frames a bundle may hold, the frames decoded so
        # far, and the one arriving (its bytes, how many are in)
        self.topk_bounds = topk_bounds
        self.max_bundle = max_bundle
        self._topk: list[sparse.Frame] = []
        self._topk_buf: bytearray | None = None
        self._topk_in = 0
        self._topk_piece = 0
        self._topk_in_place = False

    # -- our side ---------------------------------------------------------------------------

    def initiate(self) -> bytes:
        """The offer, to be written first (initiator)."""
        after = self._local("initiate()")
        body = {
            "run": self.run_id,
            "round": self.round,
            "numel": self.numel,
            "codecs": list(self.codecs),
            "chunk": self.chunk,
            "lanes": list(self.lanes),
        }
        data = self._envelope("avg.offer", body)
        self.state = after
        return data

    def accept(self, codec: str, lane: Lane | None = None) -> bytes:
        """Agree on `codec` (one the offer lists, or "fp32"); allocates the receive buffer."""
        after = self._local("accept()")
        assert self.offer is not None
        if codec == TOPK and (TOPK not in self.codecs or TOPK not in self.offer.codecs):
            raise LocalProtocolError("cannot accept topk: both sides must list it")
        if (codec != TOPK and codec not in _codecs.CODECS) or (
            codec not in self.offer.codecs and codec != _codecs.FALLBACK
        ):
            raise LocalProtocolError(
                f"cannot accept {codec!r}: the offer lists {list(self.offer.codecs)}"
                f" (and {_codecs.FALLBACK!r} is always possible)"
            )
        body: dict[str, Any] = {"round": self.round, "codec": codec}
        if lane is not None:
            if lane.kind not in self.offer.lanes:
                raise LocalProtocolError(f"lane {lane.kind!r} was not offered")
            body["lane"] = {"kind": lane.kind, "port": lane.port, "key": lane.key}
        data = self._envelope("avg.accept", body)
        self._agree(codec, lane)
        self.state = after
        return data

    def reject(self, reason: str) -> bytes:
        """Decline the offer, saying why (responder)."""
        after = self._local("reject()")
        body = {"round": self.round, "reason": str(reason)[:MAX_REASON]}
        data = self._envelope("avg.reject", body)
        self.state = after
        return data

    def send_vector(self, vec: torch.Tensor) -> list[bytes | memoryview]:
        """Every tensor frame of our vector, then avg.done, as one gather list (call once).

        With fp32 the payloads are views of `vec`'s memory: keep it unchanged until they
        are written.
        """
        self._local("send_vector()")
        if self._sent:
            raise LocalProtocolError("send_vector() was already called")
        assert self.codec is not None and self.numel is not None
        if not isinstance(vec, torch.Tensor) or vec.numel() != self.numel:
            size = vec.numel() if isinstance(vec, torch.Tensor) else type(vec).__name__
            raise LocalProtocolError(f"the vector must have {self.numel} values, not {size}")
        flat = vec.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
        out: list[bytes | memoryview] = []
        frames = 0
        for frames, start in enumerate(range(0, self.numel, self.chunk), start=1):
            enc = _codecs.encode(flat[start : start + self.chunk], self.codec)
            name = f"theta/{frames - 1}"
            header = make_tensor_header(
                name, enc.dtype, enc.shape, enc.codec, enc.payload, crc32=self._crc32
            )
            out.extend(encode_tensor_frame(header, enc.payload, id=self._id()))
        out.append(self._envelope("avg.done", {"round": self.round, "frames": frames}))
        self._sent = True
        return out

    def send_frames(self, frames: Sequence[bytes]) -> list[bytes | memoryview]:
        """A topk exchange's side: our encoded sparse frames (1 to max_bundle of them, each
        `sparse.encode`'s bytes), then avg.done, as one gather list (call once)."""
        self._local("send_vector()")
        if self._sent:
            raise LocalProtocolError("send_vector() was already called")
        if self.codec != TOPK:
            raise LocalProtocolError(f"send_frames() is for the topk codec, not {self.codec}")
        if not 1 <= len(frames) <= MAX_BUNDLE:
            raise LocalProtocolError(f"a bundle holds 1 to {MAX_BUNDLE} frames, not {len(frames)}")
        piece = 4 * self.chunk
        out: list[bytes | memoryview] = []
        count = 0
        for i, data in enumerate(frames):
            view = memoryview(data).cast("B")
            if len(view) <= sparse.HEADER_SIZE:
                raise LocalProtocolError(f"topk frame {i} of {len(view)} bytes: not a frame")
            parts = [(f"topk/{i}", view[: sparse.HEADER_SIZE])]
            body = view[sparse.HEADER_SIZE :]
            parts += [(f"topk/{i}/{j}", body[start : start + piece])
                      for j, start in enumerate(range(0, len(body), piece))]
            for name, payload in parts:
                header = make_tensor_header(name, "uint8", (len(payload),), TOPK, payload,
                                            crc32=self._crc32)
                out.extend(encode_tensor_frame(header, payload, id=self._id()))
                count += 1
        out.append(self._envelope("avg.done", {"round": self.round, "frames": count}))
        self._sent = True
        return out

    # -- the peer's side --------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes from the peer (copied); the events come out of `next_event`."""
        self._check_alive()
        self._decoder.feed(data)

    def receive_buffer(self) -> memoryview | None:
        """Where the peer's next bytes may be written in place (FrameDecoder.receive_buffer),
        or None: for fp32, the rest of the current frame's slot in the receive vector."""
        self._check_alive()
        return self._decoder.receive_buffer()

    def received_into(self, n: int) -> None:
        """`n` bytes were written at the start of the last `receive_buffer()`; the events
        come out of `next_event`, as after `receive_data`."""
        self._check_alive()
        self._decoder.received_into(n)

    def next_event(self) -> Event | Literal[_NeedData.NEED_DATA]:
        """The next event, or NEED_DATA. RemoteProtocolError if the peer broke the protocol;
        the exchange is then DEAD."""
        self._check_alive()
        state = self.state
        try:
            frame = self._decoder.next_event()
            if frame is NEED_DATA:
                return NEED_DATA
            cause = "tensor" if isinstance(frame, TensorFrame) else frame.type
            after = TRANSITIONS.get((self.role, state, cause))
            if after is None:
                what = "tensor frame" if cause == "tensor" else f"message {cause!r}"
                raise RemoteProtocolError(f"unexpected {what}")
            event = self._handle(cause, frame)
        except RemoteProtocolError as exc:
            self.state = State.DEAD
            self._error = RemoteProtocolError(f"avg {self.role} in {state}: {exc}")
            raise self._error from exc
        self.state = after
        return event

    def received_frames(self) -> list[sparse.Frame]:
        """The partner's topk bundle, decoded and checked, once PeerDone has been returned."""
        if self.state is not State.DONE or self.codec != TOPK:
            raise LocalProtocolError(f"the partner's topk frames are not complete ({self.state})")
        return list(self._topk)

    def received_vector(self) -> torch.Tensor:
        """The partner's whole vector (fp32, writable), once PeerDone has been returned."""
        if self.state is not State.DONE or self._received is None:
            raise LocalProtocolError(f"the partner's vector is not complete ({self.state})")
        return self._received

    # -- internals --------------------------------------------------------------------------

    def _handle(self, cause: str, frame: Envelope | TensorFrame) -> Event:
        if isinstance(frame, TensorFrame):
            return self._on_chunk(frame)
        body = frame.body
        if type(body) is not dict:
            raise RemoteProtocolError(f"{cause} body must be a map")
        if cause == "avg.offer":
            return self._on_offer(body)
        if body.get("round") != self.round:
            raise RemoteProtocolError(
                f"{cause} for round {_short(body.get('round'))}; this exchange is {self.round}"
            )
        if cause == "avg.accept":
            return self._on_accept(body)
        if cause == "avg.reject":
            reason = body.get("reason")
            if type(reason) is not str:
                raise RemoteProtocolError("avg.reject without a reason string")
            return Rejected(reason[:MAX_REASON])
        return self._on_done(body)  # TRANSITIONS admits no other cause here

    def _on_offer(self, body: dict) -> OfferReceived:
        run = body.get("run")
        if run != self.run_id:
            raise RemoteProtocolError(f"offer for another run ({_short(run)})")
        r, numel, chunk = body.get("round"), body.get("numel"), body.get("chunk")
        if not _int_in(r, 0, MAX_ID - 1):
            raise RemoteProtocolError(f"offer without a valid round ({_short(r)})")
        if self.round is not None and r != self.round:
            raise RemoteProtocolError(f"offer for round {r}; this exchange is round {self.round}")
        if not _int_in(numel, 1, self.max_numel):
            raise RemoteProtocolError(f"offer of {_short(numel)} values (limit {self.max_numel})")
        if self.numel is not None and numel != self.numel:
            raise RemoteProtocolError(f"offer of {numel} values; our vector has {self.numel}")
        if not _int_in(chunk, 1, MAX_CHUNK_ELEMS):
            raise RemoteProtocolError(
                f"offer of chunks of {_short(chunk)} values (limit {MAX_CHUNK_ELEMS})"
            )
        if _frames(numel, chunk) > self.max_frames:
            raise RemoteProtocolError(
                f"offer of {numel} values in chunks of {chunk}: {_frames(numel, chunk)} frames"
                f" (limit {self.max_frames})"
            )
        offered = _str_list(body.get("codecs"), "codecs")
        lanes = _str_list(body.get("lanes", []), "lanes")
        self.round, self.numel, self.chunk = r, numel, chunk
        self.offer = OfferReceived(r, numel, offered, chunk, lanes)
        return self.offer

    def _on_accept(self, body: dict) -> Accepted:
        codec = body.get("codec")
        if codec not in self.codecs and codec != _codecs.FALLBACK:
            raise RemoteProtocolError(
                f"partner chose codec {_short(codec)}; we offered {list(self.codecs)}"
            )
        lane = _parse_lane(body.get("lane"), self.lanes)
        self._agree(codec, lane)
        return Accepted(codec, lane)

    def _expect(self, header: TensorHeader) -> int:
        """Check the next tensor frame on its header; return how many values it holds."""
        assert self.numel is not None
        index = self._frames_in
        remaining = self.numel - self._filled
        if remaining == 0:
            raise RemoteProtocolError(
                f"too many frames: all {self.numel} values came in {index}, then {header.name!r}"
            )
        if header.name != f"theta/{index}":
            raise RemoteProtocolError(
                f"frame out of order: expected 'theta/{index}', got {header.name!r}"
            )
        count = min(self.chunk, remaining)
        try:
            _codecs.check_header(header.codec, header.dtype, header.shape, header.length, count)
        except RemoteProtocolError as exc:
            raise RemoteProtocolError(f"theta/{index}: {exc}") from exc
        return count

    def _payload_buffer(self, header: TensorHeader) -> memoryview | None:
        """The decoder's `payload_buffer`: refuse a bad frame on its header, before its
        payload is buffered, and receive an fp32 payload straight into its slot of the
        receive vector (its decode is then only the NaN/Inf check)."""
        if self.state is not State.SWAPPING:
            return None  # no frame is expected: TRANSITIONS refuses it once it is complete
        if self.codec == TOPK:
            if self._topk_expect(header) == 0:
                return None  # a frame's header: decoded from the decoder's buffer
            assert self._topk_buf is not None
            self._topk_in_place = True  # the piece lands in the frame: no copy in _on_topk
            return memoryview(self._topk_buf)[self._topk_in : self._topk_in + header.length]
        count = self._expect(header)
        if self.codec != "fp32":
            return None  # decoded from the decoder's buffer into the vector
        assert self._received is not None
        slot = self._received[self._filled : self._filled + count]
        return slot.numpy().data.cast("B")

    def _topk_expect(self, header: TensorHeader) -> int:
        """Check a topk tensor frame on its header: 0 for a frame's header (`topk/i`), else
        the frame's byte offset where this piece (`topk/i/j`) goes."""
        i, j = len(self._topk), self._topk_piece
        if self._topk_buf is None:
            if i >= self.max_bundle:
                raise RemoteProtocolError(f"more than {self.max_bundle} topk frames")
            name, length = f"topk/{i}", sparse.HEADER_SIZE
        else:
            name = f"topk/{i}/{j}"
            length = min(4 * self.chunk, len(self._topk_buf) - self._topk_in)
        if header.name != name:
            raise RemoteProtocolError(f"expected {name!r}, got {header.name!r}")
        if header.dtype != "uint8" or header.shape != (length,) or header.length != length:
            raise RemoteProtocolError(f"{name}: {header.length} bytes of {header.dtype}"
                                      f"{list(header.shape)}; {length} uint8 were expected")
        return 0 if self._topk_buf is None else self._topk_in

    def _on_topk(self, frame: TensorFrame) -> ChunkReceived:
        assert self.numel is not None and self.topk_bounds is not None
        header, index = frame.header, self._frames_in
        if self._topk_expect(header) == 0 and self._topk_buf is None:
            # a frame's header: its exact size from the header alone, checked against our
            # numel and the run's bounds before the frame is allocated
            size = sparse.frame_size(frame.payload, self.numel, self.topk_bounds)
            self._topk_buf = bytearray(size)
            self._topk_buf[: sparse.HEADER_SIZE] = frame.payload
            self._topk_in, self._topk_piece = sparse.HEADER_SIZE, 0
        else:  # a piece, received in place (_payload_buffer) or from the decoder's buffer
            assert self._topk_buf is not None
            end = self._topk_in + header.length
            if not self._topk_in_place:
                self._topk_buf[self._topk_in : end] = memoryview(frame.payload).cast("B")
            self._topk_in_place = False
            self._topk_in, self._topk_piece = end, self._topk_piece + 1
        if self._topk_in == len(self._topk_buf):
            self._topk.append(sparse.decode(self._topk_buf, self.numel, self.topk_bounds))
            self._topk_buf = None
        self._frames_in += 1
        return ChunkReceived(index, _NO_VALUES, header.length)

    def _on_chunk(self, frame: TensorFrame) -> ChunkReceived:
        if self.codec == TOPK:
            return self._on_topk(frame)
        assert self._received is not None and self.numel is not None
        header, index = frame.header, self._frames_in
        count = self._expect(header)
        values = self._received[self._filled : self._filled + count]
        try:  # checked on its header already (the decoder, _payload_buffer): now decode
            _codecs.decode(
                header.codec, header.dtype, header.shape, frame.payload, count, out=values
            )
        except RemoteProtocolError as exc:
            raise RemoteProtocolError(f"theta/{index}: {exc}") from exc
        self._filled += count
        self._frames_in += 1
        return ChunkReceived(index, values, header.length)

    def _on_done(self, body: dict) -> PeerDone:
        frames = body.get("frames")
        if self.codec == TOPK:
            if frames != self._frames_in or self._topk_buf is not None or not self._topk:
                raise RemoteProtocolError(
                    f"avg.done says {_short(frames)} frames; {self._frames_in} arrived"
                    f" ({len(self._topk)} whole topk frames)"
                )
            self._decoder.max_tensor_bytes = 0
            return PeerDone(self._frames_in)
        if frames != self._frames_in or self._filled != self.numel:
            raise RemoteProtocolError(
                f"avg.done says {_short(frames)} frames; {self._frames_in} arrived"
                f" ({self._filled} of {self.numel} values)"
            )
        self._decoder.max_tensor_bytes = 0  # nothing more may come: buffer none of it
        return PeerDone(self._frames_in)

    def _agree(self, codec: str, lane: Lane | None) -> None:
        assert self.numel is not None
        self.codec = codec
        # From here on a frame must be in this codec and at most one chunk's worth.
        self._decoder.allowed_codecs = frozenset({codec})
        self._decoder.payload_buffer = self._payload_buffer
        if codec == TOPK:  # pieces of at most 4 * chunk bytes; frames allocated as they come
            self._decoder.max_tensor_bytes = max(sparse.HEADER_SIZE, 4 * self.chunk)
        else:
            self._decoder.max_tensor_bytes = _codecs.max_encoded_size(codec, self.chunk)
            self._received = torch.empty(self.numel, dtype=torch.float32)
        if lane is not None:  # every later byte rides the lane, where GCM authenticates it
            self._crc32 = False
            self._decoder.require_crc32 = False

    def _local(self, cause: str) -> State:
        if self._error is not None:
            raise LocalProtocolError(f"{cause} on a failed exchange ({self._error})")
        after = TRANSITIONS.get((self.role, self.state, cause))
        if after is None:
            raise LocalProtocolError(f"{cause} is not allowed to a {self.role} in {self.state}")
        return after

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RemoteProtocolError(f"exchange already failed: {self._error}")

    def _id(self) -> int:
        assert self.round is not None  # nothing is sent before the round is known
        return self.round

    def _envelope(self, type_: str, body: dict[str, Any]) -> bytes:
        return encode_envelope(
            Envelope(type_, self._id(), body), max_frame_bytes=MAX_ENVELOPE_BYTES
        )


_NO_VALUES: Final = torch.empty(0)  # a topk ChunkReceived carries bytes, not values


def _parse_lane(doc: Any, offered: tuple[str, ...]) -> Lane | None:
    if doc is None:
        return None
    if type(doc) is not dict or doc.get("kind") not in offered:
        raise RemoteProtocolError("partner chose a lane we did not offer")
    port, key = doc.get("port"), doc.get("key")
    if not _int_in(port, 1, 65535) or type(key) is not bytes or len(key) != 32:
        raise RemoteProtocolError("lane needs a TCP port and a 32-byte key")
    return Lane(doc["kind"], port, key)


def _str_list(value: Any, what: str) -> tuple[str, ...]:
    if (
        type(value) is not list
        or len(value) > MAX_OFFERED
        or not all(type(v) is str and len(v) <= 64 for v in value)
    ):
        raise RemoteProtocolError(f"offer {what}: a list of at most {MAX_OFFERED} short strings")
    return tuple(value)


def _frames(numel: int | None, chunk: int) -> int:
    return -(-(numel or 0) // chunk)


def _int_in(value: Any, low: int, high: int | None) -> TypeGuard[int]:
    return type(value) is int and value >= low and (high is None or value <= high)


def _short(value: Any) -> str:
    """A bounded repr for error messages: the value may be the peer's."""
    text = repr(value) if type(value) in (int, str, bool, float, type(None)) else None
    if text is None:
        return f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
