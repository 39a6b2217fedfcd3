"""Number formats for exchanged weights: fp32, bf16, int8 with per-chunk scales, and zstd.

Measured on weights and deltas (notes/stack.md §3, docs/averaging-protocol.md): the number
format is what matters (bf16 halves the bytes at ~0.2% relative L2 error; int8 with an fp32
absmax scale per 4096 values quarters them at 0.4-1.5%), entropy coding adds 1.1-1.6x on
fp32/bf16 only after a byte-plane shuffle, and nothing on int8. So the codecs are:

    codec       dtype     payload (little-endian)                            error
    fp32        float32   numel x f32                                        exact
    bf16        bfloat16  numel x bf16 (round to nearest even)               ~0.2% rel L2
    int8        int8      ceil(numel/4096) x f32 scale, then numel x i8 q    ~0.5-1.5%
    fp32+zstd   float32   one zstd frame (level 1) of the fp32 bytes,        as fp32
                          byte-plane shuffled: all byte 0s, all byte 1s, ...
    bf16+zstd   bfloat16  the same over the bf16 bytes                       as bf16

int8: values are cut into chunks of INT8_CHUNK; chunk k's scale s_k is its largest |x|, and
x is sent as q = round(127 * x / s_k), decoded as q * s_k / 127 (a chunk of zeros has
s_k = 0). `dtype` and `shape` ([numel]) describe the decoded values, not the payload; they
travel in the tensor frame header (protocols/wire.py) and `decode` checks them.

Decoding checks every size before allocating: uncompressed payloads must be exactly their
size; a zstd frame must be at most zstd's compress bound of its expected size, must announce
that exact content size (or none), and is never inflated past it, so a small frame that
claims gigabytes allocates nothing. Decoded values are refused if any is NaN or Inf: a
poisoned vector never reaches the optimizer.

Errors: RemoteProtocolError for anything about the payload or its description (they came
off the wire); LocalProtocolError for our own misuse (a vector that is not flat fp32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch
import zstandard

from protocols.errors import LocalProtocolError, RemoteProtocolError

#: Every codec this module speaks: a registry, not a preference (the offer's order is).
CODECS: Final = ("fp32", "bf16", "int8", "fp32+zstd", "bf16+zstd")
#: Always supported by both sides: what negotiation falls back to.
FALLBACK: Final = "fp32"
INT8_CHUNK: Final = 4096
ZSTD_LEVEL: Final = 1  # level 3 is slower and never meaningfully smaller (notes/stack.md §3)

# codec -> the wire dtype of its decoded values; dtype -> item size of the raw form.
_DTYPE: Final = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "int8": "int8",
    "fp32+zstd": "float32",
    "bf16+zstd": "bfloat16",
}
_ITEMSIZE: Final = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class Encoded:
    """One encoded vector: put `dtype`, `shape`, `codec` in the tensor header, then `payload`.

    For fp32 `payload` is a view of the caller's tensor (no copy): keep the tensor alive
    and unchanged until the payload is written.
    """

    dtype: str
    shape: tuple[int, ...]
    payload: memoryview | bytes
    codec: str


def dtype_of(codec: str) -> str:
    """The wire dtype that `codec` announces (LocalProtocolError for an unknown codec)."""
    try:
        return _DTYPE[codec]
    except (KeyError, TypeError):
        raise LocalProtocolError(f"unknown codec {codec!r} (known: {list(CODECS)})") from None


def max_encoded_size(codec: str, numel: int) -> int:
    """Payload bytes for `numel` values: exact for fp32/bf16/int8, an upper bound for +zstd
    (zstd's ZSTD_COMPRESSBOUND, which no valid frame of that content exceeds)."""
    dtype = dtype_of(codec)
    if dtype == "int8":
        return 4 * _int8_chunks(numel) + numel
    size = numel * _ITEMSIZE[dtype]
    if codec.endswith("+zstd"):
        return _zstd_bound(size)
    return size


def negotiate(offered: Sequence[str], supported: Sequence[str] = CODECS) -> str:
    """The first codec in the offerer's preference list `offered` that the answering side
    `supports` (and this module knows); FALLBACK ("fp32") when there is none."""
    for codec in offered:
        if codec in supported and codec in _DTYPE:
            return codec
    return FALLBACK


# --- encoding ---------------------------------------------------------------------------


def encode(vec: torch.Tensor, codec: str) -> Encoded:
    """Encode a flat contiguous float32 CPU vector (fp32 without copying it)."""
    dtype = dtype_of(codec)
    if (
        not isinstance(vec, torch.Tensor)
        or vec.dtype != torch.float32
        or vec.dim() != 1
        or not vec.is_contiguous()
        or vec.device.type != "cpu"
    ):
        raise LocalProtocolError("encode takes a contiguous 1-d float32 CPU tensor")
    vec = vec.detach()
    n = vec.numel()
    shape = (n,)
    if dtype == "int8":
        return Encoded(dtype, shape, _int8_encode(vec), codec)
    raw = vec if dtype == "float32" else vec.to(torch.bfloat16)
    if codec.endswith("+zstd"):
        # numpy's transposing copy is ~10x faster than torch's for uint8 (measured).
        planes = np.ascontiguousarray(_bytes(raw).numpy().reshape(n, _ITEMSIZE[dtype]).T)
        compressed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(planes.data)
        return Encoded(dtype, shape, compressed, codec)
    return Encoded(dtype, shape, _view(_bytes(raw)), codec)


def _int8_encode(vec: torch.Tensor) -> memoryview:
    # numpy, single-threaded: 2-3x faster than the same in torch on 1M values, which pays
    # a thread-pool hand-off per op and a fresh temporary for each (measured).
    x = vec.numpy()
    n = x.size
    nchunks = _int8_chunks(n)
    out = np.empty(4 * nchunks + n, dtype=np.uint8)  # [scales][values], one buffer
    scales = out[: 4 * nchunks].view(np.float32)
    q = out[4 * nchunks :].view(np.int8)
    full = n - n % INT8_CHUNK
    with np.errstate(all="ignore"):  # NaN/Inf in our own vector: the peer refuses it
        if full:
            rows = x[:full].reshape(-1, INT8_CHUNK)
            s = scales[: full // INT8_CHUNK]
            np.maximum(rows.max(axis=1), -rows.min(axis=1), out=s)
            _quantize(rows, s[:, None], q[:full].reshape(-1, INT8_CHUNK))
        if full < n:  # the ragged last chunk
            tail = x[full:]
            scales[-1] = np.maximum(tail.max(), -tail.min())
            _quantize(tail, scales[-1:], q[full:])
    return out.data


def _quantize(x: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    # x / scale first: it lies in [-1, 1] even for a denormal scale, where 127 / scale
    # would overflow. A chunk of zeros has scale 0: divide by 1 instead.
    t = x / np.where(scale > 0, scale, np.float32(1))
    t *= np.float32(127)
    np.rint(t, out=t)  # half to even, like torch.round
    np.copyto(out, t, casting="unsafe")


# --- decoding ---------------------------------------------------------------------------


def decode(
    codec: str,
    dtype: str,
    shape: Sequence[int],
    payload: bytes | bytearray | memoryview,
    numel: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `numel` float32 values of an encoded payload, as a writable vector.

    `codec`, `dtype`, `shape` and `payload` are the peer's (from a tensor frame); `numel` is
    how many values we expect. They must all agree, the payload's size is checked before
    anything is allocated, and NaN/Inf values are refused: RemoteProtocolError otherwise.
    With `out` (a contiguous float32 vector of `numel` values) the values are written there
    and `out` is returned; after an error it may hold partial values, to be discarded.
    An fp32 payload that already lies in `out`'s memory (received straight into it) is
    only checked, not copied.
    """
    if out is not None and (
        out.dtype != torch.float32 or out.shape != (numel,) or not out.is_contiguous()
    ):
        raise LocalProtocolError(f"out must be a contiguous float32 vector of {numel} values")
    view = _byte_view(payload)
    check_header(codec, dtype, shape, view.nbytes, numel)
    if codec.endswith("+zstd"):
        raw = _unzstd(view, numel * _ITEMSIZE[dtype])
    else:
        raw = np.frombuffer(view, dtype=np.uint8)  # a view of the payload, no copy
    if out is None:
        out = torch.empty(numel, dtype=torch.float32)
    values = out.numpy()
    with np.errstate(all="ignore"):  # huge scales may overflow to inf: refused just below
        if dtype == "int8":
            _int8_decode(raw, numel, values)
        elif codec.endswith("+zstd"):
            _unshuffle_into(raw, dtype, numel, out)
        elif dtype == "bfloat16":
            out.copy_(_bf16(raw, numel))
        elif numel and raw.ctypes.data != values.ctypes.data:  # else it was received in place
            values[:] = raw.view(np.float32)
    if not all_finite(out):
        raise RemoteProtocolError(f"received {codec} vector contains NaN/Inf")
    return out


def check_header(codec: str, dtype: str, shape: Sequence[int], nbytes: int, numel: int) -> None:
    """What `decode` checks before touching the payload: the peer's `codec`, `dtype`, `shape`
    and payload size `nbytes` must describe `numel` values (RemoteProtocolError otherwise).
    Callers run it on a tensor header, before the payload arrives."""
    if type(numel) is not int or numel < 0:
        raise LocalProtocolError(f"numel must be an int >= 0, not {numel!r}")
    if type(codec) is not str or codec not in _DTYPE:
        raise RemoteProtocolError(f"unknown codec {_short(codec)} (known: {list(CODECS)})")
    if dtype != _DTYPE[codec]:
        raise RemoteProtocolError(
            f"{codec} payload must be announced as {_DTYPE[codec]}, not {_short(dtype)}"
        )
    if (
        type(shape) not in (list, tuple)
        or len(shape) != 1
        or type(shape[0]) is not int
        or shape[0] != numel
    ):
        raise RemoteProtocolError(f"expected shape [{numel}], got {_short(shape)}")
    size = max_encoded_size(codec, numel)
    if codec.endswith("+zstd"):
        if nbytes > size:
            raise RemoteProtocolError(
                f"{codec} payload of {nbytes} bytes is over the {size} that {numel}"
                " values can compress to"
            )
    elif nbytes != size:
        raise RemoteProtocolError(f"{codec} payload of {nbytes} bytes; {numel} values take {size}")


def _unzstd(view: memoryview, expected: int) -> np.ndarray:
    """Inflate one zstd frame of exactly `expected` bytes, allocating no more than that.

    zstandard's `decompress` sizes its output from the frame header's content size when
    there is one, ignoring max_output_size: a 20-byte frame claiming 8 GB gets an 8 GB
    allocation (tests/protocols/test_codecs.py measures it). So the claimed size is checked first;
    max_output_size then bounds frames that claim none.
    """
    try:
        claimed = zstandard.frame_content_size(view)
    except zstandard.ZstdError:  # not a frame header, or too short for one
        raise RemoteProtocolError("payload is not a zstd frame") from None
    # frame_content_size says -1 for "not recorded" (not CONTENTSIZE_UNKNOWN, 2**64 - 1).
    if claimed not in (expected, -1, zstandard.CONTENTSIZE_UNKNOWN):
        raise RemoteProtocolError(
            f"zstd frame claims {claimed} bytes of content; {expected} were expected"
        )
    if expected == 0:
        return np.empty(0, dtype=np.uint8)
    try:
        data = zstandard.ZstdDecompressor().decompress(
            view, max_output_size=expected, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"bad zstd frame: {str(exc)[:200]}") from exc
    if len(data) != expected:
        raise RemoteProtocolError(f"zstd frame holds {len(data)} bytes; {expected} were expected")
    return np.frombuffer(data, dtype=np.uint8)


def _unshuffle_into(planes: np.ndarray, dtype: str, numel: int, out: torch.Tensor) -> None:
    itemsize = _ITEMSIZE[dtype]
    planes = planes.reshape(itemsize, numel).T
    if dtype == "float32":  # straight into out's bytes: the transpose is the only copy
        out.numpy().view(np.uint8).reshape(numel, itemsize)[:] = planes
    else:
        raw = torch.empty(numel, dtype=torch.bfloat16)
        _bytes(raw).numpy().reshape(numel, itemsize)[:] = planes
        out.copy_(raw)


def _bf16(raw: np.ndarray, numel: int) -> torch.Tensor:
    """bfloat16 values over received bytes (numpy has no bfloat16: go through int16)."""
    if numel == 0:
        return torch.empty(0, dtype=torch.bfloat16)
    if not raw.flags.writeable:  # torch wants a writable buffer; we only read it
        raw = raw.copy()
    return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)


def _int8_decode(raw: np.ndarray, numel: int, out: np.ndarray) -> None:
    nchunks = _int8_chunks(numel)
    steps = raw[: 4 * nchunks].view(np.float32) / np.float32(127)
    q = raw[4 * nchunks :].view(np.int8)
    full = numel - numel % INT8_CHUNK
    if full:
        rows = out[:full].reshape(-1, INT8_CHUNK)
        np.multiply(q[:full].reshape(-1, INT8_CHUNK), steps[: full // INT8_CHUNK, None], out=rows)
    if full < numel:
        np.multiply(q[full:], steps[-1], out=out[full:])


# --- helpers ----------------------------------------------------------------------------


def _int8_chunks(numel: int) -> int:
    return -(-numel // INT8_CHUNK)


def _zstd_bound(size: int) -> int:
    # ZSTD_COMPRESSBOUND from zstd.h: the largest frame zstd emits for `size` bytes of input.
    small = ((128 << 10) - size) >> 11 if size < 128 << 10 else 0
    return size + (size >> 8) + small


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (bfloat16 included)."""
    return t.view(-1).view(torch.uint8)


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor as a memoryview, without copying."""
    return t.numpy().data.cast("B")


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise LocalProtocolError(f"payload must be bytes-like, not {type(data).__name__}") from None
    if not view.c_contiguous:
        raise LocalProtocolError("payload must be a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _short(value: object) -> str:
    """A bounded repr for error messages: the value may be the peer's."""
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"<{type(value).__name__} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf: the one finiteness check of received and averaged vectors.

    On a CPU fp32 tensor numpy's isfinite is exact and, on 1M values, ~10x faster than
    torch's (or torch's sum, which the check used to be): torch pays a thread-pool wake-up
    per call. Other tensors (a GPU, other dtypes) take torch's."""
    if tensor.numel() == 0:
        return True
    if tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous():
        return bool(np.isfinite(tensor.detach().numpy()).all())
    return bool(torch.isfinite(tensor).all())
