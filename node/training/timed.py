"""A timed trainer: a device's measured step time and a real-size model that moves like
training, for benchmarks of the network on a machine without that device.

`node bench wan --gpu` (testnet/bench/wan.py) runs 4 nodes of an 86M-parameter model at an
H100's measured step time on a 2-core machine: the real trainer there would take seconds a
step. This stand-in sleeps the measured step time instead, and hands out a parameter vector
of the model's exact size that moves the way training moved it, so what the network sees
(bytes, their timing, a codec's sparsity and error feedback, the rounds averaged, the
share of wall time spent "computing") is real, while convergence is not measured here.

How it moves. Measured on the real trainer (bytes-gpt d_model 256, 4 layers, context 128,
batch 8, the manifest's lr 2e-3, steps 40-90 after warmup): the per-step update had an RMS
of 3.0e-4 per parameter and 50 steps moved the weights by 7.0e-3 RMS, 0.46 of what 50
aligned steps would. Read as a constant drift d plus independent noise σ per step
(a² = d² + σ², D² = (50d)² + 50σ²): d = 1.34e-4, σ = 2.74e-4 per parameter per step (AdamW's
update scales with the lr, not the model size, so it carries over to the 86M model at the
same lr). Each node drifts along a direction of its own (its replica's data) plus noise.
The motion is applied when the vector is read (`parameters_vector`), for all the k steps
since the last read at once: drift·k plus noise·√k (the sum of k independent steps), from
buffers of 2^20 values read at random offsets. A step itself only sleeps, on a schedule
(what one sleep overran, the next steps make up, as a GPU's queued kernels would): on a
2-core machine shared with other work, per-step CPU work in a niced thread took a second a
step (measured at load 17) instead of 35.8 ms, while the read's cost is counted with the
outer step's (`training.outer_s`), where a GPU node's device-side copy would be.

Selected by the environment (testnets only): PEERTRAIN_TIMED_TRAINER="<ms per step>" or
"<ms per step>,<parameters>" (a vector of that size instead of the manifest model's: a
benchmark scaled down with its link rate keeps the exchange's share of a round).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

ENV = "PEERTRAIN_TIMED_TRAINER"
DRIFT = 1.34e-4  # per parameter per step, measured (module docstring)
NOISE = 2.74e-4
_BUFFER = 1 << 20


@dataclass
class TimedStep:
    step: int
    loss: float | None
    lr: float
    seconds: float
    grad_norm: float | None = None
    val_loss: float | None = None


def from_env() -> tuple[float, int | None] | None:
    """(ms per step, parameters or None: the manifest model's) if the environment asks for
    the stand-in; a clear error if the value is malformed."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    ms_text, _, params_text = raw.partition(",")
    try:
        ms = float(ms_text)
        params = int(params_text) if params_text else None
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected '<ms per step>[,<parameters>]'") from None
    if not (0 < ms < 60_000) or (params is not None and not 0 < params <= 2**34):
        raise ValueError(f"{ENV}={raw!r}: expected 0 < ms < 60000 and 0 < parameters")
    return ms, params


class TimedTrainer:
    """What the training service needs of a Trainer: step(), step_count,
    parameters_vector(), set_parameters_vector(), n_params, config.threads, last_eval."""

    def __init__(self, numel: int, step_s: float, *, seed: int = 0, replica: int = 0,
                 lr: float = 2e-3, drift: float = DRIFT, noise: float = NOISE) -> None:
        if numel < 1 or step_s <= 0:
            raise ValueError(f"need numel >= 1 and step_s > 0, got {numel}, {step_s}")
        self.n_params = numel
        self.step_s = step_s
        self.lr = lr
        self.config = SimpleNamespace(threads=1)
        self.step_count = 0
        self.last_eval: dict[str, float] | None = None
        # the same initial weights on every node (the run's seed), as a real run's
        self.theta = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        self.theta.mul_(0.02)
        g = torch.Generator().manual_seed(seed * 1_000_003 + replica + 1)
        size = min(_BUFFER, numel)
        self.drift, self.noise = drift, noise
        self._direction = torch.randn(size, generator=g)
        self._noise = torch.randn(2 * size, generator=g)
        self._rng = torch.Generator().manual_seed(replica)
        self._unmoved = 0  # steps taken since the vector last moved
        self._overslept = 0.0  # seconds the steps' sleeps overran, made up by later steps

    def step(self) -> TimedStep:
        """Sleep one step's time, less what earlier sleeps overslept. A GPU's kernels run at
        their own pace, queued ahead; a niced thread on a loaded host wakes late (at load 27
        on 2 cores, sleeps of 35.8 ms took 147 ms). The debt is only what steps themselves
        overran: time the thread spends outside step() (outer steps) is not made up."""
        started = time.perf_counter()
        if self.step_s > self._overslept:
            time.sleep(self.step_s - self._overslept)
        self._overslept += time.perf_counter() - started - self.step_s
        self.step_count += 1
        self._unmoved += 1
        return TimedStep(self.step_count, None, self.lr, time.perf_counter() - started)

    def _catch_up(self) -> None:
        """Move the vector by the steps taken since it last moved: drift·k + noise·√k."""
        k, self._unmoved = self._unmoved, 0
        if not k:
            return
        a, b = self.drift * k, self.noise * math.sqrt(k)
        size = self._direction.numel()
        for start in range(0, self.n_params, size):
            n = min(size, self.n_params - start)
            off = int(torch.randint(0, size, (1,), generator=self._rng))
            view = self.theta[start:start + n]
            view.add_(self._direction[:n], alpha=a).add_(self._noise[off:off + n], alpha=b)

    def parameters_vector(self) -> torch.Tensor:
        self._catch_up()
        return self.theta.clone()

    def set_parameters_vector(self, vector: torch.Tensor) -> None:
        if vector.dim() != 1 or vector.numel() != self.n_params:
            raise ValueError(f"expected a vector of {self.n_params} values, got shape "
                             f"{tuple(vector.shape)}")
        self._catch_up()  # a real trainer's weights moved at every step, then were set
        self.theta.copy_(vector)


def model_params(m: Any) -> int:
    """The exact parameter count of the manifest's model (tied weights once), on torch's
    meta device: nothing allocated."""
    from node.ml.trainer.models import GPT, GPTConfig

    if m.model.task != "bytes-gpt":
        raise ValueError("the timed trainer stands in for the byte-level GPT only")
    with torch.device("meta"):
        model = GPT(GPTConfig(d_model=m.model.d_model, n_layers=m.model.n_layers,
                              n_heads=m.model.n_heads, context=m.model.context))
    return sum(p.numel() for p in model.parameters())


def build_timed(m: Any, peer_id: str, step_ms: float,
                params: int | None = None) -> tuple[Any, Any, int]:
    """(timed trainer, outer optimizer, H) for the manifest, as build_training returns;
    `params` overrides the manifest model's size (a scaled benchmark)."""
    from node.training.build import replica_index

    trainer = TimedTrainer(params or model_params(m), step_ms / 1000.0, seed=m.run.seed,
                           replica=replica_index(peer_id), lr=m.train.lr)
    if m.outer.codec == "topk" and m.outer.algorithm in ("noloco", "diloco"):
        from node.training.build import topk_outer

        outer: Any = topk_outer(m, trainer.parameters_vector())
    elif m.outer.algorithm == "diloco":
        from node.ml.optim.diloco import DiLoCoConfig, SwarmDiLoCo

        outer = SwarmDiLoCo(trainer.parameters_vector(), DiLoCoConfig(
            outer_lr=m.outer.outer_lr, momentum=m.outer.momentum, nesterov=m.outer.nesterov))
    elif m.outer.algorithm == "noloco":
        from node.ml.optim.noloco import NoLoCo, NoLoCoConfig

        outer = NoLoCo(trainer.parameters_vector(),
                       NoLoCoConfig(outer_lr=m.outer.outer_lr, momentum=m.outer.momentum))
    else:
        raise ValueError(f"the timed trainer runs noloco or diloco, not {m.outer.algorithm}")
    return trainer, outer, m.outer.inner_steps
