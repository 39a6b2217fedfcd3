"""Compressed outer steps: top-k of the pseudo-gradient with error feedback (pure torch).

SparseLoCo (arXiv 2508.15706; the Covenant-72B run) showed that DiLoCo's pseudo-gradient
survives being cut to its top 1-3% per chunk of 4096 values in 2 bits, provided what was
not sent is kept locally and added to the next round's (error feedback), whose decay also
stands in for the outer momentum. This module keeps that state and builds the frames
(`protocols.sparse`, the "topk" codec) for two outer optimizers:

- `CompressedDiLoCo` (the SparseLoCo baseline): Δ = φ − θ, e ← β·e + Δ, send C(e),
  e ← e − C(e); φ ← φ − η·mean(C(e_i)) (plus outer momentum μ when configured; 0 is
  SparseLoCo's choice).
- `CompressedNoLoCo`: Δ = θ − φ (NoLoCo's descent sign), the same error feedback, and at
  the indices it sends, the sender's anchor φ coded modulo 2^a on a coarse grid: the
  receiver decodes it against its own anchor and pulls toward it only there.
      m ← μ·m + η·( (C_self + Σ_p C_p)/|G| + Σ_p [φ̂_p − φ]_{I_p} / |G| )
      φ ← φ + m;  θ ← φ
  With no compression (every index, exact values and anchors) this is NoLoCo's
  m ← μ·m + η·(θ̄ − φ). docs/training.md writes the rules out and says why.

Vectors are flat fp32 (`Trainer.parameters_vector()` layout), on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocols import sparse

from ._vectors import as_flat_fp32
from .diloco import DiLoCoConfig, diloco_update
from .noloco import NoLoCoConfig, noloco_update


@dataclass(frozen=True, slots=True)
class TopKConfig:
    """The compression: k = round(density * chunk) entries per chunk, `value_bits` each."""

    chunk: int = 4096  # SparseLoCo's chunk; in-chunk indices take 12 bits
    density: float = 1 / 64  # k 64 of 4096 (SparseLoCo: 1-3%)
    value_bits: int = 2  # sign + 1 magnitude bit (lo or hi of the chunk's kept values)
    ef_decay: float = 1.0  # β: e ← β·e + Δ
    anchor_bits: int = 2  # NoLoCo's anchor codes at the sent indices (0: no anchor pull)
    anchor_range: float = 4.0  # κ: the anchor grid covers ±κ·max|m| of the chunk
    # λ in [0, 1]: the model continues from φ ± λ·e instead of φ, so the next inner phase
    # starts from (part of) this replica's own unsent progress; e still holds all of it
    # and θ − φ ∓ λ·e_prev is the new progress (nothing is counted twice). 0: SparseLoCo's θ ← φ
    keep_residual: float = 1.0  # the bench's choice for NoLoCo (docs/training.md)
    # True: select and send in each chunk's orthonormal DCT-II domain (DeMo's transform,
    # on flat chunks): the error feedback and the anchor codes live there too
    dct: bool = False

    def __post_init__(self) -> None:
        if self.chunk & (self.chunk - 1) or not 64 <= self.chunk <= 65536:
            raise ValueError(f"chunk must be a power of two in [64, 65536], got {self.chunk}")
        if not 0 < self.density <= 1 or self.k < 1:
            raise ValueError(f"density must keep at least one value per chunk: {self.density}")
        if not sparse.MIN_VALUE_BITS <= self.value_bits <= sparse.MAX_VALUE_BITS:
            raise ValueError(f"value_bits must be in [2, 8], got {self.value_bits}")
        if not 0 <= self.keep_residual <= 1:
            raise ValueError(f"keep_residual must be in [0, 1], got {self.keep_residual}")
        if not 0 < self.ef_decay <= 1:
            raise ValueError(f"ef_decay must be in (0, 1], got {self.ef_decay}")
        if not (self.anchor_bits == 0 or 2 <= self.anchor_bits <= 16):
            raise ValueError(f"anchor_bits must be 0 or in [2, 16], got {self.anchor_bits}")
        if not self.anchor_range > 0:
            raise ValueError(f"anchor_range must be > 0, got {self.anchor_range}")

    @property
    def k(self) -> int:
        return min(self.chunk, round(self.density * self.chunk))

    def frame_bytes(self, numel: int, *, anchor: bool) -> int:
        """Bytes of one frame for `numel` values (what a peer sends per outer step)."""
        return sparse.encoded_size(numel, self.chunk, self.k, self.value_bits,
                                   self.anchor_bits if anchor else 0)


def topk_indices(vec: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Sorted global indices of the min(k, len) largest |values| of every chunk of `vec`."""
    n = vec.numel()
    full = n - n % chunk
    parts = []
    if full:
        rows = vec[:full].abs().view(-1, chunk)
        idx = rows.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        idx += torch.arange(0, full, chunk, dtype=torch.int64).unsqueeze(1)
        parts.append(idx.reshape(-1))
    if full < n:
        tail = vec[full:].abs()
        parts.append(tail.topk(min(k, tail.numel()), sorted=False).indices.sort().values + full)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class ChunkDCT:
    """Orthonormal DCT-II of every chunk of a flat vector (matrices cached by length; the
    inverse is the transpose). O(chunk) work per value: fine for benches and GPUs; a CPU
    peer with a large model would want an FFT-based DCT."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._mats: dict[int, torch.Tensor] = {}

    def _mat(self, n: int) -> torch.Tensor:
        if n not in self._mats:
            k = torch.arange(n, dtype=torch.float64)[:, None]
            i = torch.arange(n, dtype=torch.float64)[None, :]
            m = torch.cos(torch.pi / n * (i + 0.5) * k) * (2 / n) ** 0.5
            m[0] /= 2**0.5
            self._mats[n] = m.float()
        return self._mats[n]

    def _apply(self, v: torch.Tensor, inverse: bool) -> torch.Tensor:
        n, c = v.numel(), self.chunk
        full = n - n % c
        out = torch.empty_like(v)
        if full:
            m = self._mat(c)
            out[:full] = (v[:full].view(-1, c) @ (m if inverse else m.T)).reshape(-1)
        if full < n:
            m = self._mat(n - full)
            out[full:] = (m.T if inverse else m) @ v[full:]
        return out

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self._apply(v, inverse=False)

    def inverse(self, v: torch.Tensor) -> torch.Tensor:
        return self._apply(v, inverse=True)


class ErrorFeedback:
    """The residual of what was not sent, added to the next round's vector (pure state)."""

    def __init__(self, numel: int, config: TopKConfig) -> None:
        self.config = config
        self.e = torch.zeros(numel, dtype=torch.float32)

    def compress(self, delta: torch.Tensor, *, anchor: torch.Tensor | None = None,
                 eps: torch.Tensor | None = None) -> sparse.Frame:
        """e ← β·e + Δ; send the top-k of e, quantized; e ← e − (what the peer decodes).

        With `anchor` (a full vector) and `eps` (per chunk), the frame also carries the
        anchor's modulo codes at the sent indices."""
        c = self.config
        self.e.mul_(c.ef_decay).add_(delta)
        idx = topk_indices(self.e, c.chunk, c.k)
        frame = sparse.make_frame(
            self.e.numel(), c.chunk, c.k, idx, self.e[idx], c.value_bits,
            anchor=None if anchor is None else anchor[idx], eps=eps,
            anchor_bits=c.anchor_bits if anchor is not None else 0)
        self.e[idx] -= frame.values  # only the sent indices change: the rest carries on
        return frame.with_dct(c.dct)


def _chunk_absmax(vec: torch.Tensor, chunk: int) -> torch.Tensor:
    n = vec.numel()
    pad = (-n) % chunk
    a = vec.abs()
    if pad:
        a = torch.cat([a, a.new_zeros(pad)])
    return a.view(-1, chunk).amax(dim=1)


class CompressedNoLoCo:
    """One peer's NoLoCo whose exchange is a "topk" frame (module docstring for the rule).

    Per round: `frame = opt.prepare(theta)` (send `sparse.encode(frame)`), then
    `phi = opt.outer_step(frame, received_frames)` with the partners' decoded frames
    (empty: a local step on what this peer's own frame carries)."""

    def __init__(self, params: torch.Tensor, config: NoLoCoConfig | None = None,
                 topk: TopKConfig | None = None) -> None:
        self.config = NoLoCoConfig() if config is None else config
        self.topk = TopKConfig() if topk is None else topk
        self.phi = as_flat_fp32(params, what="initial parameters").clone()
        self.m = torch.zeros_like(self.phi)
        self.ef = ErrorFeedback(self.phi.numel(), self.topk)
        self.dct = ChunkDCT(self.topk.chunk)
        self.rounds = 0

    def _fwd(self, v: torch.Tensor) -> torch.Tensor:
        return self.dct.forward(v) if self.topk.dct else v

    def _raw(self, v: torch.Tensor, frame: sparse.Frame) -> torch.Tensor:
        return self.dct.inverse(v) if frame.dct else v

    def _residual(self) -> torch.Tensor:
        """e in the weights' domain."""
        return self.dct.inverse(self.ef.e) if self.topk.dct else self.ef.e

    def anchor_grid(self) -> torch.Tensor:
        """eps per chunk: the 2^a codes span ±κ·max|m| of the chunk (0 before any step)."""
        c = self.topk
        return _chunk_absmax(self._fwd(self.m), c.chunk) * (2 * c.anchor_range
                                                          / (1 << c.anchor_bits))

    def prepare(self, theta_local: torch.Tensor) -> sparse.Frame:
        """This round's frame: the error-fed top-k of θ − φ, with φ's codes at its indices."""
        theta = as_flat_fp32(theta_local, like=self.phi, what="theta_local")
        with_anchor = self.topk.anchor_bits > 0
        delta = theta - self.phi
        if self.topk.keep_residual:  # θ started at φ + λe: θ − φ already holds λe
            delta.sub_(self._residual(), alpha=self.topk.keep_residual)
        return self.ef.compress(self._fwd(delta),
                                anchor=self._fwd(self.phi) if with_anchor else None,
                                eps=self.anchor_grid() if with_anchor else None)

    def direction(self, own: sparse.Frame, received: Sequence[sparse.Frame]) -> torch.Tensor:
        """(C_self + Σ C_p + Σ [φ̂_p − φ]_{I_p}) / |G|: NoLoCo's θ̄ − φ, compressed."""
        total = self._raw(own.to_dense(), own)
        phi_dct = self.dct.forward(self.phi) if any(f.dct for f in received) else None
        for f in received:
            if f.numel != total.numel() or (f.dct and f.chunk != self.topk.chunk):
                raise ValueError(f"frame of {f.numel} values (chunk {f.chunk}); expected "
                                 f"{total.numel()} (chunk {self.topk.chunk})")
            part = f.to_dense()
            if f.anchor_bits:
                side = phi_dct if f.dct else self.phi
                assert side is not None
                part.index_add_(0, f.indices, sparse.anchor_estimate(f, side) - side[f.indices])
            total.add_(self._raw(part, f))
        return total.div_(1 + len(received))

    def outer_step(self, own: sparse.Frame,
                   received: Sequence[sparse.Frame] = ()) -> torch.Tensor:
        """m ← μ·m + η·direction; φ ← φ + m. Returns the weights the model continues from
        (φ, or φ + λ·e): copy them into the model."""
        d = self.direction(own, received)
        # noloco_update computes m ← μm + η(x − φ): pass x = φ + d
        noloco_update(self.phi, self.m, d.add_(self.phi), outer_lr=self.config.outer_lr,
                      momentum=self.config.momentum)
        self.rounds += 1
        return self.model_weights()

    def model_weights(self) -> torch.Tensor:
        """What the model continues from: φ, or φ + λ·e with keep_residual λ (a new tensor)."""
        lam = self.topk.keep_residual
        return self.phi.add(self._residual(), alpha=lam) if lam else self.phi


#: SparseLoCo's outer rule: no outer momentum (error feedback stands in for it), η 1,
#: EF decay 0.95, the model reset to φ after each outer step.
SPARSELOCO = DiLoCoConfig(outer_lr=1.0, momentum=0.0, nesterov=False)
SPARSELOCO_TOPK = TopKConfig(anchor_bits=0, ef_decay=0.95, keep_residual=0.0)


class CompressedDiLoCo:
    """One worker's DiLoCo whose all-reduce carries "topk" frames: SparseLoCo by default."""

    def __init__(self, params: torch.Tensor, config: DiLoCoConfig | None = None,
                 topk: TopKConfig | None = None) -> None:
        self.config = SPARSELOCO if config is None else config
        self.topk = SPARSELOCO_TOPK if topk is None else topk
        self.phi = as_flat_fp32(params, what="initial parameters").clone()
        self.m = torch.zeros_like(self.phi)
        self.ef = ErrorFeedback(self.phi.numel(), self.topk)
        self.dct = ChunkDCT(self.topk.chunk)
        self.rounds = 0

    def _residual(self) -> torch.Tensor:
        return self.dct.inverse(self.ef.e) if self.topk.dct else self.ef.e

    def prepare(self, theta_local: torch.Tensor) -> sparse.Frame:
        """This worker's frame: the error-fed top-k of Δ = φ − θ (no anchor: φ is shared)."""
        theta = as_flat_fp32(theta_local, like=self.phi, what="theta_local")
        delta = self.phi - theta
        if self.topk.keep_residual:  # θ started at φ − λe
            delta.sub_(self._residual(), alpha=self.topk.keep_residual)
        return self.ef.compress(self.dct.forward(delta) if self.topk.dct else delta)

    def outer_step(self, frames: Sequence[sparse.Frame]) -> torch.Tensor:
        """The mean of every worker's frame (this one's included), then DiLoCo's step."""
        if not frames:
            raise ValueError("frames is empty: pass at least this worker's own")
        total = torch.zeros_like(self.phi)
        for f in frames:
            total.add_(self.dct.inverse(f.to_dense()) if f.dct else f.to_dense())
        diloco_update(self.phi, self.m, total.div_(len(frames)),
                      outer_lr=self.config.outer_lr, momentum=self.config.momentum,
                      nesterov=self.config.nesterov)
        self.rounds += 1
        lam = self.topk.keep_residual
        return self.phi.sub(self._residual(), alpha=lam) if lam else self.phi


TOPK_STATE_FORMAT = "peertrain.topk-outer"
TOPK_STATE_VERSION = 1


class SwarmTopK:
    """CompressedNoLoCo or CompressedDiLoCo as the training service drives an outer
    optimizer (`outer.codec = "topk"`; node/training/service.py, docs/training.md).

    At round r's boundary the service calls `prepare(θ_r, r)` and hands the frame's bytes
    (not θ_r) to the averager; the outcome brings the partners' decoded frames (NoLoCo) or
    every worker's, this one's included (DiLoCo's all-gather), and `outer_step` pairs them
    with the frame prepared for that round. No partner frame: a local step on this peer's
    own frame (the error feedback kept what it did not carry). The weights it returns are
    applied late by the service like any other outer step's (overlap.apply_late)."""

    compressed = True  # the service sends `prepare`'s frame, not the weights

    def __init__(self, inner: CompressedNoLoCo | CompressedDiLoCo) -> None:
        self.inner = inner
        self.diloco = isinstance(inner, CompressedDiLoCo)
        self.synchronous = self.diloco  # DiLoCo waits for its all-gather, as SwarmDiLoCo
        self._own: dict[int, sparse.Frame] = {}  # round -> the frame prepared for it

    @property
    def phi(self) -> torch.Tensor:
        return self.inner.phi

    @property
    def rounds(self) -> int:
        return self.inner.rounds

    def prepare(self, theta_local: torch.Tensor, round: int) -> bytes:
        """Round `round`'s frame, encoded; kept until that round's outer step."""
        frame = self._own[round] = self.inner.prepare(theta_local)
        for old in [r for r in self._own if r < round]:  # closed rounds never come back
            del self._own[old]
        return sparse.encode(frame)

    def outer_step(self, theta_local: torch.Tensor, group: Sequence[sparse.Frame] = (), *,
                   peers: Sequence[str] = (), round: int = 0) -> torch.Tensor:
        """The outer step for `round` with the frames received for it (none: local)."""
        own = self._own.pop(round, None)
        if own is None:  # never prepared (a caller outside the service): prepare now
            own = self.inner.prepare(theta_local)
        if any(not isinstance(f, sparse.Frame) for f in group):
            raise TypeError("a topk outer step takes decoded frames, not dense vectors")
        if isinstance(self.inner, CompressedDiLoCo):
            return self.inner.outer_step(list(group) or [own])
        return self.inner.outer_step(own, list(group))

    def state_dict(self) -> dict[str, object]:
        return {"format": TOPK_STATE_FORMAT, "version": TOPK_STATE_VERSION,
                "rounds": self.inner.rounds, "phi": self.inner.phi.clone(),
                "m": self.inner.m.clone(), "e": self.inner.ef.e.clone()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if state.get("format") != TOPK_STATE_FORMAT or state.get("version") != TOPK_STATE_VERSION:
            raise ValueError(f"not a {TOPK_STATE_FORMAT} v{TOPK_STATE_VERSION} state")
        for name, dst in (("phi", self.inner.phi), ("m", self.inner.m), ("e", self.inner.ef.e)):
            dst.copy_(as_flat_fp32(state[name], like=dst,  # type: ignore[arg-type]
                                   what=f"state {name}"))
        self.inner.rounds = int(state["rounds"])  # type: ignore[call-overload]
