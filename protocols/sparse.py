"""The "topk" codec: a sparse, low-bit pseudo-gradient frame (SparseLoCo-style), sans-IO.

What a compressed outer step sends (docs/training.md, "Compressed exchange"): for every
chunk of `chunk` values (a power of two), the `k` largest-magnitude entries of the sender's
error-feedback accumulator, as in-chunk indices of log2(chunk) bits, and their values in
`value_bits` bits: 1 sign bit and (value_bits - 1) bits of magnitude on a uniform grid from
the chunk's smallest to its largest kept magnitude (two fp32 scales per chunk). NoLoCo adds,
at the same indices, the sender's anchor φ coded modulo 2^anchor_bits on a per-chunk grid
eps: a coarse form of the anchor that the receiver decodes against its own anchor as side
information (a Wyner-Ziv / modulo quantizer), which is exact to eps/2 while the two anchors
differ by less than eps * (2^(anchor_bits - 1) - 1/2) and bounded otherwise.

    frame (little-endian):
      "PTK1" | value_bits u8 | anchor_bits u8 (0: none) | flags u16 | numel u32 | chunk u32 | k u32
      flags: bit 0 set = the entries are orthonormal DCT-II coefficients of each chunk (the
      receiver inverts the transform); every other bit must be 0
      per chunk: lo f32, hi f32, [eps f32 when anchor_bits]
      indices:  n_kept x log2(chunk) bits, packed LSB first, padded to a byte
      values:   n_kept x value_bits bits, the same
      anchor:   n_kept x anchor_bits bits, the same (when anchor_bits)

Chunk c (values [c*chunk, min((c+1)*chunk, numel))) keeps min(k, its length) entries, so
n_kept and the exact payload size follow from the 20-byte header alone. `decode` checks the
header against what the receiver expects (numel) and against the run's bounds (density
k/chunk, value and anchor bit widths: `Bounds`, from the manifest) and the payload's size
*before* allocating; then that every chunk's indices are strictly increasing (so none is
repeated or unsorted) and inside the chunk, and that every scale is finite and ordered.
Everything refused is a RemoteProtocolError; our own misuse is a LocalProtocolError.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from protocols import codecs as _codecs
from protocols.errors import LocalProtocolError, RemoteProtocolError

CODEC: Final = "topk"
MAGIC: Final = b"PTK1"
_HEADER: Final = struct.Struct("<4sBBHIII")
HEADER_SIZE: Final = _HEADER.size  # 20
MIN_CHUNK_BITS: Final = 6  # chunk 64 ..
MAX_CHUNK_BITS: Final = 16  # .. 65536 (in-chunk indices fit 16 bits)
MIN_VALUE_BITS: Final = 2  # a sign and at least one magnitude bit
MAX_VALUE_BITS: Final = 8
MAX_ANCHOR_BITS: Final = 16
MAX_NUMEL: Final = (1 << 32) - 1
FLAG_DCT: Final = 1  # header flags: the entries are DCT-II coefficients of their chunk

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a receiver accepts, from the run's manifest (outer.topk_*): a frame denser than
    `max_density` or with wider values/anchor codes than the run allows is refused."""

    max_density: float = 1 / 16
    max_value_bits: int = 4
    max_anchor_bits: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.max_density <= 1:
            raise LocalProtocolError(f"max_density must be in (0, 1], not {self.max_density}")
        if not MIN_VALUE_BITS <= self.max_value_bits <= MAX_VALUE_BITS:
            raise LocalProtocolError(f"max_value_bits must be in [2, 8], not {self.max_value_bits}")
        if not 0 <= self.max_anchor_bits <= MAX_ANCHOR_BITS:
            raise LocalProtocolError(
                f"max_anchor_bits must be in [0, 16], not {self.max_anchor_bits}")


def bounds_of(outer: object) -> Bounds:
    """The Bounds a run's manifest sets (`manifest.outer`, its topk_max_* fields)."""
    return Bounds(max_density=float(outer.topk_max_density),  # type: ignore[attr-defined]
                  max_value_bits=int(outer.topk_max_bits),  # type: ignore[attr-defined]
                  max_anchor_bits=int(outer.topk_max_anchor_bits))  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Frame:
    """One sparse vector, as sent and as decoded (the sender keeps the same object, so what
    its error feedback subtracts is exactly what the receiver reconstructs).

    `indices`: global positions (int64, sorted); `values`: their decoded float32 values;
    `anchor_codes`/`eps`: the anchor's modulo codes at `indices` and the per-chunk grid
    (None without an anchor)."""

    numel: int
    chunk: int
    k: int
    value_bits: int
    anchor_bits: int
    indices: torch.Tensor
    codes: np.ndarray  # uint8 value codes: sign << (bits-1) | level
    lo: np.ndarray  # float32 per chunk
    hi: np.ndarray
    values: torch.Tensor
    eps: np.ndarray | None = None
    anchor_codes: np.ndarray | None = None  # int64, in [0, 2**anchor_bits)
    dct: bool = False  # entries are orthonormal DCT-II coefficients of each chunk

    def with_dct(self, dct: bool) -> Frame:
        return dataclasses.replace(self, dct=dct)

    @property
    def density(self) -> float:
        return self.k / self.chunk

    def to_dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The frame as a dense float32 vector of `numel` values (zeros where nothing was sent)."""
        if out is None:
            out = torch.zeros(self.numel, dtype=torch.float32)
        else:
            out.zero_()
        out[self.indices] = self.values
        return out


# --- sizes --------------------------------------------------------------------------------


def n_chunks(numel: int, chunk: int) -> int:
    return -(-numel // chunk)


def n_kept(numel: int, chunk: int, k: int) -> int:
    """Entries a frame carries: min(k, chunk) per full chunk, min(k, rest) for the last."""
    full, rest = divmod(numel, chunk)
    return full * min(k, chunk) + min(k, rest)


def encoded_size(numel: int, chunk: int, k: int, value_bits: int, anchor_bits: int = 0) -> int:
    """Exact payload bytes of a frame: what `decode` requires, and what bench tables count."""
    kept = n_kept(numel, chunk, k)
    scales = n_chunks(numel, chunk) * (3 if anchor_bits else 2) * 4
    idx_bits = chunk.bit_length() - 1
    return (HEADER_SIZE + scales + _packed(kept, idx_bits) + _packed(kept, value_bits)
            + _packed(kept, anchor_bits))


def _packed(count: int, bits: int) -> int:
    return -(-count * bits // 8)


# --- making and encoding ------------------------------------------------------------------


def make_frame(
    numel: int,
    chunk: int,
    k: int,
    indices: torch.Tensor,
    values: torch.Tensor,
    value_bits: int,
    *,
    anchor: torch.Tensor | None = None,
    eps: torch.Tensor | None = None,
    anchor_bits: int = 0,
) -> Frame:
    """Quantize the kept entries into a Frame (our own values: LocalProtocolError on misuse).

    `indices`: int64 global positions, sorted, exactly min(k, len) per chunk; `values`: their
    float32 values. With `anchor_bits`: `anchor` (φ at `indices`) and `eps` (per chunk, >= 0;
    0 sends no anchor information for that chunk)."""
    _check_params(numel, chunk, k, value_bits, anchor_bits, local=True)
    kept = n_kept(numel, chunk, k)
    if indices.shape != (kept,) or values.shape != (kept,):
        raise LocalProtocolError(f"a frame of {numel} values, chunk {chunk}, k {k} keeps {kept}")
    idx = indices.detach().to(torch.int64).cpu().numpy()
    vals = values.detach().to(torch.float32).cpu().numpy()
    if not np.isfinite(vals).all():
        raise LocalProtocolError("values to send contain NaN/Inf")
    starts = _chunk_starts(numel, chunk, k)
    chunk_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    mags = np.abs(vals)
    nc = n_chunks(numel, chunk)
    # every chunk keeps at least one entry, contiguous and in chunk order: reduce per run
    lo = np.minimum.reduceat(mags, starts[:-1]).astype(np.float32) if nc else mags[:0]
    hi = np.maximum.reduceat(mags, starts[:-1]).astype(np.float32) if nc else mags[:0]
    levels = (1 << (value_bits - 1)) - 1
    span = (hi - lo)[chunk_of]
    with np.errstate(all="ignore"):
        t = np.where(span > 0, (mags - lo[chunk_of]) / np.where(span > 0, span, 1), 0)
    level = np.clip(np.rint(t * levels), 0, levels).astype(np.uint8)
    codes = level | ((vals < 0).astype(np.uint8) << (value_bits - 1))
    a_codes = e = None
    if anchor_bits:
        if anchor is None or eps is None or anchor.shape != (kept,) or eps.shape != (nc,):
            raise LocalProtocolError("anchor_bits needs anchor (at indices) and eps (per chunk)")
        e = eps.detach().to(torch.float32).cpu().numpy().copy()
        if not (np.isfinite(e).all() and (e >= 0).all()):
            raise LocalProtocolError("eps must be finite and >= 0")
        e[e < np.finfo(np.float32).tiny] = 0  # a denormal grid would overflow φ / eps
        a = anchor.detach().to(torch.float64).cpu().numpy()
        ee = e[chunk_of].astype(np.float64)
        with np.errstate(all="ignore"):
            z = np.where(ee > 0, np.rint(a / np.where(ee > 0, ee, 1)), 0)
        a_codes = np.mod(z, 1 << anchor_bits).astype(np.int64)
    return _frame(numel, chunk, k, value_bits, anchor_bits, torch.from_numpy(idx.copy()),
                  codes, lo, hi, chunk_of, e, a_codes)


def _frame(numel: int, chunk: int, k: int, value_bits: int, anchor_bits: int,
           indices: torch.Tensor, codes: np.ndarray, lo: np.ndarray, hi: np.ndarray,
           chunk_of: np.ndarray, eps: np.ndarray | None, a_codes: np.ndarray | None) -> Frame:
    """The one dequantizer, shared by sender and receiver."""
    levels = (1 << (value_bits - 1)) - 1
    level = (codes & levels).astype(np.float32)
    sign = np.where(codes >> (value_bits - 1), np.float32(-1), np.float32(1))
    lo64, hi64 = lo[chunk_of], hi[chunk_of]
    mags = lo64 + (hi64 - lo64) * (level / np.float32(levels))
    values = torch.from_numpy((sign * mags).astype(np.float32))
    return Frame(numel, chunk, k, value_bits, anchor_bits, indices, codes, lo, hi, values,
                 eps, a_codes)


def encode(frame: Frame) -> bytes:
    """The frame's bytes (exactly `encoded_size(...)` of them)."""
    nc = n_chunks(frame.numel, frame.chunk)
    head = _HEADER.pack(MAGIC, frame.value_bits, frame.anchor_bits, FLAG_DCT * frame.dct,
                        frame.numel,
                        frame.chunk, frame.k)
    cols = [frame.lo, frame.hi] + ([frame.eps] if frame.anchor_bits else [])
    scales = np.stack([np.asarray(c, dtype="<f4") for c in cols], axis=1).reshape(nc * len(cols))
    starts = _chunk_starts(frame.numel, frame.chunk, frame.k)
    chunk_of = np.repeat(np.arange(nc), np.diff(starts))
    local = frame.indices.numpy() - chunk_of.astype(np.int64) * frame.chunk
    parts = [head, scales.tobytes(),
             _pack(local, frame.chunk.bit_length() - 1),
             _pack(frame.codes.astype(np.int64), frame.value_bits)]
    if frame.anchor_bits:
        assert frame.anchor_codes is not None
        parts.append(_pack(frame.anchor_codes, frame.anchor_bits))
    return b"".join(parts)


# --- decoding -----------------------------------------------------------------------------


def frame_size(header: bytes | bytearray | memoryview, numel: int, bounds: Bounds) -> int:
    """The exact byte size of the frame that begins with `header` (its first HEADER_SIZE
    bytes), after checking the header against `numel` and `bounds`: a stream reader reads
    20 bytes, calls this, and reads exactly that many more or refuses the peer."""
    view = memoryview(header).cast("B")
    if len(view) < HEADER_SIZE:
        raise RemoteProtocolError(f"topk frame of {len(view)} bytes is shorter than its header")
    magic, vbits, abits, flags, n, chunk, k = _HEADER.unpack_from(view)
    if magic != MAGIC or flags & ~FLAG_DCT:
        raise RemoteProtocolError("not a topk v1 frame")
    if n != numel:
        raise RemoteProtocolError(f"topk frame of {n} values; {numel} were expected")
    _check_params(n, chunk, k, vbits, abits, local=False)
    if k / chunk > bounds.max_density:
        raise RemoteProtocolError(
            f"topk density {k}/{chunk} is over the run's bound {bounds.max_density:g}")
    if vbits > bounds.max_value_bits:
        raise RemoteProtocolError(
            f"topk values of {vbits} bits are over the run's bound {bounds.max_value_bits}")
    if abits > bounds.max_anchor_bits:
        raise RemoteProtocolError(
            f"topk anchor codes of {abits} bits are over the run's bound {bounds.max_anchor_bits}")
    return encoded_size(n, chunk, k, vbits, abits)


def check_header(payload: bytes | bytearray | memoryview, numel: int, bounds: Bounds
                 ) -> tuple[int, int, int, int]:
    """(value_bits, anchor_bits, chunk, k) of a whole frame after checking its header and
    exact size against `numel` (what we expect) and `bounds`: nothing is allocated before."""
    view = memoryview(payload).cast("B")
    size = frame_size(view[:HEADER_SIZE], numel, bounds)
    if len(view) != size:
        raise RemoteProtocolError(f"topk frame of {len(view)} bytes; its header says {size}")
    _, vbits, abits, _, _, chunk, k = _HEADER.unpack_from(view)
    return vbits, abits, chunk, k


def decode(payload: bytes | bytearray | memoryview, numel: int, bounds: Bounds) -> Frame:
    """A peer's frame, checked (module docstring): RemoteProtocolError for anything refused."""
    vbits, abits, chunk, k = check_header(payload, numel, bounds)
    view = memoryview(payload).cast("B")
    dct = bool(_HEADER.unpack_from(view)[3] & FLAG_DCT)
    nc = n_chunks(numel, chunk)
    ncols = 3 if abits else 2
    off = HEADER_SIZE
    scales = np.frombuffer(view, dtype="<f4", count=nc * ncols, offset=off).reshape(nc, ncols)
    off += nc * ncols * 4
    if not np.isfinite(scales).all():
        raise RemoteProtocolError("topk scales contain NaN/Inf")
    lo, hi = scales[:, 0].astype(np.float32), scales[:, 1].astype(np.float32)
    if (lo < 0).any() or (hi < lo).any():
        raise RemoteProtocolError("topk scales must satisfy 0 <= lo <= hi")
    eps = None
    if abits:
        eps = scales[:, 2].astype(np.float32)
        if (eps < 0).any():
            raise RemoteProtocolError("topk anchor grid must be >= 0")
    kept = n_kept(numel, chunk, k)
    idx_bits = chunk.bit_length() - 1
    local = _unpack(view, off, kept, idx_bits)
    off += _packed(kept, idx_bits)
    starts = _chunk_starts(numel, chunk, k)
    chunk_of = np.repeat(np.arange(nc), np.diff(starts))
    lengths = np.minimum(chunk, numel - np.arange(nc, dtype=np.int64) * chunk)
    if (local >= lengths[chunk_of]).any():
        raise RemoteProtocolError("topk index out of range")
    if kept > 1:
        step = np.diff(local)
        first = np.zeros(kept, dtype=bool)
        first[starts[:-1][np.diff(starts) > 0]] = True  # a chunk's first index
        if (step[~first[1:]] <= 0).any():
            raise RemoteProtocolError("topk indices repeated or unsorted within a chunk")
    codes = _unpack(view, off, kept, vbits).astype(np.uint8)
    off += _packed(kept, vbits)
    a_codes = _unpack(view, off, kept, abits) if abits else None
    indices = torch.from_numpy(local + chunk_of.astype(np.int64) * chunk)
    frame = _frame(numel, chunk, k, vbits, abits, indices, codes, lo, hi, chunk_of, eps,
                   a_codes)
    if not _codecs.all_finite(frame.values):
        raise RemoteProtocolError("topk values overflow")
    return frame.with_dct(dct)


def anchor_estimate(frame: Frame, own: torch.Tensor) -> torch.Tensor:
    """The sender's anchor at `frame.indices`, decoded against our own anchor `own` (the
    full flat fp32 vector): the value on the sender's grid with its code nearest to ours.
    Where the chunk's eps is 0 it is our own value (no pull). The estimate never lies more
    than eps * 2^(anchor_bits-1) from our own value, whatever the peer sent."""
    if frame.anchor_bits == 0 or frame.eps is None or frame.anchor_codes is None:
        raise LocalProtocolError("this frame carries no anchor")
    if own.dtype != torch.float32 or own.shape != (frame.numel,):
        raise LocalProtocolError(f"own anchor must be a float32 vector of {frame.numel} values")
    mine = own[frame.indices].double().cpu().numpy()
    starts = _chunk_starts(frame.numel, frame.chunk, frame.k)
    e = frame.eps[np.repeat(np.arange(len(starts) - 1), np.diff(starts))].astype(np.float64)
    m = float(1 << frame.anchor_bits)
    q = frame.anchor_codes.astype(np.float64)
    with np.errstate(all="ignore"):
        safe = np.where(e > 0, e, 1)
        z = q + m * np.rint((mine / safe - q) / m)
        est = np.where(e > 0, z * e, mine)
        # z is within m/2 of mine/e: clamp what rounding of huge values could push outside
        est = np.clip(est, mine - e * (m / 2 + 1), mine + e * (m / 2 + 1))
    return torch.from_numpy(est.astype(np.float32))


# --- negotiation --------------------------------------------------------------------------

_fallback_logged: set[str] = set()


def negotiate(offered: Sequence[str], supported: Sequence[str], *, peer: str = "") -> str:
    """`codecs.negotiate` extended with "topk": the first offered codec both sides speak.

    A compressed run offers ("topk", "bf16", ...): a peer that answers with an older dense
    codec is averaged with densely (the receiver then applies the dense rule) and the
    fallback is logged once per peer, not every round."""
    if CODEC in offered and CODEC in supported:
        return CODEC
    chosen = _codecs.negotiate([c for c in offered if c != CODEC],
                               [c for c in supported if c != CODEC])
    if CODEC in offered or CODEC in supported:  # one side wanted topk: a fallback
        key = peer or "?"
        if key not in _fallback_logged:
            _fallback_logged.add(key)
            log.warning("peer %s and we do not both speak the %s codec; averaging in %s"
                        " (dense rule) from now on", key, CODEC, chosen)
    return chosen


# --- helpers ------------------------------------------------------------------------------


def _check_params(numel: int, chunk: int, k: int, vbits: int, abits: int, *, local: bool) -> None:
    err = LocalProtocolError if local else RemoteProtocolError
    if type(numel) is not int or not 0 <= numel <= MAX_NUMEL:
        raise err(f"topk numel must be in [0, 2^32), not {numel!r}")
    if (type(chunk) is not int or chunk & (chunk - 1)
            or not MIN_CHUNK_BITS <= chunk.bit_length() - 1 <= MAX_CHUNK_BITS):
        raise err(f"topk chunk must be a power of two in [64, 65536], not {chunk!r}")
    if type(k) is not int or not 1 <= k <= chunk:
        raise err(f"topk k must be in [1, chunk], not {k!r}")
    if type(vbits) is not int or not MIN_VALUE_BITS <= vbits <= MAX_VALUE_BITS:
        raise err(f"topk value bits must be in [2, 8], not {vbits!r}")
    if type(abits) is not int or not (abits == 0 or 2 <= abits <= MAX_ANCHOR_BITS):
        raise err(f"topk anchor bits must be 0 or in [2, 16], not {abits!r}")


def _chunk_starts(numel: int, chunk: int, k: int) -> np.ndarray:
    """Offsets of each chunk's first entry among the kept ones (length n_chunks + 1)."""
    nc = n_chunks(numel, chunk)
    lengths = np.minimum(chunk, numel - np.arange(nc, dtype=np.int64) * chunk)
    out = np.zeros(nc + 1, dtype=np.int64)
    np.cumsum(np.minimum(k, lengths), out=out[1:])
    return out


def _pack(values: np.ndarray, bits: int) -> bytes:
    """Non-negative ints < 2^bits, `bits` each, LSB first, padded to a byte."""
    if bits == 0 or values.size == 0:
        return b""
    v = values.astype(np.uint32, copy=False)
    planes = np.empty((v.size, bits), dtype=np.uint8)  # one bit plane at a time: small temps
    for b in range(bits):
        planes[:, b] = (v >> b) & 1
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def _unpack(view: memoryview, offset: int, count: int, bits: int) -> np.ndarray:
    """`count` ints of `bits` bits from `view` at `offset` (sizes already checked)."""
    if count == 0 or bits == 0:
        return np.zeros(count, dtype=np.int64)
    raw = np.frombuffer(view, dtype=np.uint8, count=_packed(count, bits), offset=offset)
    planes = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits)
    out = np.zeros(count, dtype=np.int64)
    for b in range(bits):
        out |= planes[:, b].astype(np.int64) << b
    return out
