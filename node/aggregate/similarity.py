"""FoolsGold and SybilWall: down-weight peers whose update histories look alike.

One attacker behind many identities sends the same (or nearly the same) poisoned update
from each, so its identities' histories are far more alike than honest peers' with their
own data. FoolsGold (Fung et al. 2020) scores the histories of the models in this round;
SybilWall (Werthenbach & Pouwelse, arXiv 2306.15044; specs/algorithms.md §3) also scores
histories gossiped from further away, so sybils spread over the swarm still meet in one
similarity matrix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import AggregateResult, Incoming, State, flat, validate_incoming, weighted_average
from .history import HistoryTable


def similarity_weights(histories: Sequence[torch.Tensor]) -> list[float]:
    """FoolsGold's weights in [0, 1]: cosine similarity (diagonal removed), pardoning, 1 −
    the largest similarity, scaled by the largest weight, then the logit step with κ = 1."""
    n = len(histories)
    if n == 0:
        return []
    h = torch.stack([v.float() for v in histories])
    norms = h.norm(dim=1, keepdim=True)
    unit = torch.where(norms > 0, h / norms.clamp_min(1e-30), torch.zeros_like(h))
    sim = (unit @ unit.T).double()
    sim.fill_diagonal_(0.0)
    top = sim.max(dim=1).values if n > 1 else torch.zeros(1, dtype=torch.float64)
    # Pardoning: an honest peer that happens to resemble a sybil is forgiven in proportion.
    row, col = top[:, None], top[None, :]
    pardon = (row < col) & (col > 0)
    sim = torch.where(pardon, sim * row / torch.where(col > 0, col, 1.0), sim)
    w = (1 - sim.max(dim=1).values if n > 1 else torch.ones(1, dtype=torch.float64)).clamp(0, 1)
    if float(w.max()) <= 0:
        return [0.0] * n
    w = w / w.max()
    with torch.no_grad():
        logit = torch.log(w / (1 - w)) + 0.5  # ±inf for w = 1 or 0: clipped just below
    logit = torch.nan_to_num(logit, nan=0.0, posinf=1.0, neginf=0.0)
    return [float(x) for x in logit.clamp(0, 1)]


class SybilWall:
    """Weights from all known histories (neighbours first, then gossiped); our own model
    weight 1; the new model is the weighted average of ours and the neighbours' models,
    renormalised over those N + 1 only.

    This is where SybilWall's reference code goes wrong (spec §3g): it normalises over all
    N + M + 1 scores, then zips only N + 1 models with them, so the own model gets the first
    distant peer's score and the weights used sum to less than 1. Here the distant scores
    inform the matrix and are then dropped.
    """

    name = "sybilwall"
    gossip = True

    def __init__(self, self_id: str, reference: State | None = None, **table_args: int) -> None:
        self.self_id = self_id
        self.reference = flat(reference) if reference is not None else None
        self.history = HistoryTable(self_id, **table_args)

    def aggregate(self, round: int, own: State, incoming: Sequence[Incoming]) -> AggregateResult:
        accepted, rejected = validate_incoming(own, incoming)
        self.history.begin_round(round)
        for item in accepted:
            h = flat(item.state)
            if self.reference is not None and self.reference.numel() == h.numel():
                h = h - self.reference  # updates, not models: the history must not telescope
            self.history.observe_direct(item.peer, round, h)
        if not accepted:
            return AggregateResult({k: v.clone() for k, v in own.items()}, {"self": 1.0},
                                   rejected)
        neighbours = [i.peer for i in accepted]
        scored = neighbours + ([p for p in self.history.entries
                                if p not in neighbours and p != self.self_id]
                               if self.gossip else [])
        scores = similarity_weights([self.history.entries[p].vector for p in scored])
        raw = [1.0, *scores[: len(neighbours)]]
        total = sum(raw)
        weights = {"self": raw[0] / total,
                   **{p: w / total for p, w in zip(neighbours, raw[1:], strict=True)}}
        states = [own, *(i.state for i in accepted)]
        return AggregateResult(weighted_average(states, raw), weights, rejected)


class FoolsGold(SybilWall):
    """The FoolsGold baseline: the same scoring over this round's neighbours only, with
    their accumulated histories but nothing gossiped."""

    name = "foolsgold"
    gossip = False
