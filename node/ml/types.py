"""What the training service asks of a local trainer and an outer optimizer.

The trainer thread (node/training/service.py) drives several implementations: the real
Trainer (node/ml/trainer/loop.py), the timed stand-in for benchmarks (node/training/timed.py),
NoLoCo, DiLoCo, their compressed forms and gossip learning (node/ml/optim/). These Protocols
name the part each side relies on, so that a reader (and mypy) can follow a weight vector
from a trainer's step to an outer step and back without `Any`. Optional abilities stay
attributes read with getattr where they are used (`synchronous`, `spans`, `compressed`,
`last_weights`), each documented beside its reader.

torch is imported for type checking only: importing this module stays free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

if TYPE_CHECKING:
    import torch


class InnerStep(Protocol):
    """One inner step's report (StepStats, TimedStep)."""

    @property
    def step(self) -> int: ...  # steps completed, this one included
    @property
    def loss(self) -> float | None: ...
    @property
    def lr(self) -> float: ...
    @property
    def val_loss(self) -> float | None: ...  # set when the step ran an evaluation


class LocalTrainer(Protocol):
    """Inner steps on a flat view of the model's weights."""

    step_count: int  # the round clock; the service moves it when the node jumps ahead
    last_eval: dict[str, float] | None  # the last evaluation's metrics

    def step(self) -> InnerStep: ...
    def parameters_vector(self) -> torch.Tensor: ...  # a flat fp32 copy of the weights
    def set_parameters_vector(self, vector: torch.Tensor) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class OuterOptimizer(Protocol):
    """The outer step at a round boundary: the new anchor φ from our snapshot θ_r and what
    the partners sent for the same round (flat vectors, or decoded sparse frames in a
    topk run), or None to keep the model as it is (a testnet attacker)."""

    def outer_step(self, theta: torch.Tensor, partners: Sequence[Any] = (), /, *,
                   peers: Sequence[str] = (), round: int = 0) -> torch.Tensor | None: ...


class CompressingOuter(OuterOptimizer, Protocol):
    """A topk run's outer optimizer (node/ml/optim/compress.py, SwarmTopK): a boundary
    sends the encoded frame `prepare` makes of θ_r for round r, not θ_r itself."""

    def prepare(self, theta: torch.Tensor, round: int, /) -> bytes: ...


def compressing(outer: object) -> TypeGuard[CompressingOuter]:
    return bool(getattr(outer, "compressed", False))


class Aggregating(OuterOptimizer, Protocol):
    """Gossip learning's outer step: the weights it gave each peer and why it refused any,
    shown by `node status`."""

    last_weights: dict[str, float]
    last_rejected: dict[str, str]


def aggregating(outer: object) -> TypeGuard[Aggregating]:
    return hasattr(outer, "last_weights") and hasattr(outer, "last_rejected")


# What a training build returns: the trainer, its outer optimizer (None: no communication,
# plain local training) and H, the inner steps per round.
Built = tuple[LocalTrainer, "OuterOptimizer | None", int]
