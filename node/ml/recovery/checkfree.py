"""Rebuilding a lost pipeline stage from its neighbours: CheckFree and CheckFree+.

Rules (specs/algorithms.md §4c, from gensyn-ai/CheckFree's simulation code):

- **CheckFree** (an interior stage s lost on every replica): W_s = (ω_{s-1} W_{s-1} +
  ω_{s+1} W_{s+1}) / (ω_{s-1} + ω_{s+1}) with ω_j = ‖g_j‖ + 1e-4, where ‖g_j‖ is neighbour
  j's last gradient norm measured *after* its clipping (so two neighbours that both clip
  weigh the same: a plain average). Then a fresh Adam with the learning rate times
  `lr_boost` (1.1), kept for that stage. Other stages are untouched.
- **CheckFree+** adds out-of-order execution (node/ml/pipeline/schedule.py) so that the first
  two and the last two stages with blocks can stand in for each other: a lost one of those
  four is a **copy** of its swap partner, and a lost embedding or head (the ends) is the
  copy its neighbour keeps (`EdgeCopies`). A tied embedding is copied, never averaged.
- **The edges under CheckFree** (the manifest's default rule): a first or last stage,
  which CheckFree cannot rebuild, takes CheckFree+'s rule where the layout has one (a
  copy of its swap partner with at least 4 stages with blocks; a 0-block end from its
  neighbour's copy): `edge_plan`. Without the swap's training the copy is rougher than
  CheckFree+'s, but far from the seed.
- **Adjacent losses** (stages a..b all lost, or holding only untrained weights): each is
  rebuilt from the nearest surviving stage on each side, a-1 and b+1, with the same
  formula and each side's ω divided by its distance in stages (the nearer side counts
  more; a single loss has distance 1 on both sides: CheckFree itself). docs/pipeline.md,
  "Adjacent losses".
- **Baselines** for the benchmark: a 0.5/0.5 neighbour average (`neighbour_average`, the
  reference's network emulation) and a fresh initialisation.

A stage that still has a live replica is copied from it (the checkpoint pull does that);
these rules are for a stage with none left. Pure functions over state dicts: no network.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from node.ml.pipeline.schedule import block_stages, swap_partner

EPS = 1e-4  # the reference's ω = ‖g‖ + 1e-4: neither weight is ever 0
DEFAULT_LR_BOOST = 1.1  # 124M and 1.5B configs; 1.2 at 500M (§4c)
MAX_GRAD_NORM = 1e6  # a norm above this is nonsense even without clipping

State = Mapping[str, torch.Tensor]
Mode = Literal["checkfree", "checkfree+"]


class RecoveryError(ValueError):
    """A stage that cannot be rebuilt by the rule asked for; the message says why."""


class BadGradNorm(ValueError):
    """A gossiped gradient norm refused (negative, NaN, inf, or above what clipping allows)."""


def check_grad_norm(value: object, grad_clip: float) -> float:
    """A neighbour's gossiped gradient norm, validated: a float in [0, bound], where the
    bound is the clip threshold (norms are measured after clipping: nothing honest is
    larger) or MAX_GRAD_NORM without clipping. Raises BadGradNorm with the reason."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadGradNorm(f"gradient norm must be a number, got {type(value).__name__}")
    x = float(value)
    if math.isnan(x):
        raise BadGradNorm("gradient norm is NaN")
    if math.isinf(x):
        raise BadGradNorm("gradient norm is infinite")
    if x < 0:
        raise BadGradNorm(f"gradient norm is negative ({x!r})")
    bound = grad_clip * (1 + 1e-3) if grad_clip > 0 else MAX_GRAD_NORM
    if x > bound:
        why = (f"above the clip threshold {grad_clip:g} it is measured after"
               if grad_clip > 0 else f"absurdly large (> {MAX_GRAD_NORM:g})")
        raise BadGradNorm(f"gradient norm {x:g} is {why}")
    return x


def _same_shapes(a: State, b: State, what: str) -> None:
    if set(a) != set(b):
        raise RecoveryError(f"{what}: the stages hold different tensors "
                            f"({sorted(set(a) ^ set(b))[:3]}...)")
    for k in a:
        if a[k].shape != b[k].shape:
            raise RecoveryError(f"{what}: {k} is {tuple(a[k].shape)} on one side and "
                                f"{tuple(b[k].shape)} on the other")


def _finite(state: State, what: str) -> None:
    for k, v in state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise RecoveryError(f"{what}: {k} holds NaN or inf")


def checkfree_weights(norm_prev: float, norm_next: float, eps: float = EPS,
                      distances: tuple[int, int] = (1, 1)) -> tuple[float, float]:
    """The two sources' weights, ω / distance each, normalised to sum to 1."""
    w_prev, w_next = (norm_prev + eps) / distances[0], (norm_next + eps) / distances[1]
    return w_prev / (w_prev + w_next), w_next / (w_prev + w_next)


def weighted_average(prev: State, nxt: State, w_prev: float, w_next: float
                     ) -> dict[str, torch.Tensor]:
    """w_prev * prev + w_next * nxt, tensor by tensor, in fp32, in the inputs' dtypes."""
    _same_shapes(prev, nxt, "neighbour average")
    _finite(prev, "previous stage")
    _finite(nxt, "next stage")
    return {k: (w_prev * prev[k].float() + w_next * nxt[k].float()).to(prev[k].dtype)
            for k in prev}


def checkfree_average(prev: State, nxt: State, norm_prev: float, norm_next: float,
                      eps: float = EPS, distances: tuple[int, int] = (1, 1)
                      ) -> dict[str, torch.Tensor]:
    """CheckFree's rebuilt blocks: the gradient-norm-weighted average of the neighbours'
    (of the nearest surviving stages, each weighed by 1 / its distance, past adjacent
    losses)."""
    w_prev, w_next = checkfree_weights(norm_prev, norm_next, eps, distances)
    return weighted_average(prev, nxt, w_prev, w_next)


def neighbour_average(prev: State, nxt: State) -> dict[str, torch.Tensor]:
    """The plain 0.5/0.5 average (the reference's emulation; a benchmark baseline)."""
    return weighted_average(prev, nxt, 0.5, 0.5)


@dataclass(frozen=True, slots=True)
class Plan:
    """How to rebuild a lost stage: `rule` "average" (from `sources`, the nearest
    surviving stage on each side, `distances` away) or "copy" (from `sources[0]`, the swap
    partner), plus the ends copy to restore if the stage held the embedding or the head."""

    stage: int
    rule: Literal["average", "copy", "none"]
    sources: tuple[int, ...]
    ends: bool  # restore the embedding / head from the copy a neighbour keeps
    distances: tuple[int, ...] = (1, 1)  # "average": how many stages away each source is


def plan(lost: int, layers: Sequence[int], mode: Mode, lost_too: Collection[int] = ()
         ) -> Plan:
    """Which rule rebuilds stage `lost` of a pipeline with `layers` blocks per stage, when
    the stages in `lost_too` are lost as well (no host, or only untrained weights).

    CheckFree: an interior stage, from the nearest surviving stage on each side (the
    neighbours for a single loss), both holding as many blocks. CheckFree+: also the first
    two and last two stages with blocks, copied from their swap partner where it survives,
    and 0-block end stages (embedding / head only), restored from their neighbour's copy.

    Under CheckFree (the manifest's default) a stage it cannot rebuild, an edge, takes
    CheckFree+'s rule where the layout allows one (`edge_plan`): restarting the first stage
    from the seed cost the testnet 2.69 -> 5.18 in loss, a copy of its partner 2.59 -> 3.60
    without the swap's training (docs/pipeline.md, "Recovery live"; issue 27).
    """
    n = len(layers)
    if not 0 <= lost < n:
        raise RecoveryError(f"stage {lost} is not a stage of a {n}-stage pipeline")
    if mode == "checkfree":
        try:
            return _plan(lost, layers, mode, lost_too)
        except RecoveryError as e:
            edge = edge_plan(lost, layers, lost_too)
            if edge is None:
                raise e from None
            return edge
    return _plan(lost, layers, mode, lost_too)


def edge_plan(lost: int, layers: Sequence[int], lost_too: Collection[int] = ()
              ) -> Plan | None:
    """CheckFree+'s rule for stage `lost` where the layout allows it without CheckFree+'s
    swap having run: a 0-block end stage (its neighbour's copy of the ends), or one of the
    first two / last two stages with blocks of a layout with at least 4 of them (a copy of
    its swap partner, plus the ends if it holds them). None where there is no such rule
    (fewer than 4 block stages, or the partner lost too)."""
    if len(block_stages(layers)) < 4 and layers[lost] > 0:
        return None
    try:
        return _plan(lost, layers, "checkfree+", lost_too)
    except RecoveryError:
        return None


def edges_have_rule(layers: Sequence[int], mode: str) -> bool:
    """Whether a lost first or last stage has a rule that needs its neighbour's copy of
    the ends (node/pipe/weights.py's `keep_ends` keeps one only then)."""
    if mode not in ("checkfree", "checkfree+"):
        return False
    for edge in (0, len(layers) - 1):
        try:
            if plan(edge, layers, mode).ends:  # type: ignore[arg-type]
                return True
        except RecoveryError:
            pass
    return False


def _plan(lost: int, layers: Sequence[int], mode: Mode, lost_too: Collection[int] = ()
          ) -> Plan:
    n = len(layers)
    ends = lost in (0, n - 1)
    if layers[lost] == 0:
        if mode == "checkfree+" and ends:
            return Plan(lost, "none", (), True)
        raise RecoveryError(f"stage {lost} holds only the (de)embedding: CheckFree+ restores "
                            "it from its neighbour's copy; CheckFree cannot")
    gone = set(lost_too) | {lost}
    if mode == "checkfree+":
        partner = swap_partner(lost, layers)
        if partner is not None and partner not in gone:
            return Plan(lost, "copy", (partner,), ends)
    prev = max((j for j in range(lost) if j not in gone), default=-1)
    nxt = min((j for j in range(lost + 1, n) if j not in gone), default=n)
    if prev < 0 or nxt >= n or layers[prev] != layers[lost] or layers[nxt] != layers[lost]:
        raise RecoveryError(
            f"stage {lost} is an edge of the pipeline (layers {list(layers)}, lost "
            f"{sorted(gone)}): CheckFree averages the nearest surviving stage on each side, "
            "holding as many blocks; CheckFree+ covers edge stages")
    return Plan(lost, "average", (prev, nxt), False, (lost - prev, nxt - lost))


def rebuild_blocks(p: Plan, blocks: Mapping[int, State], norms: Mapping[int, float],
                   grad_clip: float, eps: float = EPS) -> dict[str, torch.Tensor] | None:
    """The lost stage's blocks by `p`: `blocks[j]` and `norms[j]` are what stage j's
    hosts sent (norms are validated here: check_grad_norm). None for an ends-only stage."""
    if p.rule == "none":
        return None
    missing = [j for j in p.sources if j not in blocks]
    if missing:
        raise RecoveryError(f"stage {p.stage}: no weights from stage {missing[0]}")
    if p.rule == "copy":
        src = blocks[p.sources[0]]
        _finite(src, f"stage {p.sources[0]}")
        return {k: v.detach().clone() for k, v in src.items()}
    prev, nxt = p.sources
    if prev not in norms or nxt not in norms:
        raise RecoveryError(f"stage {p.stage}: no gradient norm from stage "
                            f"{prev if prev not in norms else nxt}")
    d_prev, d_next = p.distances
    return checkfree_average(blocks[prev], blocks[nxt],
                             check_grad_norm(norms[prev], grad_clip),
                             check_grad_norm(norms[nxt], grad_clip), eps, (d_prev, d_next))


class EdgeCopies:
    """CheckFree+'s copies of the (de)embedding, kept by the neighbours of the end stages.

    The first stage's neighbour keeps the embedding (token and position tables); the last
    stage's neighbour the final norm. The head matrix is the token embedding (tied), so a
    lost last stage borrows it again from the first stage, and a lost first stage's
    embedding comes from this copy: copied, never averaged (§4g). Refreshed every
    `every` steps: V x d values, far below a checkpoint.
    """

    def __init__(self, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self._copies: dict[int, dict[str, torch.Tensor]] = {}
        self.refreshed_at: dict[int, int] = {}

    def refresh(self, stage: int, ends: State, step: int) -> None:
        if step % self.every == 0 or stage not in self._copies:
            self._copies[stage] = {k: v.detach().clone() for k, v in ends.items()}
            self.refreshed_at[stage] = step

    def get(self, stage: int) -> dict[str, torch.Tensor]:
        if stage not in self._copies:
            raise RecoveryError(f"no copy of stage {stage}'s (de)embedding is kept")
        return {k: v.clone() for k, v in self._copies[stage].items()}
