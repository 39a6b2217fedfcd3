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
To stay inside the step time on a CPU, one of CHUNKS slices of the vector advances per
step, by CHUNKS steps' worth (drift·CHUNKS, noise·√CHUNKS), from buffers of 2^20 values
read at random offsets: every value moves at least every CHUNKS steps, the same totals.

Selected by the environment (testnets only): PEERTRAIN_TIMED_TRAINER="<ms per step>".
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
CHUNKS = 16
_BUFFER = 1 << 20


@dataclass
class TimedStep:
    step: int
    loss: float | None
    lr: float
    seconds: float
    grad_norm: float | None = None
    val_loss: float | None = None


def step_ms_from_env() -> float | None:
    """The stand-in's step time in ms if the environment asks for one; a clear error if the
    value is not a positive number."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected milliseconds per step") from None
    if not (0 < ms < 60_000):
        raise ValueError(f"{ENV}={raw!r}: expected 0 < ms < 60000")
    return ms


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
        self._direction = torch.randn(size, generator=g).mul_(drift * CHUNKS)
        self._noise = torch.randn(2 * size, generator=g).mul_(noise * math.sqrt(CHUNKS))
        self._rng = torch.Generator().manual_seed(replica)

    def step(self) -> TimedStep:
        started = time.perf_counter()
        self._move(self.step_count % CHUNKS)
        self.step_count += 1
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        return TimedStep(self.step_count, None, self.lr, time.perf_counter() - started)

    def _move(self, chunk: int) -> None:
        per = -(-self.n_params // CHUNKS)
        lo, hi = chunk * per, min(self.n_params, (chunk + 1) * per)
        size = self._direction.numel()
        for start in range(lo, hi, size):
            n = min(size, hi - start)
            off = int(torch.randint(0, size, (1,), generator=self._rng))
            view = self.theta[start:start + n]
            view.add_(self._direction[:n]).add_(self._noise[off:off + n])

    def parameters_vector(self) -> torch.Tensor:
        return self.theta.clone()

    def set_parameters_vector(self, vector: torch.Tensor) -> None:
        if vector.dim() != 1 or vector.numel() != self.n_params:
            raise ValueError(f"expected a vector of {self.n_params} values, got shape "
                             f"{tuple(vector.shape)}")
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


def build_timed(m: Any, peer_id: str, step_ms: float) -> tuple[Any, Any, int]:
    """(timed trainer, outer optimizer, H) for the manifest, as build_training returns."""
    from node.training.build import replica_index

    trainer = TimedTrainer(model_params(m), step_ms / 1000.0, seed=m.run.seed,
                           replica=replica_index(peer_id), lr=m.train.lr)
    if m.outer.algorithm == "diloco":
        from node.ml.optim.diloco import DiLoCoConfig, SwarmDiLoCo

        outer: Any = SwarmDiLoCo(trainer.parameters_vector(), DiLoCoConfig(
            outer_lr=m.outer.outer_lr, momentum=m.outer.momentum, nesterov=m.outer.nesterov))
    elif m.outer.algorithm == "noloco":
        from node.ml.optim.noloco import NoLoCo, NoLoCoConfig

        outer = NoLoCo(trainer.parameters_vector(),
                       NoLoCoConfig(outer_lr=m.outer.outer_lr, momentum=m.outer.momentum))
    else:
        raise ValueError(f"the timed trainer runs noloco or diloco, not {m.outer.algorithm}")
    return trainer, outer, m.outer.inner_steps
