"""The plain mean and the classic robust baselines: coordinate-wise median and Krum."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import AggregateResult, Incoming, State, flat, validate_incoming, weighted_average


class Mean:
    """Equal-weight average of our model and every accepted received model."""

    name = "mean"

    def __init__(self, self_id: str) -> None:
        self.self_id = self_id

    def aggregate(self, round: int, own: State, incoming: Sequence[Incoming]) -> AggregateResult:
        accepted, rejected = validate_incoming(own, incoming)
        states = [own, *(i.state for i in accepted)]
        share = 1.0 / len(states)
        weights = {"self": share, **{i.peer: share for i in accepted}}
        return AggregateResult(weighted_average(states, [1.0] * len(states)), weights, rejected)


class Median:
    """Coordinate-wise median of own + received (robust to a minority of outliers per
    coordinate; with an even count, the lower of the two middle values, as torch does)."""

    name = "median"

    def __init__(self, self_id: str) -> None:
        self.self_id = self_id

    def aggregate(self, round: int, own: State, incoming: Sequence[Incoming]) -> AggregateResult:
        accepted, rejected = validate_incoming(own, incoming)
        states = [own, *(i.state for i in accepted)]
        out = {
            name: torch.stack([s[name].float() for s in states]).median(dim=0).values.to(t.dtype)
            if t.is_floating_point() else t.clone()
            for name, t in own.items()
        }
        share = 1.0 / len(states)
        return AggregateResult(out, {"self": share, **{i.peer: share for i in accepted}},
                               rejected)


class Krum:
    """Krum (Blanchard et al. 2017): the model whose n − f − 2 nearest models are closest
    (sum of squared distances) wins; with `m` > 1, Multi-Krum averages the m best. `f` is
    the number of byzantine models assumed; by default the most that n > 2f + 2 allows."""

    name = "krum"

    def __init__(self, self_id: str, f: int | None = None, m: int = 1) -> None:
        self.self_id, self.f, self.m = self_id, f, max(1, m)

    def aggregate(self, round: int, own: State, incoming: Sequence[Incoming]) -> AggregateResult:
        accepted, rejected = validate_incoming(own, incoming)
        names = ["self", *(i.peer for i in accepted)]
        states = [own, *(i.state for i in accepted)]
        n = len(states)
        f = self.f if self.f is not None else max(0, (n - 3) // 2)
        closest = max(1, n - f - 2)
        vectors = torch.stack([flat(s) for s in states])
        dist = torch.cdist(vectors, vectors).pow(2)
        scores = [float(dist[i][torch.arange(n) != i].sort().values[:closest].sum())
                  if n > 1 else 0.0 for i in range(n)]
        best = sorted(range(n), key=lambda i: (scores[i], names[i]))[: min(self.m, n)]
        weights = {name: (1.0 / len(best) if i in best else 0.0) for i, name in enumerate(names)}
        out = weighted_average([states[i] for i in best], [1.0] * len(best))
        return AggregateResult(out, weights, rejected)
