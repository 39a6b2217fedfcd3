"""`/peertrain/pipe/1.0.0`: activations forward and gradients back between pipeline stages.

One stream per (sender, receiver) pair carries a sequence of messages, each a wire
envelope followed by one tensor frame (protocols/wire.py, docs/pipeline.md):

    pipe.act   {run, stage, step, mb, shape, dtype[, hop][, origin]}   then tensor frame "x"
    pipe.grad  {run, stage, step, mb, shape, dtype[, hop][, origin]}   then tensor frame "g"
    pipe.tgt   (first -> last stage) a micro-batch's target token ids, int64 [b, seq, 1]
    pipe.tgrad (last -> first) the tied head's gradient, [1, vocab, d_model], mb 0
    pipe.tied  (first -> last) the updated tied matrix for `step`, [1, vocab, d_model]

A sender on a direct path may first ask for a bulk lane (protocols/lane.py), as the very
first message of a stream, and read the one answer the receiver ever writes:

    -> pipe.lane {run}          <- pipe.lane {port, key}   or   pipe.nolane {reason}

With a lane, every further message goes over it (the same messages, sealed records over a
TCP connection to `port` that proves it holds `key`); the libp2p stream, which
authenticated the sender, stays open beside it and names the sender of the lane's messages.

`stage` is the stage the tensor is *for* (the receiver's). `hop` is the micro-batch's visit
it is for (node/ml/pipeline/schedule.py `hops`): activations come from hop - 1, gradients from
hop + 1. Absent, it is `stage`: in stage order (no CheckFree+ swap) hop h is stage h, and
activations come from stage - 1, gradients from stage + 1. With the swap a first or last
stage is visited twice per odd micro-batch, and the hop says which visit. `step` and `mb`
(micro-batch) name the micro-batch, so the receiver files it and the backward pass finds
its saved activations; `origin` (the first-stage replica that cut it, its peer id) tells
apart the micro-batches of one index and step that two first-stage replicas cut: a stage
with fewer hosts than the first gets both. Absent, it is "" (one first-stage host, or a
sender from before it existed). On the wire every
tensor is bfloat16 (half fp32's bytes; seq x d_model x 2 B per sequence and boundary, spec
§1e), codec "raw", shape (batch, seq, d_model).

Receiving (`PipeReceiver`, sans-IO: `receive_data` bytes, `next_event` events): the
receiver states what it accepts (`Expect`: its run, stage, d_model, the largest batch and
sequence, the number of micro-batches) and everything the peer announces is checked
against it *before* anything is allocated: the envelope's fields, then the tensor frame's
header against the envelope (shape, dtype, byte count). A tensor is never larger than
`Expect.max_bytes`, and the stream's decoder refuses any payload above that on its header.
A violation is a `RemoteProtocolError` with the reason (the stream is closed). A payload
that arrives whole but holds NaN or inf is refused alone: a `Refused` event with the
reason, and the stream goes on (framing is intact; one bad micro-batch costs that
micro-batch). Queue bounds (how many micro-batches may wait) are the node's: this core
holds at most one message at a time.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, Literal

from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.lane import KEY_BYTES
from protocols.limits import StreamLimits
from protocols.wire import (
    NEED_DATA,
    Envelope,
    TensorFrame,
    TensorHeader,
    encode_envelope,
    encode_tensor_frame,
    make_tensor_header,
    tensor_from_payload,
    tensor_payload,
)

if TYPE_CHECKING:
    import torch

    from protocols.wire import _NeedData

PROTOCOL_ID: Final = "/peertrain/pipe/1.0.0"
WIRE_DTYPE: Final = "bfloat16"
CODEC: Final = "raw"
MAX_ENVELOPE_BYTES: Final = 4 << 10
MAX_TENSOR_BYTES: Final = 256 << 20  # the format's ceiling; a receiver's own is Expect.max_bytes
MAX_STEP: Final = 2**62
MAX_MICRO_BATCHES: Final = 4096  # as the manifest allows
RUN_ID_MAX: Final = 64
ORIGIN_MAX: Final = 128  # a peer id in base58 (52 characters for an Ed25519 key)

Kind = Literal["act", "grad", "tgt", "tgrad", "tied"]
_TYPES: Final = {"act": "pipe.act", "grad": "pipe.grad", "tgt": "pipe.tgt",
                 "tgrad": "pipe.tgrad", "tied": "pipe.tied"}
_KINDS: Final = {v: k for k, v in _TYPES.items()}
_NAMES: Final = {"act": "x", "grad": "g", "tgt": "y", "tgrad": "tg", "tied": "w"}
TARGET_DTYPE: Final = "int64"
ALL_KINDS: Final = frozenset(_TYPES)
_BODY_KEYS: Final = frozenset({"run", "stage", "step", "mb", "shape", "dtype"})
_OPTIONAL_KEYS: Final = frozenset({"hop", "origin"})
MAX_HOPS: Final = 2 * 256  # each of at most 256 stages visited at most twice

#: The ceilings of a pipe stream; a receiver narrows the tensor bound to its Expect.
LIMITS: Final = StreamLimits(
    PROTOCOL_ID,
    MAX_ENVELOPE_BYTES,
    MAX_TENSOR_BYTES,
    frozenset({CODEC}),
    note="none per stream (long-lived); each write 30 s, a step waits 4x its measured "
         "time (>= 5 s)",
)


@dataclass(frozen=True, slots=True)
class Expect:
    """What a receiving stage accepts; every field bounds what a peer can make it hold."""

    run: str
    stage: int
    d_model: int
    max_batch: int  # sequences per micro-batch
    max_seq: int  # the model's context
    micro_batches: int
    kinds: frozenset[str] = frozenset({"act", "grad"})
    vocab: int = 256  # the tied matrix is [1, vocab, d_model]; targets are < vocab

    def __post_init__(self) -> None:
        for name in ("d_model", "max_batch", "max_seq", "micro_batches", "vocab"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise LocalProtocolError(f"Expect.{name} must be an int >= 1")
        if type(self.stage) is not int or self.stage < 0:
            raise LocalProtocolError("Expect.stage must be an int >= 0")
        if self.max_bytes > MAX_TENSOR_BYTES:
            raise LocalProtocolError(f"Expect allows {self.max_bytes} bytes per tensor, over "
                                     f"the format's {MAX_TENSOR_BYTES}")

    @property
    def max_bytes(self) -> int:
        """The largest tensor of the kinds this stage accepts."""
        sizes = [0]
        if self.kinds & {"act", "grad"}:
            sizes.append(self.max_batch * self.max_seq * self.d_model * 2)  # bfloat16
        if "tgt" in self.kinds:
            sizes.append(self.max_batch * self.max_seq * 8)  # int64
        if self.kinds & {"tgrad", "tied"}:
            sizes.append(self.vocab * self.d_model * 2)
        return max(sizes)

    def limits(self) -> StreamLimits:
        return replace(LIMITS, max_tensor_bytes=self.max_bytes)


@dataclass(frozen=True, slots=True)
class MessageHeader:
    kind: Kind
    run: str
    stage: int
    step: int
    mb: int
    shape: tuple[int, int, int]
    hop: int  # the visit it is for; `stage` where the sender gave none
    origin: str = ""  # the first-stage replica that cut the micro-batch; "" where not given


@dataclass(frozen=True, slots=True)
class TensorReceived:
    """A micro-batch's activations (kind "act") or gradients ("grad"), fp32, checked;
    targets ("tgt") as int64 (batch, seq) within the vocabulary; the tied matrix or its
    gradient ("tied", "tgrad") as fp32 (vocab, d_model)."""

    header: MessageHeader
    tensor: torch.Tensor


@dataclass(frozen=True, slots=True)
class Refused:
    """A whole, well-framed message refused for its values (NaN or inf): that micro-batch
    is lost, the stream goes on."""

    header: MessageHeader
    reason: str


@dataclass(frozen=True, slots=True)
class LaneAsked:
    """The sender asks for a bulk lane (only as a stream's first message): answer with
    `encode_lane_offer` or `encode_no_lane`."""


Event = TensorReceived | Refused | LaneAsked

#: What a sender reads back on its stream: one pipe.lane / pipe.nolane envelope.
LANE_REPLY_LIMITS: Final = StreamLimits(PROTOCOL_ID + " lane reply", 512, deadline_s=5.0)


def encode_lane_request(run: str) -> bytes:
    return encode_envelope(Envelope("pipe.lane", 0, {"run": run}))


def encode_lane_offer(port: int, key: bytes) -> bytes:
    return encode_envelope(Envelope("pipe.lane", 0, {"port": port, "key": key}))


def encode_no_lane(reason: str) -> bytes:
    return encode_envelope(Envelope("pipe.nolane", 0, {"reason": reason[:200]}))


def parse_lane_reply(env: Any) -> tuple[int, bytes] | str:
    """(port, key) of a lane offer, or the reason there is none; RemoteProtocolError for
    anything else."""
    body = env.body if isinstance(env, Envelope) else None
    if isinstance(env, Envelope) and env.type == "pipe.nolane" and isinstance(body, dict):
        return str(body.get("reason", ""))[:200]
    if isinstance(env, Envelope) and env.type == "pipe.lane" and isinstance(body, dict):
        port, key = body.get("port"), body.get("key")
        if type(port) is int and 0 < port < 65536 and isinstance(key, bytes) \
                and len(key) == KEY_BYTES:
            return port, key
    raise RemoteProtocolError(f"expected a lane offer, got {_short(getattr(env, 'type', env))}")


def encode(kind: Kind, run: str, stage: int, step: int, mb: int, tensor: torch.Tensor,
           hop: int | None = None, origin: str = "") -> list[bytes | memoryview]:
    """The gather list for one message: the tensor is cast to bfloat16 (a copy) first;
    targets ("tgt": token ids (batch, seq)) travel as int64 (batch, seq, 1), the tied
    matrix and its gradient (vocab, d_model) as (1, vocab, d_model)."""
    import torch

    if kind not in _TYPES:
        raise LocalProtocolError(f"kind must be one of {sorted(_TYPES)}, not {kind!r}")
    if kind == "tgt" and tensor.dim() == 2:
        tensor = tensor.unsqueeze(-1)
    if kind in ("tgrad", "tied") and tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 3:
        raise LocalProtocolError(f"tensor must be (batch, seq, d_model), got {tuple(tensor.shape)}")
    dt = torch.int64 if kind == "tgt" else torch.bfloat16
    wire = tensor.detach().to(device="cpu", dtype=dt).contiguous()
    dtype, shape, view = tensor_payload(wire)
    body = {"run": run, "stage": stage, "step": step, "mb": mb, "shape": list(shape),
            "dtype": dtype}
    if hop is not None and hop != stage:
        body["hop"] = hop
    if origin:
        body["origin"] = origin
    problem = _body_problem(body)
    if problem:
        raise LocalProtocolError(problem)
    header = make_tensor_header(_NAMES[kind], dtype, shape, CODEC, view)
    env = encode_envelope(Envelope(_TYPES[kind], mb, body), max_frame_bytes=MAX_ENVELOPE_BYTES)
    return [env, *encode_tensor_frame(header, view, id=mb, max_frame_bytes=MAX_ENVELOPE_BYTES)]


class State(enum.StrEnum):
    HEADER = "HEADER"  # waiting for a pipe.act / pipe.grad envelope
    TENSOR = "TENSOR"  # envelope accepted: its tensor frame must follow
    DEAD = "DEAD"  # the peer violated the protocol


class PipeReceiver:
    """Sans-IO reader of one pipe stream, bound to what this stage accepts (`Expect`)."""

    def __init__(self, expect: Expect) -> None:
        self.expect = expect
        self.state = State.HEADER
        self._pending: MessageHeader | None = None
        self._decoder = expect.limits().decoder(payload_buffer=self._check_tensor_header)
        self.received = 0
        self.refused = 0
        self._first = True  # only a stream's first message may ask for a lane

    @property
    def between_messages(self) -> bool:
        """No part of a message is buffered: a stream that ends here ended cleanly."""
        d = self._decoder
        return self.state is State.HEADER and not d._buffer and d._payload is None

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._alive()
        self._decoder.feed(data)

    def next_event(self) -> Event | _NeedData:
        """The next complete message, or NEED_DATA; RemoteProtocolError kills the stream."""
        self._alive()
        try:
            while True:  # an envelope is not an event: read on to its tensor frame
                event = self._decoder.next_event()
                if event is NEED_DATA:
                    return NEED_DATA
                if isinstance(event, Envelope):
                    asked = self._on_envelope(event)
                    if asked is not None:
                        return asked
                    continue
                return self._on_tensor(event)
        except RemoteProtocolError:
            self.state = State.DEAD
            raise

    def _alive(self) -> None:
        if self.state is State.DEAD:
            raise RemoteProtocolError("pipe stream is dead after a protocol violation")

    def _on_envelope(self, env: Envelope) -> LaneAsked | None:
        if self.state is not State.HEADER:
            raise RemoteProtocolError(f"{env.type!r} envelope while a tensor frame was due")
        first, self._first = self._first, False
        if env.type == "pipe.lane":
            if not first:
                raise RemoteProtocolError("pipe.lane is only a stream's first message")
            body = env.body
            if not isinstance(body, dict) or set(body) != {"run"} \
                    or body["run"] != self.expect.run:
                raise RemoteProtocolError(f"pipe.lane for another run: {_short(body)}")
            return LaneAsked()
        kind = _KINDS.get(env.type)
        if kind is None:
            raise RemoteProtocolError(f"unexpected message type {_short(env.type)} on "
                                      f"{PROTOCOL_ID}")
        if kind not in self.expect.kinds:
            raise RemoteProtocolError(f"stage {self.expect.stage} accepts no {env.type}")
        body = env.body
        problem = _body_problem(body) or self._expect_problem(kind, body)
        if problem:
            raise RemoteProtocolError(problem)
        if env.id != body["mb"]:
            raise RemoteProtocolError(f"envelope id {env.id} is not the micro-batch {body['mb']}")
        self._pending = MessageHeader(kind, body["run"], body["stage"],  # type: ignore[arg-type]
                                      body["step"], body["mb"], tuple(body["shape"]),
                                      body.get("hop", body["stage"]), body.get("origin", ""))
        self.state = State.TENSOR
        return None

    def _expect_problem(self, kind: str, body: dict[str, Any]) -> str | None:
        e = self.expect
        if body["run"] != e.run:
            return f"run {_short(body['run'])} is not this stream's run {e.run}"
        if body["stage"] != e.stage:
            return f"{kind} for stage {body['stage']} sent to stage {e.stage}"
        if body["mb"] >= e.micro_batches:
            return f"micro-batch {body['mb']} >= the run's {e.micro_batches} per step"
        b, t, d = body["shape"]
        if kind in ("tgrad", "tied"):
            if [b, t, d] != [1, e.vocab, e.d_model]:
                return (f"shape {body['shape']}: the tied matrix is "
                        f"{[1, e.vocab, e.d_model]}")
        elif kind == "tgt":
            if d != 1:
                return f"shape {body['shape']}: targets are [batch, seq, 1]"
        elif d != e.d_model:
            return f"shape {body['shape']}: d_model {d} is not the model's {e.d_model}"
        if kind not in ("tgrad", "tied") and not (1 <= b <= e.max_batch
                                                 and 1 <= t <= e.max_seq):
            return (f"shape {body['shape']}: batch must be 1..{e.max_batch} and sequence "
                    f"1..{e.max_seq}")
        want = _dtype(kind)
        if body["dtype"] != want:
            return f"dtype {_short(body['dtype'])}: the wire carries {want} for {kind}"
        return None

    def _check_tensor_header(self, header: TensorHeader) -> None:
        """Before any payload byte is buffered: the frame must be the one announced."""
        p = self._pending
        if p is None:
            raise RemoteProtocolError("tensor frame without a pipe.act / pipe.grad envelope")
        if header.name != _NAMES[p.kind]:
            raise RemoteProtocolError(f"tensor {_short(header.name)} where "
                                      f"{_NAMES[p.kind]!r} was announced")
        want = _dtype(p.kind)
        if header.dtype != want or header.codec != CODEC:
            raise RemoteProtocolError(f"tensor is {_short(header.dtype)}/{_short(header.codec)}"
                                      f", announced {want}/{CODEC}")
        if tuple(header.shape) != p.shape:
            raise RemoteProtocolError(f"tensor shape {list(header.shape)} is not the announced "
                                      f"{list(p.shape)}")
        size = 8 if want == TARGET_DTYPE else 2
        if header.length != math.prod(p.shape) * size:
            raise RemoteProtocolError(f"tensor of {header.length} bytes; {list(p.shape)} "
                                      f"{want} is {math.prod(p.shape) * size}")
        return None

    def _on_tensor(self, frame: TensorFrame) -> Event:
        p = self._pending
        if self.state is not State.TENSOR or p is None:  # the header check refused it already
            raise RemoteProtocolError("tensor frame without an envelope")
        if frame.id != p.mb:
            raise RemoteProtocolError(f"tensor frame id {frame.id} is not micro-batch {p.mb}")
        self._pending = None
        self.state = State.HEADER
        tensor = tensor_from_payload(frame.header, frame.payload)
        import torch

        if p.kind == "tgt":
            tensor = tensor.squeeze(-1)
            if tensor.numel() and not bool(((tensor >= 0) & (tensor < self.expect.vocab)).all()):
                self.refused += 1
                return Refused(p, f"targets of step {p.step} micro-batch {p.mb} fall outside "
                                  f"the vocabulary 0..{self.expect.vocab - 1}")
            self.received += 1
            return TensorReceived(p, tensor)
        tensor = tensor.float()
        if p.kind in ("tgrad", "tied"):
            tensor = tensor.squeeze(0)
        if not bool(torch.isfinite(tensor).all()):
            self.refused += 1
            return Refused(p, f"{p.kind} of step {p.step} micro-batch {p.mb} holds NaN or inf")
        self.received += 1
        return TensorReceived(p, tensor)


def _dtype(kind: str) -> str:
    return TARGET_DTYPE if kind == "tgt" else WIRE_DTYPE


def _body_problem(body: Any) -> str | None:
    """Types and ranges of an envelope body, before anything is looked up by it."""
    if not isinstance(body, dict) or set(body) - _OPTIONAL_KEYS != _BODY_KEYS:
        keys = sorted(map(str, body)) if isinstance(body, dict) else type(body).__name__
        return (f"pipe body must have exactly {sorted(_BODY_KEYS)} (and maybe hop, origin), "
                f"got {_short(keys)}")
    origin = body.get("origin", "x")
    if type(origin) is not str or not 1 <= len(origin) <= ORIGIN_MAX:
        return f"origin must be a peer id of 1..{ORIGIN_MAX} characters, got {_short(origin)}"
    run = body["run"]
    if type(run) is not str or not 1 <= len(run) <= RUN_ID_MAX:
        return f"run must be a run-id string, got {_short(run)}"
    for name, high in (("stage", 256), ("step", MAX_STEP), ("mb", MAX_MICRO_BATCHES),
                       ("hop", MAX_HOPS)):
        v = body.get(name, 0)
        if type(v) is not int or not 0 <= v < high:
            return f"{name} must be an int in [0, {high}), got {_short(v)}"
    shape = body["shape"]
    if (type(shape) not in (list, tuple) or len(shape) != 3
            or not all(type(d) is int and 1 <= d <= 1 << 20 for d in shape)):
        return f"shape must be [batch, seq, d_model] of ints >= 1, got {_short(shape)}"
    if type(body["dtype"]) is not str:
        return f"dtype must be a string, got {_short(body['dtype'])}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."



# -- `/peertrain/pipe-weights/1.0.0`: a stage's weights, for recovery ----------------------
#
# CheckFree rebuilds a lost stage from its neighbours' weights, and a stage that still has
# a live replica is copied from it. The asker sends one envelope and reads one answer:
#
#     ask:    pipe.wget {run, stage, part: "blocks" | "all" | "ends"}
#     answer: pipe.weights {run, stage, step, gnorm, names, shapes[, trained]} then one
#             fp32 tensor frame per name, in order;  or  pipe.wnone {reason}
#
# The asker knows every stage's layout (it cuts the same manifest), so `WeightsReceiver`
# is built with the exact names and shapes it accepts and checks the answer's envelope
# and every tensor header against them before anything is allocated; a non-finite value
# refuses the whole answer. `gnorm` is the stage's last gradient norm after clipping (the
# asker validates it: node/ml/recovery/checkfree.check_grad_norm). `step` is the host's clock,
# `trained` the steps the weights were trained (0 from the seed; absent from a node older
# than 2026-11-27: unknown), which the asker caps at the swarm's step
# (docs/pipeline.md, "What a stage's weights claim").

WEIGHTS_PROTOCOL_ID: Final = "/peertrain/pipe-weights/1.0.0"
WEIGHTS_DTYPE: Final = "float32"
MAX_WEIGHT_TENSORS: Final = 4096
_WEIGHTS_BODY: Final = frozenset({"run", "stage", "step", "gnorm", "names", "shapes"})
_WEIGHTS_BODIES: Final = (_WEIGHTS_BODY, _WEIGHTS_BODY | {"trained"})
WEIGHTS_DEADLINE_S: Final = 60.0
#: What a stage host reads from an asker: one small envelope, no tensor.
WEIGHTS_REQUEST_LIMITS: Final = StreamLimits(WEIGHTS_PROTOCOL_ID + " request", 512,
                                             deadline_s=WEIGHTS_DEADLINE_S)
#: What the asker reads; its own bound is the largest tensor of the stage it asked for.
WEIGHTS_RESPONSE_LIMITS: Final = StreamLimits(WEIGHTS_PROTOCOL_ID + " response", 1 << 20,
                                              MAX_TENSOR_BYTES, frozenset({CODEC}),
                                              deadline_s=WEIGHTS_DEADLINE_S)


@dataclass(frozen=True, slots=True)
class WeightsReceived:
    stage: int
    step: int
    gnorm: float
    tensors: dict[str, torch.Tensor]
    trained: int | None = None  # None: an older host did not say


@dataclass(frozen=True, slots=True)
class NoWeights:
    reason: str


# The transformer blocks (CheckFree), the whole stage, or its ends: the embedding of the
# first stage, the final norm of the last (CheckFree+ restores a lost edge stage's ends from
# the copy its neighbour keeps, and that neighbour answers for it).
PARTS: Final = ("blocks", "all", "ends")


def encode_weights_request(run: str, stage: int, part: str = "all") -> bytes:
    if part not in PARTS:
        raise LocalProtocolError(f"part must be one of {PARTS}, not {part!r}")
    return encode_envelope(Envelope("pipe.wget", 0, {"run": run, "stage": stage, "part": part}),
                           max_frame_bytes=MAX_ENVELOPE_BYTES)


def check_weights_request(env: Any, run: str) -> tuple[int, str]:
    """(stage, part) a `pipe.wget` envelope asks for (RemoteProtocolError if malformed)."""
    if not isinstance(env, Envelope) or env.type != "pipe.wget":
        raise RemoteProtocolError(f"expected pipe.wget, got {_short(getattr(env, 'type', env))}")
    body = env.body
    if not isinstance(body, dict) or set(body) != {"run", "stage", "part"}:
        raise RemoteProtocolError("pipe.wget body must be {run, stage, part}")
    if body["part"] not in PARTS:
        raise RemoteProtocolError(f"part must be one of {PARTS}, got {_short(body['part'])}")
    if body["run"] != run:
        raise RemoteProtocolError(f"run {_short(body['run'])} is not this stream's run {run}")
    if type(body["stage"]) is not int or not 0 <= body["stage"] < 256:
        raise RemoteProtocolError(f"stage must be an int in [0, 256), got {_short(body['stage'])}")
    return body["stage"], body["part"]


def encode_no_weights(reason: str) -> bytes:
    return encode_envelope(Envelope("pipe.wnone", 0, {"reason": reason[:200]}),
                           max_frame_bytes=MAX_ENVELOPE_BYTES)


def encode_weights(run: str, stage: int, step: int, gnorm: float,
                   tensors: dict[str, torch.Tensor], trained: int | None = None
                   ) -> list[bytes | memoryview]:
    """The answer's gather list: envelope, then one fp32 tensor frame per name."""
    import torch

    names = sorted(tensors)
    wire = {k: tensors[k].detach().to(device="cpu", dtype=torch.float32).contiguous()
            for k in names}
    body = {"run": run, "stage": stage, "step": step, "gnorm": float(gnorm), "names": names,
            "shapes": [list(wire[k].shape) for k in names]}
    if trained is not None:
        body["trained"] = trained
    out: list[bytes | memoryview] = [encode_envelope(Envelope("pipe.weights", 0, body),
                                                     max_frame_bytes=1 << 20)]
    for k in names:
        dtype, shape, view = tensor_payload(wire[k])
        header = make_tensor_header(k, dtype, shape, CODEC, view)
        out.extend(encode_tensor_frame(header, view, max_frame_bytes=1 << 20))
    return out


class WeightsReceiver:
    """Sans-IO reader of one answer, bound to the names and shapes the asker expects."""

    def __init__(self, run: str, stage: int, expected: dict[str, tuple[int, ...]]) -> None:
        if not expected or len(expected) > MAX_WEIGHT_TENSORS:
            raise LocalProtocolError(f"expected 1..{MAX_WEIGHT_TENSORS} tensors")
        self.run, self.stage = run, stage
        self.expected = {k: tuple(v) for k, v in expected.items()}
        largest = max(math.prod(s) for s in self.expected.values()) * 4
        if largest > MAX_TENSOR_BYTES:
            raise LocalProtocolError(f"a tensor of {largest} bytes is over {MAX_TENSOR_BYTES}")
        self._decoder = replace(WEIGHTS_RESPONSE_LIMITS, max_tensor_bytes=largest).decoder(
            payload_buffer=self._check)
        self._order: list[str] = []
        self._got: dict[str, torch.Tensor] = {}
        self._head: dict[str, Any] | None = None

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._decoder.feed(data)

    def next_event(self) -> WeightsReceived | NoWeights | _NeedData:
        while True:
            event = self._decoder.next_event()
            if event is NEED_DATA:
                return NEED_DATA
            if isinstance(event, Envelope):
                refused = self._on_envelope(event)
                if refused is not None:
                    return refused
                continue
            received = self._on_tensor(event)
            if received is not None:
                return received

    def _on_envelope(self, env: Envelope) -> NoWeights | None:
        if self._head is not None:
            raise RemoteProtocolError(f"{_short(env.type)} while tensor frames were due")
        if env.type == "pipe.wnone":
            reason = env.body.get("reason") if isinstance(env.body, dict) else None
            return NoWeights(reason[:200] if isinstance(reason, str) else "no reason given")
        if env.type != "pipe.weights":
            raise RemoteProtocolError(f"unexpected message type {_short(env.type)}")
        b = env.body
        if not isinstance(b, dict) or set(b) not in _WEIGHTS_BODIES:
            raise RemoteProtocolError(f"pipe.weights body must have {sorted(_WEIGHTS_BODY)} "
                                      "and may have trained")
        if b["run"] != self.run or b["stage"] != self.stage:
            raise RemoteProtocolError(f"weights of run {_short(b['run'])} stage "
                                      f"{_short(b['stage'])}, asked {self.run} {self.stage}")
        if type(b["step"]) is not int or not 0 <= b["step"] < MAX_STEP:
            raise RemoteProtocolError(f"step must be an int >= 0, got {_short(b['step'])}")
        trained = b.get("trained", 0)
        if type(trained) is not int or not 0 <= trained < MAX_STEP:
            raise RemoteProtocolError(f"trained must be an int >= 0, got {_short(trained)}")
        if not isinstance(b["gnorm"], float | int) or isinstance(b["gnorm"], bool):
            raise RemoteProtocolError(f"gnorm must be a number, got {_short(b['gnorm'])}")
        names, shapes = b["names"], b["shapes"]
        if (not isinstance(names, list) or not isinstance(shapes, list)
                or len(names) != len(shapes)
                or set(names) != set(self.expected) or len(set(names)) != len(names)):
            raise RemoteProtocolError("weights name other tensors than the stage holds")
        for k, s in zip(names, shapes, strict=True):
            if not isinstance(s, list) or tuple(s) != self.expected[k]:
                raise RemoteProtocolError(f"tensor {_short(k)}: shape {_short(s)}, the stage "
                                          f"holds {list(self.expected[k])}")
        self._head, self._order = b, list(names)
        return None

    def _check(self, header: TensorHeader) -> None:
        if self._head is None or not self._order:
            raise RemoteProtocolError("tensor frame without a pipe.weights envelope")
        name = self._order[0]
        if header.name != name or header.dtype != WEIGHTS_DTYPE or header.codec != CODEC:
            raise RemoteProtocolError(f"tensor {_short(header.name)} {_short(header.dtype)}, "
                                      f"expected {name!r} {WEIGHTS_DTYPE}")
        if tuple(header.shape) != self.expected[name]:
            raise RemoteProtocolError(f"tensor {name!r}: shape {list(header.shape)}")
        return None

    def _on_tensor(self, frame: TensorFrame) -> WeightsReceived | None:
        import torch

        if self._head is None or not self._order:
            raise RemoteProtocolError("tensor frame without a pipe.weights envelope")
        name = self._order.pop(0)
        t = tensor_from_payload(frame.header, frame.payload)
        if not bool(torch.isfinite(t).all()):
            raise RemoteProtocolError(f"weights {name!r} hold NaN or inf")
        self._got[name] = t
        if self._order:
            return None
        head, self._head = self._head, None
        return WeightsReceived(head["stage"], head["step"], float(head["gnorm"]), self._got,
                               head.get("trained"))
