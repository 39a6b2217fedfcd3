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

from .base import AggregateResult, Incoming, State, copy_state, validate_incoming, work_dtype

SKIPPED = ("running_mean", "running_var", "num_batches_tracked")  # normalisation statistics
Target = Literal["others", "self", "conservative"]


def corrected(name: str, tensor: torch.Tensor) -> bool:
    """Whether a tensor is rescaled: float, more than one value (a scalar has no spread),
    not a normalisation statistic (its spread is data, not initialisation)."""
    leaf = name.rsplit(".", 1)[-1]
    return tensor.is_floating_point() and tensor.numel() > 1 and leaf not in SKIPPED


def _var(t: torch.Tensor) -> float:
    return float(t.var(unbiased=False))  # population variance, as the reference code


class VarianceCorrected:
    """w̄ = c·own + (1−c)·mean(received), then w' = (w̄ − μ)·sqrt((v* + ε)/(Var(w̄) + ε)) + μ
    per tensor, with v* the mean variance of the received models ("others", the paper's
    "auto"), our own variance ("self"), or c·self + (1−c)·others ("conservative")."""

    name = "vc"

    def __init__(
        self, self_id: str, c: float = 0.5, target: Target = "others", eps: float = 1e-4
    ) -> None:
        if not 0 <= c < 1:
            raise ValueError(f"c must be in [0, 1), not {c}")
        if target not in ("others", "self", "conservative"):
            raise ValueError(f"target must be others, self or conservative, not {target!r}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, not {eps}")
        self.self_id, self.c, self.target, self.eps = self_id, c, target, eps

    def aggregate(self, round: int, own: State, incoming: Sequence[Incoming]) -> AggregateResult:
        accepted, rejected = validate_incoming(own, incoming, self_id=self.self_id)
        if not accepted:
            return AggregateResult(copy_state(own), {"self": 1.0}, rejected)
        k = len(accepted)
        out: State = {}
        for name, mine in own.items():
            if not mine.is_floating_point():
                out[name] = mine.detach().clone()
                continue
            dtype = work_dtype(mine.dtype)
            received = [i.state[name].to(dtype) for i in accepted]
            avg = self.c * mine.to(dtype) + (1 - self.c) * torch.stack(received).mean(dim=0)
            if corrected(name, mine):
                avg = self._rescale(avg, mine.to(dtype), received)
            out[name] = avg.to(mine.dtype)
        weights = {"self": self.c, **{i.peer: (1 - self.c) / k for i in accepted}}
        return AggregateResult(out, weights, rejected)

    def _rescale(
        self, avg: torch.Tensor, mine: torch.Tensor, received: list[torch.Tensor]
    ) -> torch.Tensor:
        others = sum(_var(r) for r in received) / len(received)
        if self.target == "others":
            target = others
        elif self.target == "self":
            target = _var(mine)
        else:
            target = self.c * _var(mine) + (1 - self.c) * others
        spread = _var(avg) + self.eps
        if not spread > 0:  # a constant tensor with eps = 0: nothing to rescale
            return avg
        mu = avg.mean()
        scale = ((target + self.eps) / spread) ** 0.5
        return (avg - mu) * scale + mu
