"""DiLoCo outer step (arXiv 2311.08105; OpenDiLoCo), the baseline NoLoCo is compared with.

State (spec section 0b): the outer weights φ, identical on every worker, and the outer
momentum m, both fp32 flat vectors; m starts at 0. Every H inner steps:

    Δ_i = φ − θ_i                      pseudo-gradient: points *uphill*, like a gradient
    Δ   = mean over the group of Δ_i   (the all-reduce; the caller supplies the list)
    m  ← μ·m + Δ
    φ  ← φ − η·(Δ + μ·m)               Nesterov (default): torch SGD(nesterov=True) on φ
    φ  ← φ − η·m                       heavy-ball (nesterov=False)
    θ_i ← φ

The baseline is the Nesterov variant with η 0.7, μ 0.9 (OpenDiLoCo `train_fsdp.py`, spec
0d). The gensyn NoLoCo repository's own "DiLoCo" baseline is the heavy-ball variant with
μ 0.3 and H 100 (spec 1d); set `nesterov=False, momentum=0.3` to reproduce that one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from ._vectors import as_flat_fp32, mean_of

STATE_FORMAT = "peertrain.diloco"
STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class DiLoCoConfig:
    outer_lr: float = 0.7  # η
    momentum: float = 0.9  # μ
    nesterov: bool = True  # False: heavy-ball

    def __post_init__(self) -> None:
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


def diloco_update(
    phi: torch.Tensor,
    m: torch.Tensor,
    delta: torch.Tensor,
    *,
    outer_lr: float,
    momentum: float,
    nesterov: bool,
) -> None:
    """In place: m ← μ·m + Δ; then φ ← φ − η·(Δ + μ·m) (Nesterov) or φ ← φ − η·m.

    The operations are ordered as torch.optim.SGD orders them, so the results agree bit
    for bit with SGD(lr=η, momentum=μ, nesterov=...) applied to φ with gradient Δ.
    """
    m.mul_(momentum).add_(delta)
    step = delta.add(m, alpha=momentum) if nesterov else m
    phi.add_(step, alpha=-outer_lr)


class DiLoCo:
    """One worker's DiLoCo outer optimizer over a flat fp32 parameter vector."""

    def __init__(self, params: torch.Tensor, config: DiLoCoConfig | None = None):
        """`params`: the initial weights (`Trainer.parameters_vector()`); they become φ."""
        self.config = DiLoCoConfig() if config is None else config
        self.phi = as_flat_fp32(params, what="initial parameters").clone()
        self.m = torch.zeros_like(self.phi)
        self.rounds = 0

    def pseudo_gradient(self, theta_local: torch.Tensor) -> torch.Tensor:
        """Δ_i = φ − θ_i, a new fp32 vector: what this worker contributes to the all-reduce."""
        return self.phi - as_flat_fp32(theta_local, like=self.phi, what="theta_local")

    def outer_step(self, pseudo_grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Average the group's pseudo-gradients (this worker's included), step, return φ.

        The return value is the optimizer's own φ: copy it into the model (θ ← φ) and do not
        modify it.
        """
        if not pseudo_grads:
            raise ValueError("pseudo_grads is empty: pass at least this worker's own")
        deltas = [
            as_flat_fp32(d, like=self.phi, what=f"pseudo_grads[{i}]")
            for i, d in enumerate(pseudo_grads)
        ]
        diloco_update(
            self.phi,
            self.m,
            mean_of(deltas[0], deltas[1:]),
            outer_lr=self.config.outer_lr,
            momentum=self.config.momentum,
            nesterov=self.config.nesterov,
        )
        self.rounds += 1
        return self.phi

    def state_dict(self) -> dict[str, object]:
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "config": asdict(self.config),
            "rounds": self.rounds,
            "phi": self.phi.clone(),
            "m": self.m.clone(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a {STATE_FORMAT} v{STATE_VERSION} state")
        phi = as_flat_fp32(state["phi"], like=self.phi, what="state phi")  # type: ignore[arg-type]
        m = as_flat_fp32(state["m"], like=self.phi, what="state m")  # type: ignore[arg-type]
        self.phi.copy_(phi)
        self.m.copy_(m)
        self.rounds = int(state["rounds"])  # type: ignore[call-overload]


class SwarmDiLoCo(DiLoCo):
    """DiLoCo in a live swarm, as the training service drives an outer optimizer: at each
    boundary the trainer waits (`synchronous`) for the all-reduce of the workers' weights
    (node/ml/optim/allreduce.py, run by the averager), and since φ is the same on every
    worker, the mean pseudo-gradient is φ − mean(θ_i). No mean (the all-reduce failed) is
    a local step on this worker's own Δ_i: its φ then leaves the others'."""

    synchronous = True  # the trainer blocks on the all-reduce: DiLoCo's cost on a WAN

    def outer_step(self, theta_local: torch.Tensor,  # type: ignore[override]
                   group_thetas: Sequence[torch.Tensor] = (), *, peers: Sequence[str] = (),
                   round: int = 0) -> torch.Tensor:
        """`group_thetas`: [the mean of every worker's θ] from the all-reduce, or empty."""
        theta = group_thetas[0] if group_thetas else theta_local
        return super().outer_step([self.pseudo_gradient(theta)])
