"""NoLoCo between the replicas of one stage (docs/pipeline.md, "Replicas").

Every `outer.inner_steps` steps the stage's worker (the trainer thread) snapshots the
stage's own parameters, never the last stage's borrowed head matrix (the first stage owns
it and averages it with its own replicas: spec §4g), and posts the snapshot to the trio
side, which exchanges it with another replica of the stage over the averaging protocol
(node/averaging/service.py). The outcome is applied at a later step the way the
data-parallel trainer applies it (docs/training.md, "Delayed application"):
φ ← NoLoCo(θ_r, the partner's θ_r) and θ ← φ + (θ_now − θ_r), so the steps taken meanwhile
are kept. A round whose outcome has not come by the next boundary is closed with a local
outer step. A stage with no other replica at a boundary takes no outer step at all (φ
follows θ): one replica trains exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from node.ml.optim import NoLoCo, NoLoCoConfig
from node.ml.pipeline.stages import copy_vector_into, own_parameters
from node.training.outer_rounds import OuterRounds
from node.training.rounds import Outcome, TrainingStats


class ReplicaRounds:
    """The outer rounds of one stage replica (node/training/outer_rounds.py over the
    stage's own parameters). `after_step` runs in the trainer thread with the worker's lock
    held; `deliver` may be called from any thread."""

    def __init__(self, stage: Any, inner_steps: int, config: NoLoCoConfig,
                 post: Callable[[int, torch.Tensor], None],
                 has_partners: Callable[[], bool],
                 progress: TrainingStats | None = None) -> None:
        self.params = list(own_parameters(stage))
        self.h = inner_steps
        self.post = post  # (round, a snapshot the trio side owns) -> starts the exchange
        self.has_partners = has_partners
        self.outer = NoLoCo(self.vector(), config)
        # progress: the node's TrainingStats, whose round counters show in heartbeats
        self.progress = progress if progress is not None else TrainingStats()
        self.rounds = OuterRounds(self.outer, self.vector, self._set, self.progress)
        self.alone = 0
        self.last_step: int | None = None  # the step of the previous after_step

    def vector(self) -> torch.Tensor:
        return parameters_to_vector([p.detach() for p in self.params]).float().cpu()

    def _set(self, vec: torch.Tensor) -> None:
        copy_vector_into(self.params, vec)

    def deliver(self, outcome: Outcome) -> None:
        self.rounds.deliver(outcome)

    def apply(self) -> None:
        self.rounds.apply()

    def after_step(self, step: int) -> None:
        """Apply the outcomes that came; at a round boundary, close the rounds still open
        locally and start this round's exchange (or, alone, let φ follow θ). A driver that
        jumps to the swarm's step (drive.py: the leader's, or a later step its messages
        carry) may pass a boundary without landing on it: that round starts where it
        lands, rather than being skipped until the next boundary."""
        self.rounds.apply()
        prev, self.last_step = self.last_step, step
        crossed = (step % self.h == 0 if prev is None
                   else step // self.h > prev // self.h)
        if step <= 0 or not crossed:
            return
        if not self.has_partners():
            self.rounds.close_all()
            with torch.no_grad():
                self.outer.phi.copy_(self.vector())
            self.alone += 1
            return
        r = step // self.h
        self.post(r, self.rounds.open(r).clone())

    def statistics(self) -> dict[str, Any]:
        p = self.progress
        return {"rounds_averaged": p.rounds_averaged, "rounds_local": p.rounds_local,
                "rounds_alone": self.alone, "last_partner": p.last_partner,
                "inner_steps": self.h}
