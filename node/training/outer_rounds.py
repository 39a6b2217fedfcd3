"""The delayed outer round, shared by data-parallel training and a pipeline stage's replicas.

At an exchange boundary r the trainer thread snapshots θ_r (`open`) and the trio side
exchanges it; the trainer keeps stepping. The outcome comes back through `deliver` (any
thread) and is applied at the trainer's next `apply`: φ ← outer_step(θ_r, what the
partners sent) and θ ← φ + (θ_now − θ_r), so the steps made meanwhile are kept
(node/ml/optim/overlap.py; docs/training.md, "Delayed application"). A round still open at
the next boundary is closed with a local outer step: a slow or dead partner delays nothing.

node/training/service.py (the whole model, NoLoCo, DiLoCo, gossip learning, topk) and
node/pipe/replicas.py (one stage's own parameters, NoLoCo between its replicas) drive it
from their trainer threads; each keeps what is its own (spans and the compressed frame;
a stage alone on its replica set). Only `deliver` may be called from another thread.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from node.ml.types import aggregating
from node.training.rounds import Outcome, TrainingStats

if TYPE_CHECKING:
    import torch

    from node.ml.types import OuterOptimizer


class OuterRounds:
    """Open rounds (round -> θ_r) and the outcomes that close them, counted in `stats`
    (rounds_averaged, rounds_local, last_partner, outer_s, aggregation: what heartbeats
    and `node status` show). `read` and `write` give and take the flat vector the outer
    optimizer works on; `on_averaged` hears every outcome that came with partners."""

    def __init__(self, outer: OuterOptimizer, read: Callable[[], torch.Tensor],
                 write: Callable[[torch.Tensor], None], stats: TrainingStats,
                 on_averaged: Callable[[Outcome], None] = lambda outcome: None) -> None:
        self.outer = outer
        self.read, self.write = read, write
        self.stats = stats
        self.on_averaged = on_averaged
        self.pending: dict[int, torch.Tensor] = {}  # round -> θ_r awaiting its outcome
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()

    def deliver(self, outcome: Outcome) -> None:
        """An exchange's outcome, from any thread; applied at the next `apply`."""
        self._outcomes.put(outcome)

    def open(self, r: int) -> torch.Tensor:
        """Round r's boundary: close what is still open locally, then snapshot θ_r (the
        caller hands a copy to the exchange; this one stays for the outer step)."""
        self.close_all()
        started = time.perf_counter()
        self.pending[r] = theta = self.read()
        self.stats.outer_s += time.perf_counter() - started
        return theta

    def close_all(self) -> None:
        """Every open round closed with a local outer step (its outcome will be too late)."""
        for r in sorted(self.pending):
            self._step(self.pending.pop(r), Outcome(r, []))
            self.stats.rounds_local += 1

    def apply(self) -> None:
        """The outcomes that came, each applied to the round it closes; one whose round
        was already closed locally is dropped."""
        while True:
            try:
                outcome = self._outcomes.get_nowait()
            except queue.Empty:
                return
            theta = self.pending.pop(outcome.round, None)
            if theta is None:  # too late: that round was already closed locally
                continue
            self._step(theta, outcome)
            if outcome.partner_thetas:
                self.on_averaged(outcome)
                self.stats.rounds_averaged += 1
                self.stats.last_partner = outcome.partner
            else:
                self.stats.rounds_local += 1

    def _step(self, theta: torch.Tensor, outcome: Outcome) -> None:
        started = time.perf_counter()
        try:
            phi = self.outer.outer_step(theta, outcome.partner_thetas, peers=outcome.peers,
                                        round=outcome.round)
            if phi is None:  # the outer step keeps the model as it is (a testnet attacker)
                return
            from node.ml.optim.overlap import apply_late  # torch: imported once training runs

            self.write(apply_late(self.read(), theta, phi))
            if aggregating(self.outer) and outcome.partner_thetas:
                self.stats.aggregation = {"round": outcome.round,
                                          "weights": self.outer.last_weights,
                                          "rejected": self.outer.last_rejected}
        finally:
            self.stats.outer_s += time.perf_counter() - started
