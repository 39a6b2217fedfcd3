"""Aggregators: what a peer makes of its own model and the models its neighbours sent.

Pure tensor code over named-tensor models (no networking), shared by the swarm
(node/ml/optim/gossip.py) and the in-process benchmark (testnet/bench/robust_sim.py):

    agg = make_aggregator("sybilwall", self_id=me, reference=initial_state)
    result = agg.aggregate(round, own_state, [Incoming(peer, state), ...])
    result.state, result.weights, result.rejected

Every aggregator first refuses (with a reason in `rejected`) a model whose tensor names,
shapes or dtypes differ from ours or that holds NaN/Inf; with nothing accepted, the result
is our own model. docs/robustness.md explains each aggregator.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

from .base import AggregateResult, Incoming, State, validate_incoming, weighted_average
from .history import HistoryEntry, HistoryTable
from .robust import Krum, Mean, Median
from .similarity import FoolsGold, SybilWall, similarity_weights
from .variance import VarianceCorrected

_CLASSES = {c.name: c for c in (Mean, VarianceCorrected, Median, Krum, FoolsGold, SybilWall)}
AGGREGATORS = tuple(_CLASSES)  # ("mean", "vc", "median", "krum", "foolsgold", "sybilwall")


class Aggregator(Protocol):
    name: str

    def aggregate(self, round: int, own: State, incoming: list[Incoming]) -> AggregateResult: ...


def make_aggregator(name: str, *, self_id: str, **params: Any) -> Aggregator:
    """The aggregator called `name` (one of AGGREGATORS) with its parameters; ValueError
    names an unknown aggregator or parameter (they come from a manifest)."""
    try:
        cls = _CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown aggregator {name!r}; known: {', '.join(AGGREGATORS)}") from None
    try:
        inspect.signature(cls).bind(self_id, **params)
    except TypeError as e:
        known = [p for p in inspect.signature(cls).parameters if p != "self_id"]
        raise ValueError(f"aggregator {name!r}: {e}; its parameters: {known or 'none'}") from None
    return cls(self_id, **params)


__all__ = [
    "AGGREGATORS",
    "AggregateResult",
    "Aggregator",
    "FoolsGold",
    "HistoryEntry",
    "HistoryTable",
    "Incoming",
    "Krum",
    "Mean",
    "Median",
    "State",
    "SybilWall",
    "VarianceCorrected",
    "make_aggregator",
    "similarity_weights",
    "validate_incoming",
    "weighted_average",
]
