"""The plain mean and the classic robust baselines: coordinate-wise median and Krum."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import (
    AggregateResult,
    Incoming,
    State,
    flat,
    validate_incoming,
    weighted_average,
    work_dtype,
)


class Mean:
    """Equal-weight average of our model and every accepted received model."""

    name = "mean"

    def __init__(self, self_id: str) -> None:
        self.self_id = self_id

    def aggregate(self, round: int, own: State, incoming: Sequence[Incoming]) -> AggregateResult:
        accepted, rejected = validate_incoming(own, incoming, self_id=self.self_id)
        states = [own, *(i.state for i in accepted)]
        share = 1.0 / len(states)
        weights = {"self": share, **{i.peer: share for i in accepted}}
        return AggregateResult(weighted_average(states, [1.0] * len(states)), weights, rejected)


class Median:
    """Coordinate-wise median of own + received: robust while outliers are a minority in
    every coordinate. With an even count it takes the lower middle value (torch's rule),
    so the result is always a value some model holds. No model has a weight as such: each
    gets the 1/n share it has in the vote."""

    name = "median"

    def __init__(self, self_id: str) -> None:
        self.self_id = self_id

    def aggregate(self, round: int, own: State, incoming: Sequence[Incoming]) -> AggregateResult:
        accepted, rejected = validate_incoming(own, incoming, self_id=self.self_id)
        states = [own, *(i.state for i in accepted)]
        out: State = {}
        for name, t in own.items():
            if not t.is_floating_point():
                out[name] = t.detach().clone()
                continue
            stacked = torch.stack([s[name].to(work_dtype(t.dtype)) for s in states])
            out[name] = stacked.median(dim=0).values.to(t.dtype)
        share = 1.0 / len(states)
        return AggregateResult(out, {"self": share, **{i.peer: share for i in accepted}}, rejected)


class Krum:
    """Krum (Blanchard et al. 2017) over own + received: each model's score is the sum of
    squared distances to its n − f − 2 nearest others; the lowest score wins, and with
    `m` > 1 (Multi-Krum) the m lowest are averaged. `f` is the number of byzantine models
    assumed; by default the largest with n > 2f + 2 (Krum's condition), i.e. ⌊(n − 3)/2⌋.
    Weights: 1/m for each selected model, 0 for the others."""

    name = "krum"

    def __init__(self, self_id: str, f: int | None = None, m: int = 1) -> None:
        if f is not None and f < 0:
            raise ValueError(f"f (byzantine models assumed) must be >= 0, not {f}")
        if m < 1:
            raise ValueError(f"m (models selected) must be >= 1, not {m}")
        self.self_id, self.f, self.m = self_id, f, m

    def aggregate(self, round: int, own: State, incoming: Sequence[Incoming]) -> AggregateResult:
        accepted, rejected = validate_incoming(own, incoming, self_id=self.self_id)
        names = ["self", *(i.peer for i in accepted)]
        states = [own, *(i.state for i in accepted)]
        scores = self.scores(states)
        best = sorted(range(len(states)), key=lambda i: (scores[i], names[i]))[: self.m]
        weights = {name: (1.0 / len(best) if i in best else 0.0) for i, name in enumerate(names)}
        out = weighted_average([states[i] for i in best], [1.0] * len(best))
        for k, v in own.items():  # non-float tensors (counters) stay ours, not the winner's
            if not v.is_floating_point():
                out[k] = v.detach().clone()
        return AggregateResult(out, weights, rejected)

    def scores(self, states: Sequence[State]) -> list[float]:
        """Each model's Krum score (lower is more central)."""
        n = len(states)
        if n == 1:
            return [0.0]
        f = self.f if self.f is not None else max(0, (n - 3) // 2)
        closest = max(1, n - f - 2)
        vectors = torch.stack([flat(s) for s in states])
        # Differences computed directly (not |a|² + |b|² − 2a·b, which cancels badly for
        # near-equal models), then squared in fp64.
        dist = torch.cdist(vectors, vectors, compute_mode="donot_use_mm_for_euclid_dist")
        dist = dist.double().square()
        dist.fill_diagonal_(float("inf"))
        nearest = dist.sort(dim=1).values[:, :closest]
        return [float(x) for x in nearest.sum(dim=1)]
