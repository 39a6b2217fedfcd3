"""What crosses between the trainer thread and the trio side, and the progress counters
the training service keeps (read by heartbeats, the run document and `node status`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Boundary:
    round: int
    snapshot: Any  # flat fp32 torch vector, owned by the receiver from now on


@dataclass(frozen=True)
class Outcome:
    round: int
    partner_thetas: list[Any]  # flat fp32 vectors; empty = local outer step
    partner: str | None = None
    peers: tuple[str, ...] = ()  # who sent each of partner_thetas
    # the partners' trained steps (their heartbeats' `trained`), where known: what the
    # averaged weights carry (TrainingService._credit_averaging)
    partner_trained: tuple[int, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint's worth of state, copied in the trainer thread at a step boundary.

    `step` is the round clock (where the run's schedule is); `trained` is what the weights
    embody, the checkpoint's claim (docs/checkpoints.md, "What a checkpoint claims")."""

    step: int
    tensors: dict[str, Any]
    trained: int | None = None  # None: the clock (a trainer that never jumped)
    parent: str | None = None  # the checkpoint the weights were resumed from


@dataclass
class TrainingStats:
    phase: str = "loading"
    step: int = 0  # the round clock: follows the swarm's round (pairing, lr schedule)
    # Inner steps the weights embody: the node's own steps plus what it resumed from or
    # received by averaging; never above `step`. What its checkpoints claim.
    trained: int = 0
    lineage: str | None = None  # the checkpoint the weights were resumed from (None: init)
    round: int = 0
    loss: float | None = None
    val_loss: float | None = None
    first_val_loss: float | None = None
    lr: float = 0.0
    compute_s: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    last_partner: str | None = None
    checkpoints: int = 0
    last_checkpoint: str | None = None
    rounds_averaged: int = 0
    rounds_local: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    params: int = 0
    error: str | None = None
    val_metrics: dict[str, float] | None = None  # the last evaluation (accuracy, attack rates)
    aggregation: dict[str, Any] | None = None  # gossip learning: last weights and refusals
    grad_norm: float | None = None  # pipeline stages: the last step's, after clipping
    sync_wait_s: float = 0.0  # DiLoCo: seconds the trainer waited for all-reduces

    def step_time(self) -> float:
        """Measured seconds per inner step (a prior of 0.2 s before the first step)."""
        return self.compute_s / self.step if self.step else 0.2

    def snapshot(self) -> dict[str, Any]:
        wall = max(1e-9, time.monotonic() - self.started_at)
        doc = {k: v for k, v in vars(self).items() if k != "started_at"}
        doc["wall_s"] = round(wall, 1)
        doc["compute_fraction"] = round(min(1.0, self.compute_s / wall), 3)
        return doc
