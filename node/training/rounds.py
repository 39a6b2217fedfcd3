"""What crosses between the trainer thread and the trio side, and the progress counters
the training service keeps (read by heartbeats, the run document and `node status`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Boundary:
    round: int
    # θ_r, a flat fp32 vector owned by the receiver from now on; a topk run: its frame
    snapshot: torch.Tensor | Compressed


@dataclass(frozen=True)
class Compressed:
    """What a topk run's boundary hands the averager instead of θ_r: encoded "topk" frames
    (protocols/sparse.py) of a model of `size` values: this peer's own frame, or in
    DiLoCo's all-gather the frames gathered so far."""

    frames: tuple[bytes, ...]
    size: int

    def numel(self) -> int:
        """The model's values, as a dense snapshot's `numel()` says (the averager's offer)."""
        return self.size


@dataclass(frozen=True)
class Outcome:
    round: int
    # flat fp32 vectors (a topk run: decoded sparse.Frame objects); empty = local outer step
    partner_thetas: list[Any]
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
    tensors: dict[str, torch.Tensor]
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
    steps_run: int = 0  # inner steps this process computed (compute_s is their time)
    # Base rounds per exchange (node/training/service.py, "Spans"): what this node's own
    # measurements call for (`span_wanted`, sent in heartbeats) and what it uses (`span`,
    # swarm_span below).
    span: int = 1
    span_wanted: int = 1
    # Seconds the trainer thread spent on outer steps and boundary snapshots (whole-model
    # vector work: on a GPU node it runs on the device; a CPU stand-in pays it on the CPU).
    outer_s: float = 0.0

    def step_time(self) -> float:
        """Measured seconds per inner step (a prior of 0.2 s before the first step).

        Over the steps this process ran (`steps_run`), not the step counter: a node resumed
        at step 40 and jumped to the swarm's step 99 had run none, and 0 s per step made a
        round of 0 s (its span computation raised and took the node down)."""
        return self.compute_s / self.steps_run if self.steps_run else 0.2

    def snapshot(self) -> dict[str, Any]:
        wall = max(1e-9, time.monotonic() - self.started_at)
        doc = {k: v for k, v in vars(self).items() if k != "started_at"}
        doc["wall_s"] = round(wall, 1)
        doc["compute_fraction"] = round(min(1.0, self.compute_s / wall), 3)
        return doc


MAX_SPAN = 64  # base rounds one exchange may span (H = 50: 3,200 steps between outer steps)
SPAN_SHARE = 0.75  # an exchange should take at most this share of its span (skew, jitter)
SPAN_SHRINK = 0.8  # ... and this much less again before the span shrinks (hysteresis)


def span_for(exchange_s: float, round_s: float, current: int = 1,
             share: float = SPAN_SHARE, most: int = MAX_SPAN) -> int:
    """How many base rounds (H inner steps each) one exchange should span: the smallest
    power of two k with `exchange_s` <= `share` * k * `round_s`, at most `most`.

    A power of two so that peers whose estimates differ still meet: exchange boundaries are
    the rounds r with r % k == 0, and those of 2k are among them. It shrinks from `current`
    only when the smaller span holds the exchange with SPAN_SHRINK to spare (hysteresis: an
    estimate hovering at a border must not flip the swarm's span every heartbeat; at half,
    one slow exchange kept a swarm at twice the span it needed: `node bench wan --gpu`)."""
    if not (exchange_s >= 0 and round_s > 0):
        raise ValueError(f"need exchange_s >= 0 and round_s > 0, got {exchange_s}, {round_s}")
    k = 1
    while k < most and exchange_s > share * k * round_s:
        k *= 2
    if k < current and exchange_s > SPAN_SHRINK * share * k * round_s:
        k = min(current, 2 * k)  # not yet clearly below: shrink by one step at most
    return k


def swarm_span(own: int, reported: list[object], most: int = MAX_SPAN) -> int:
    """The span this node uses: its own, or the (upper) median of what the live peers want
    (their heartbeats' `span`) where that is larger; a value that is not a power of two in
    [1, most] is ignored.

    The median, not the largest: one hostile or broken peer writing `span = 64` in its
    heartbeats would otherwise put every node at 64 rounds between outer steps. A node whose
    own link needs more keeps its own: powers of two keep its boundaries among everyone
    else's, so it still meets partners there."""
    valid = sorted(s for s in reported
                   if type(s) is int and 1 <= s <= most and s & (s - 1) == 0)
    return max(own, valid[len(valid) // 2]) if valid else own
