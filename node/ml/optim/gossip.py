"""Gossip learning's outer step: the model becomes what an aggregator makes of it and of the
neighbours' models (specs/algorithms.md §2-3), in place of NoLoCo's momentum step.

The swarm moves flat fp32 vectors (`Trainer.parameters_vector()` layout); the aggregators
work per named tensor (variance correction rescales each tensor on its own, SybilWall keeps
per-peer histories). This class converts between the two, without copying on the way in.

The aggregator runs in the trainer thread while the trio thread gossips SybilWall's history
table (node/averaging/history_gossip.py): both hold `lock` while touching the aggregator.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

Layout = list[tuple[str, torch.Size]]


def layout_of(model: torch.nn.Module) -> Layout:
    """(name, shape) of each parameter, in `parameters()` order (tied weights once)."""
    return [(name, p.shape) for name, p in model.named_parameters()]


class GossipLearning:
    """θ ← aggregate(θ, neighbours' θ). With `aggregator=None` received models are ignored:
    a testnet attacker's sybils keep their poisoned model and only send it."""

    # Each round meets the round's neighbours: no exchange spanning several rounds
    # (node/training/service.py, "Spans"), whose boundaries would leave them unmet.
    spans = False

    def __init__(self, layout: Layout, aggregator: Any | None) -> None:
        self.layout = layout
        self.numel = sum(shape.numel() for _, shape in layout)
        self.aggregator = aggregator
        self.lock = threading.Lock()
        # The last aggregation, for `node status`: weight per peer ("self" too) and why any
        # received model was refused.
        self.last_weights: dict[str, float] = {}
        self.last_rejected: dict[str, str] = {}

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into `vector` (no copy)."""
        if vector.dim() != 1 or vector.numel() != self.numel:
            raise ValueError(f"expected {self.numel} values, got shape {tuple(vector.shape)}")
        out, offset = {}, 0
        for name, shape in self.layout:
            n = shape.numel()
            out[name] = vector[offset : offset + n].view(shape)
            offset += n
        return out

    def flatten(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([state[name].reshape(-1).float() for name, _ in self.layout])

    def outer_step(
        self,
        theta: torch.Tensor,
        partners: Sequence[torch.Tensor] = (),
        *,
        peers: Sequence[str] = (),
        round: int = 0,
    ) -> torch.Tensor | None:
        """The new model for round `round`, given our θ and the `partners`' θs from `peers`
        (aligned; unknown peers are named by position). None: keep the model untouched (an
        attacker, which ignores what it receives; even θ + (θ_now − θ) would round)."""
        if self.aggregator is None:
            return None
        if not partners:
            return theta.clone()
        from node.ml.aggregate import Incoming

        names = list(peers) + [f"peer-{i}" for i in range(len(peers), len(partners))]
        incoming, rejected = [], {}
        for name, vector in zip(names, partners, strict=False):
            try:
                incoming.append(Incoming(name, self.unflatten(vector)))
            except ValueError as e:
                rejected[name] = str(e)
        with self.lock:
            result = self.aggregator.aggregate(round, self.unflatten(theta), incoming)
        self.last_weights = {k: float(f"{v:.3g}") for k, v in result.weights.items()}
        self.last_rejected = {**rejected, **result.rejected}
        return self.flatten(result.state)
