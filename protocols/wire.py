"""Frames on a peertrain stream: versioned msgpack envelopes, and tensors as raw payloads.

Every protocol module speaks through these frames; docs/wire.md is the full spec.

    frame         = length:u32-big-endian  envelope:msgpack[length]
    envelope      = {"v": WIRE_VERSION, "t": type, "id": request id, "b": body}
    tensor frame  = a frame of type "tensor" whose body is a header
                    {"name", "dtype", "shape", "codec", "length", "crc32"},
                    followed at once by exactly `length` raw payload bytes (outside msgpack)

Tensor payloads stay outside msgpack so that neither side copies them through it: the
sender writes straight from the tensor's memory (`encode_tensor_frame` returns a gather
list); the receiver appends to a buffer of its own that grows as the bytes arrive (the
announced size is the peer's word, not a reason to allocate), or fills one the caller
names per header (`FrameDecoder.payload_buffer`, e.g. a slice of the final vector, whose
size the caller already knows to be legitimate).

The crc32 catches corruption and framing bugs, not forgery: the secure channel
authenticates the stream. On a transport that authenticates every record itself (the
AES-GCM bulk lane, protocols/lane.py) the crc32 adds nothing but a pass over the bytes on
each side, so a header there may leave it out: a decoder built with
`require_crc32=False` accepts that, and still checks a crc32 that is present.

Limits. `FrameDecoder` takes them as arguments and checks each before allocating:
`max_frame_bytes` (1 MiB) bounds an envelope and is checked on the 4-byte prefix alone;
`max_tensor_bytes` (1 GiB) bounds a payload and is checked on its header, before any of
its bytes are buffered, and 0 refuses every tensor frame on its envelope;
`allowed_codecs` ({"raw"}) are the payload encodings accepted. These defaults are the
format's ceilings: each protocol declares its own, smaller ones (protocols/limits.py).
Fixed by the format: type 1..64 chars, 0 <= id < 2**63, tensor name <= 256 chars,
ndim <= 8, dtype one of `DTYPES`, msgpack nesting <= 1024 (msgpack's own stack), map keys
str or bytes. A "raw" payload must be exactly prod(shape) * itemsize bytes.

Errors (protocols/errors.py): `RemoteProtocolError` when the peer's bytes are refused (the
decoder is then dead: close the stream); `LocalProtocolError` when we misuse the API. Any
other exception out of `FrameDecoder` is a bug (tests/protocols/test_wire.py fuzzes for it).
"""

from __future__ import annotations

import enum
import functools
import math
import struct
import zlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal

import msgpack

from protocols.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

if TYPE_CHECKING:  # torch is imported lazily: framing works without it
    from collections.abc import Callable, Sequence

    import torch

WIRE_VERSION: Final = 1
TENSOR_TYPE: Final = "tensor"

DEFAULT_MAX_FRAME_BYTES: Final = 1 << 20
DEFAULT_MAX_TENSOR_BYTES: Final = 1 << 30
DEFAULT_CODECS: Final = frozenset({"raw"})

MAX_TYPE_LEN: Final = 64
MAX_ID: Final = 2**63  # exclusive; fits an int64 on every implementation
MAX_NAME_LEN: Final = 256
MAX_CODEC_LEN: Final = 64
MAX_NDIM: Final = 8

#: Wire dtype names and their item sizes in bytes; payloads are little-endian (torch's
#: layout on every platform we run on).
DTYPES: Final = MappingProxyType(
    {
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "float64": 8,
        "int8": 1,
        "uint8": 1,
        "int32": 4,
        "int64": 8,
    }
)

_PREFIX = struct.Struct(">I")
_ENVELOPE_KEYS = frozenset({"v", "t", "id", "b"})
_HEADER_KEYS = frozenset({"name", "dtype", "shape", "codec", "length", "crc32"})
_HEADER_KEYS_NO_CRC = _HEADER_KEYS - {"crc32"}


class _NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return "NEED_DATA"


#: Returned by `FrameDecoder.next_event` when no complete event is buffered yet.
NEED_DATA: Final = _NeedData.NEED_DATA


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message: `type` picks the handler, `id` pairs a response with its request."""

    type: str
    id: int
    body: Any
    version: int = WIRE_VERSION


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """What a tensor frame announces before its payload; checked before anything is allocated.

    `length` is the payload's size on the wire (after `codec`), `crc32` is zlib.crc32 of it,
    or None where the header leaves it out (an authenticated transport: see the module doc).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    length: int
    crc32: int | None


@dataclass(frozen=True, slots=True)
class TensorFrame:
    """A received tensor: its header and the payload, checksum verified (if it had one).

    `payload` views the buffer it was received into: the decoder's own, which belongs to
    this event alone (the decoder keeps no reference) and may be wrapped without copying,
    or the one `FrameDecoder.payload_buffer` named for it.
    """

    header: TensorHeader
    payload: memoryview
    id: int = 0


@dataclass(frozen=True, slots=True)
class DecoderStatistics:
    """`frames`: events returned so far; `bytes_in`: bytes fed so far."""

    frames: int
    bytes_in: int


# --- encoding ---------------------------------------------------------------------------


def encode_envelope(env: Envelope, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Length prefix + msgpack of `env`, ready to write.

    Refuses (LocalProtocolError) what the peer would refuse, so our mistakes surface here
    and not as a closed stream: bad type/id, a body msgpack cannot pack, a frame over
    `max_frame_bytes`, and type "tensor" (its payload must follow: `encode_tensor_frame`).
    """
    if type(env.version) is not int or not 0 <= env.version < 2**32:
        raise LocalProtocolError(f"wire version must be an int in [0, 2**32), not {env.version!r}")
    problem = _envelope_problem(env.type, env.id)
    if problem:
        raise LocalProtocolError(problem)
    if env.type == TENSOR_TYPE:
        raise LocalProtocolError("type 'tensor' carries a payload: use encode_tensor_frame")
    return _frame(env.version, env.type, env.id, env.body, max_frame_bytes)


def make_tensor_header(
    name: str,
    dtype: str,
    shape: Sequence[int],
    codec: str,
    payload: bytes | memoryview,
    *,
    crc32: bool = True,
) -> TensorHeader:
    """The header for `payload`: its length and crc32 computed here, every field checked.

    `crc32=False` leaves the checksum out (and skips its pass over the payload): only for a
    transport that authenticates every byte, whose receiver is built with
    `require_crc32=False`; any other receiver refuses such a header.
    """
    view = _byte_view(payload)
    try:
        shape = tuple(shape)
    except TypeError:
        raise LocalProtocolError(f"shape must be a sequence of ints, not {shape!r}") from None
    crc = zlib.crc32(view) if crc32 else None
    header = TensorHeader(name, dtype, shape, codec, view.nbytes, crc)
    problem = _header_problem(name, dtype, shape, codec, header.length, header.crc32)
    if problem:
        raise LocalProtocolError(problem)
    return header


def encode_tensor_frame(
    header: TensorHeader,
    payload: bytes | memoryview,
    *,
    id: int = 0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> list[bytes | memoryview]:
    """A gather list `[prefix + envelope, payload]` for one tensor frame.

    The payload is returned as a view of the caller's memory, not copied: write the items
    in order (e.g. one `send_all` each) and keep the tensor alive until they are written.
    The crc32 is trusted from `header` (make_tensor_header computed it), not recomputed.
    """
    problem = _envelope_problem(TENSOR_TYPE, id) or _header_problem(
        header.name, header.dtype, header.shape, header.codec, header.length, header.crc32
    )
    if problem:
        raise LocalProtocolError(problem)
    view = _byte_view(payload)
    if view.nbytes != header.length:
        raise LocalProtocolError(
            f"payload is {view.nbytes} bytes but the header announces {header.length}"
        )
    body = {
        "name": header.name,
        "dtype": header.dtype,
        "shape": list(header.shape),
        "codec": header.codec,
        "length": header.length,
    }
    if header.crc32 is not None:
        body["crc32"] = header.crc32
    return [_frame(WIRE_VERSION, TENSOR_TYPE, id, body, max_frame_bytes), view]


def _frame(version: int, type_: str, id_: int, body: Any, max_frame_bytes: int) -> bytes:
    try:
        packed = msgpack.packb({"v": version, "t": type_, "id": id_, "b": body}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode the body of {type_!r}: {exc}") from exc
    if len(packed) > max_frame_bytes:
        raise LocalProtocolError(
            f"{type_!r} envelope is {len(packed)} bytes, over max_frame_bytes={max_frame_bytes}"
            " (the peer would refuse it); send bulk data as a tensor frame"
        )
    return _PREFIX.pack(len(packed)) + packed


# --- decoding ---------------------------------------------------------------------------


class _Payload:
    """A tensor payload being received, into the caller's buffer (see payload_buffer) or
    into one of the decoder's own that grows only as payload bytes arrive.

    Never sized from the header alone: the header is the peer's word, and bytearray(n)
    zero-fills all n bytes at once (bytearray(256 MiB) alone makes 269 MB resident), so a
    10-byte header announcing 1 GiB would cost 1 GiB before a payload byte arrived. Grown
    with `+=`, a large bytearray is realloc'd in place (mremap), not copied per step.
    """

    __slots__ = ("buffer", "check_crc", "crc", "filled", "header", "id", "own")

    def __init__(self, header: TensorHeader, id_: int, buffer: memoryview | None) -> None:
        self.header = header
        self.id = id_
        self.buffer = buffer  # the caller's, exactly header.length bytes; or None
        self.own = bytearray() if buffer is None else None  # ours: what arrived so far
        self.filled = 0
        self.crc = 0
        self.check_crc = header.crc32 is not None

    def fill(self, data: memoryview) -> int:
        """Copy what belongs to this payload from `data`; return how many bytes were taken."""
        n = min(len(data), self.header.length - self.filled)
        if n:
            chunk = data[:n]
            if self.own is not None:
                self.own += chunk
            else:
                assert self.buffer is not None
                self.buffer[self.filled : self.filled + n] = chunk
            if self.check_crc:
                self.crc = zlib.crc32(chunk, self.crc)  # while the chunk is still in cache
            self.filled += n
        return n

    def written(self, n: int) -> None:
        """`n` bytes were written in place after the filled part (receive_buffer)."""
        assert self.buffer is not None
        if self.check_crc:
            self.crc = zlib.crc32(self.buffer[self.filled : self.filled + n], self.crc)
        self.filled += n

    @property
    def complete(self) -> bool:
        return self.filled == self.header.length

    def result(self) -> memoryview:
        if self.own is not None:
            return memoryview(self.own)
        assert self.buffer is not None
        return self.buffer


class FrameDecoder:
    """Sans-IO reader of one stream's frames: `feed` bytes in, `next_event` events out.

    `next_event` returns an `Envelope`, a `TensorFrame`, or `NEED_DATA`; call it until
    `NEED_DATA` after each `feed`. It raises `RemoteProtocolError` when the peer's bytes
    are refused, after which the decoder is dead and every call raises that class again.

    Memory: an incomplete envelope is never waited for beyond max_frame_bytes + 4 bytes;
    a payload is received into a buffer that grows as its bytes arrive (never allocated on
    the header's word), or into the one `payload_buffer` names. Apart from that, the
    decoder holds only what was fed and not yet returned as events. Build one from a
    protocol's declared limits (protocols/limits.py: `LIMITS.decoder()`), not by hand.

    `require_crc32=False` is for a transport that authenticates every byte (the AES-GCM
    lane): a tensor header may then leave out its crc32. A crc32 that is present is checked.

    `payload_buffer`, if set, is called with each tensor header once it has passed every
    check, before any of its payload is buffered. It returns a writable, contiguous byte
    memoryview of exactly `header.length` bytes to receive the payload into (say, the slot
    of a preallocated vector, so that nothing is copied twice), or None for a buffer of the
    decoder's own. It may raise RemoteProtocolError to refuse the frame on its header.
    """

    def __init__(
        self,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
        allowed_codecs: frozenset[str] = DEFAULT_CODECS,
        *,
        require_crc32: bool = True,
        payload_buffer: Callable[[TensorHeader], memoryview | None] | None = None,
    ) -> None:
        if type(max_frame_bytes) is not int or not 1 <= max_frame_bytes < 2**32:
            raise LocalProtocolError(
                f"max_frame_bytes must be in [1, 2**32), not {max_frame_bytes}"
            )
        if type(max_tensor_bytes) is not int or max_tensor_bytes < 0:
            raise LocalProtocolError(
                f"max_tensor_bytes must be an int >= 0, not {max_tensor_bytes}"
            )
        codecs = frozenset(allowed_codecs)
        if not all(type(c) is str for c in codecs):
            raise LocalProtocolError(f"allowed_codecs must be strings, not {allowed_codecs!r}")
        self.max_frame_bytes = max_frame_bytes
        self.max_tensor_bytes = max_tensor_bytes
        self.allowed_codecs = codecs
        self.require_crc32 = bool(require_crc32)
        self.payload_buffer = payload_buffer
        self._buffer = bytearray()  # fed bytes not yet consumed
        self._payload: _Payload | None = None  # set between a tensor header and its last byte
        self._error: ProtocolError | None = None
        self._frames = 0
        self._bytes_in = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer `data` (copied: the caller may reuse its buffer). Never parses or raises
        for the peer's sake; errors surface from `next_event`."""
        self._check_alive()
        view = _byte_view(data)
        self._bytes_in += view.nbytes
        if self._payload is not None and not self._buffer:
            # The hot path for big tensors: straight into the payload buffer, one copy.
            view = view[self._payload.fill(view) :]
        if view:
            self._buffer += view

    def receive_buffer(self) -> memoryview | None:
        """Where the stream's next bytes may be written in place, or None.

        While a tensor payload is arriving into a buffer the caller named (payload_buffer)
        and nothing else is buffered, this is the rest of that buffer. A reader that can
        fill memory itself (`recv_into`, an AEAD's `decrypt_into`) writes up to len() bytes
        at its start and then calls `received_into(n)` instead of `feed`: the bytes are
        never copied. At any other
        time (None), `feed` as usual: the decoder's own buffer is never handed out, since
        it grows only by what arrives (handing out room for the rest would mean allocating
        it on the header's word).
        """
        payload = self._payload
        if payload is None or payload.buffer is None or self._buffer or self._error is not None:
            return None
        return payload.buffer[payload.filled :]

    def received_into(self, n: int) -> None:
        """`n` bytes were written at the start of the last `receive_buffer()`."""
        self._check_alive()
        payload = self._payload
        if payload is None or payload.buffer is None or self._buffer:
            raise LocalProtocolError("received_into() without a receive_buffer() to fill")
        if type(n) is not int or not 0 <= n <= len(payload.buffer) - payload.filled:
            raise LocalProtocolError(f"received_into({n!r}): the buffer had room for "
                                     f"{len(payload.buffer) - payload.filled} bytes")
        payload.written(n)
        self._bytes_in += n

    def next_event(self) -> Envelope | TensorFrame | Literal[_NeedData.NEED_DATA]:
        """The next complete event, or `NEED_DATA`."""
        self._check_alive()
        try:
            event = self._next_event()
        except RemoteProtocolError as exc:
            self._error = exc
            raise
        if event is not NEED_DATA:
            self._frames += 1
        return event

    def statistics(self) -> DecoderStatistics:
        return DecoderStatistics(frames=self._frames, bytes_in=self._bytes_in)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise type(self._error)(f"decoder already failed: {self._error}")

    def _next_event(self) -> Envelope | TensorFrame | Literal[_NeedData.NEED_DATA]:
        if self._payload is not None:
            return self._continue_payload()
        buffer = self._buffer
        if len(buffer) < _PREFIX.size:
            return NEED_DATA
        (length,) = _PREFIX.unpack_from(buffer)
        if length > self.max_frame_bytes:
            raise RemoteProtocolError(
                f"frame of {length} bytes exceeds max_frame_bytes={self.max_frame_bytes}"
            )
        if length == 0:
            raise RemoteProtocolError("empty frame")
        end = _PREFIX.size + length
        if len(buffer) < end:
            return NEED_DATA
        frame = buffer[_PREFIX.size : end]  # a copy of at most max_frame_bytes
        del buffer[:end]  # cheap: CPython drops a bytearray prefix by moving its start
        type_, id_, body = _parse_envelope(_unpack(frame))
        if type_ != TENSOR_TYPE:
            return Envelope(type_, id_, body)
        if self.max_tensor_bytes == 0:  # a stream that carries no tensors: not even a header
            raise RemoteProtocolError(
                "tensor frame refused: this stream carries none (max_tensor_bytes=0)"
            )
        header = self._parse_header(body)
        self._payload = _Payload(header, id_, self._caller_buffer(header))
        return self._continue_payload()

    def _continue_payload(self) -> TensorFrame | Literal[_NeedData.NEED_DATA]:
        payload = self._payload
        assert payload is not None
        if self._buffer:
            with memoryview(self._buffer) as buffered:
                taken = payload.fill(buffered)
            del self._buffer[:taken]
        if not payload.complete:
            return NEED_DATA
        self._payload = None
        if payload.check_crc and payload.crc != payload.header.crc32:
            raise RemoteProtocolError(
                f"tensor {payload.header.name!r}: crc32 {payload.crc:#010x} does not match"
                f" the header's {payload.header.crc32:#010x}"
            )
        return TensorFrame(payload.header, payload.result(), payload.id)

    def _caller_buffer(self, header: TensorHeader) -> memoryview | None:
        if self.payload_buffer is None:
            return None
        buffer = self.payload_buffer(header)
        if buffer is not None and (
            type(buffer) is not memoryview
            or buffer.readonly
            or buffer.format != "B"
            or buffer.ndim != 1
            or buffer.nbytes != header.length
        ):
            raise LocalProtocolError(
                f"payload_buffer must return a writable byte memoryview of {header.length}"
                " bytes, or None"
            )
        return buffer

    def _parse_header(self, body: Any) -> TensorHeader:
        if type(body) is not dict or (
            body.keys() != _HEADER_KEYS
            and (self.require_crc32 or body.keys() != _HEADER_KEYS_NO_CRC)
        ):
            raise RemoteProtocolError(
                f"tensor header must be a map with exactly the keys {sorted(_HEADER_KEYS)}"
                + ("" if self.require_crc32 else " (crc32 optional)")
            )
        shape = body["shape"]
        crc32 = body.get("crc32")
        if crc32 is None and "crc32" in body:  # present means an int, even where optional
            raise RemoteProtocolError(f"tensor {_short(body['name'])}: crc32 must be an int")
        problem = _header_problem(
            body["name"], body["dtype"], shape, body["codec"], body["length"], crc32
        )
        if problem:
            raise RemoteProtocolError(problem)
        if body["codec"] not in self.allowed_codecs:
            raise RemoteProtocolError(
                f"tensor codec {body['codec']!r} not accepted"
                f" (allowed: {sorted(self.allowed_codecs)})"
            )
        if body["length"] > self.max_tensor_bytes:
            raise RemoteProtocolError(
                f"tensor payload of {body['length']} bytes exceeds"
                f" max_tensor_bytes={self.max_tensor_bytes}"
            )
        return TensorHeader(
            body["name"], body["dtype"], tuple(shape), body["codec"], body["length"], crc32
        )


def _unpack(frame: bytearray) -> Any:
    n = len(frame)
    try:
        # Every element takes at least one byte (a map entry two), so limits of n keep any
        # declared length from preallocating more than the frame could fill.
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=n,
        )
    except Exception as exc:  # msgpack raises a zoo of types for bad input; all mean this
        raise RemoteProtocolError(f"malformed msgpack envelope: {str(exc)[:200]}") from exc


def _parse_envelope(obj: Any) -> tuple[str, int, Any]:
    if type(obj) is not dict:
        raise RemoteProtocolError(f"envelope must be a msgpack map, not {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int:
        raise RemoteProtocolError("envelope has no integer wire version 'v'")
    if version != WIRE_VERSION:
        raise RemoteProtocolError(
            f"unsupported wire version {version} (this node speaks {WIRE_VERSION})"
        )
    if obj.keys() != _ENVELOPE_KEYS:
        raise RemoteProtocolError(
            f"envelope must have exactly the keys {sorted(_ENVELOPE_KEYS)}, got {len(obj)} keys"
        )
    problem = _envelope_problem(obj["t"], obj["id"])
    if problem:
        raise RemoteProtocolError(problem)
    return obj["t"], obj["id"], obj["b"]


# --- checks shared by both directions: a sentence saying what is wrong, or None ----------


def _envelope_problem(type_: Any, id_: Any) -> str | None:
    if type(type_) is not str or not 1 <= len(type_) <= MAX_TYPE_LEN:
        return f"envelope type must be a str of 1..{MAX_TYPE_LEN} chars"
    if type(id_) is not int or not 0 <= id_ < MAX_ID:
        return f"envelope id must be an int in [0, 2**63), not {_short(id_)}"
    return None


def _header_problem(
    name: Any, dtype: Any, shape: Any, codec: Any, length: Any, crc32: Any
) -> str | None:
    if type(name) is not str or len(name) > MAX_NAME_LEN:
        return f"tensor name must be a str of at most {MAX_NAME_LEN} chars"
    if type(dtype) is not str or dtype not in DTYPES:
        return f"tensor {name!r}: dtype {_short(dtype)} is not one of {sorted(DTYPES)}"
    if type(shape) not in (list, tuple) or len(shape) > MAX_NDIM:
        return f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} ints"
    if not all(type(d) is int and d >= 0 for d in shape):
        return f"tensor {name!r}: shape {_short(shape)} must hold ints >= 0"
    if type(codec) is not str or not 1 <= len(codec) <= MAX_CODEC_LEN:
        return f"tensor {name!r}: codec must be a str of 1..{MAX_CODEC_LEN} chars"
    if type(length) is not int or length < 0:
        return f"tensor {name!r}: length must be an int >= 0, not {_short(length)}"
    if crc32 is not None and (type(crc32) is not int or not 0 <= crc32 < 2**32):
        return f"tensor {name!r}: crc32 must be an int in [0, 2**32), not {_short(crc32)}"
    if codec == "raw":
        expected = math.prod(shape) * DTYPES[dtype]  # exact: Python ints do not overflow
        if length != expected:
            return (
                f"tensor {name!r}: raw {dtype} {_short(list(shape))} is {expected} bytes,"
                f" but length says {length}"
            )
    return None


def _short(value: Any) -> str:
    """repr for error messages, bounded: the value may be the peer's."""
    if type(value) in (list, tuple):  # shapes: at most MAX_NDIM + 1 ints are shown
        if len(value) > MAX_NDIM or not all(type(v) is int for v in value):
            return f"<{type(value).__name__} of {len(value)} items>"
    elif type(value) not in (int, str, bool, float, type(None)):
        return f"<{type(value).__name__}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _byte_view(data: Any) -> memoryview:
    """`data` as a flat memoryview of bytes, without copying."""
    try:
        view = memoryview(data)
    except TypeError:
        raise LocalProtocolError(
            f"expected a bytes-like object, not {type(data).__name__}"
        ) from None
    if view.ndim == 1 and view.format in ("B", "b", "c"):
        return view.cast("B") if view.format != "B" else view
    if not view.c_contiguous:
        raise LocalProtocolError("buffer must be C-contiguous (call .contiguous() first)")
    return view.cast("B")


# --- torch helpers ----------------------------------------------------------------------


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int32": torch.int32,
        "int64": torch.int64,
    }


def tensor_payload(t: torch.Tensor) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, bytes view) of a contiguous CPU tensor, without copying.

    The view keeps the tensor alive. Non-contiguous or GPU tensors are refused rather than
    copied silently: the copy is the caller's to see (`t.contiguous().cpu()`).
    """
    import torch

    names = {dtype: name for name, dtype in _torch_dtypes().items()}
    name = names.get(t.dtype)
    if name is None:
        raise LocalProtocolError(f"dtype {t.dtype} has no wire name (allowed: {sorted(DTYPES)})")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise LocalProtocolError(f"tensor must be dense and on the CPU, not {t.device}/{t.layout}")
    if not t.is_contiguous():
        raise LocalProtocolError("tensor must be contiguous (call .contiguous() first)")
    # Viewing as uint8 covers bfloat16, which numpy and memoryview cannot express.
    flat = t.detach().reshape(-1).view(torch.uint8)
    return name, tuple(t.shape), flat.numpy().data


def tensor_from_payload(header: TensorHeader, payload: bytes | memoryview) -> torch.Tensor:
    """A new CPU tensor holding `payload` (raw bytes: undo any codec first), copied once.

    Disagreement between the header and the payload's size raises RemoteProtocolError:
    both came off the wire.
    """
    import torch

    dtypes = _torch_dtypes()
    shape = header.shape
    if type(header.dtype) is not str or header.dtype not in dtypes:
        raise RemoteProtocolError(f"dtype {_short(header.dtype)} is not one of {sorted(DTYPES)}")
    if type(shape) not in (list, tuple) or len(shape) > MAX_NDIM:
        raise RemoteProtocolError(f"shape must be a list of at most {MAX_NDIM} ints")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise RemoteProtocolError(f"shape {_short(shape)} must hold ints >= 0")
    view = _byte_view(payload)
    expected = math.prod(shape) * DTYPES[header.dtype]
    if view.nbytes != expected:
        raise RemoteProtocolError(
            f"tensor {header.name!r}: {header.dtype} {list(shape)} needs {expected} bytes,"
            f" payload has {view.nbytes}"
        )
    out = torch.empty(expected, dtype=torch.uint8)  # no bigger than the payload in hand
    out.numpy().data[:] = view
    return out.view(dtypes[header.dtype]).reshape(shape)
