"""Variance-corrected averaging (Tian et al., arXiv 2404.04616; specs/algorithms.md §2).

Averaging K weakly correlated models (different initialisations, early gossip) divides each
tensor's weight variance by about K: below the initialisation's optimum, which slows
learning ("vanishing variance"). After averaging, each tensor is rescaled around its mean
back to the variance the received models had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from .base import AggregateResult, Incoming, State, validate_incoming

SKIPPED = ("running_mean", "running_var", "num_batches_tracked")  # normalisation statistics
Target = Literal["others", "self", "conservative"]


def corrected(name: str, tensor: torch.Tensor) -> bool:
    """Whether a tensor is rescaled: float, more than one value, not a norm statistic."""
    return tensor.is_floating_point() and tensor.numel() > 1 and not name.endswith(SKIPPED)


class VarianceCorrected:
    """w̄ = c·own + (1−c)·mean(received), then w' = (w̄ − μ)·sqrt((v* + ε)/(Var(w̄) + ε)) + μ
    per tensor, with v* the mean variance of the received models ("others", the paper's
    "auto"), our own variance ("self"), or c·self + (1−c)·others ("conservative")."""

    name = "vc"

    def __init__(self, self_id: str, c: float = 0.5, target: Target = "others",
                 eps: float = 1e-4) -> None:
        if not 0 <= c < 1:
            raise ValueError(f"c must be in [0, 1), not {c}")
        if target not in ("others", "self", "conservative"):
            raise ValueError(f"target must be others, self or conservative, not {target!r}")
        self.self_id, self.c, self.target, self.eps = self_id, c, target, eps

    def aggregate(self, round: int, own: State, incoming: Sequence[Incoming]) -> AggregateResult:
        accepted, rejected = validate_incoming(own, incoming)
        if not accepted:
            return AggregateResult({k: v.clone() for k, v in own.items()}, {"self": 1.0},
                                   rejected)
        k = len(accepted)
        out: State = {}
        for name, mine in own.items():
            if not mine.is_floating_point():
                out[name] = mine.clone()
                continue
            received = [i.state[name].float() for i in accepted]
            avg = self.c * mine.float() + (1 - self.c) * torch.stack(received).mean(dim=0)
            if corrected(name, mine):
                avg = self._rescale(avg, mine.float(), received)
            out[name] = avg.to(mine.dtype)
        weights = {"self": self.c, **{i.peer: (1 - self.c) / k for i in accepted}}
        return AggregateResult(out, weights, rejected)

    def _rescale(self, avg: torch.Tensor, mine: torch.Tensor,
                 received: list[torch.Tensor]) -> torch.Tensor:
        others = sum(float(r.var(unbiased=False)) for r in received) / len(received)
        own = float(mine.var(unbiased=False))
        target = {"others": others, "self": own,
                  "conservative": self.c * own + (1 - self.c) * others}[self.target]
        mu = avg.mean()
        scale = ((target + self.eps) / (float(avg.var(unbiased=False)) + self.eps)) ** 0.5
        return (avg - mu) * scale + mu
