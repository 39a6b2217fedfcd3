"""NoLoCo outer step (Gensyn, arXiv 2506.10911), as in the authors' code.

State per peer (spec section 1b): the anchor φ (the weights at the start of the current
inner phase; it differs between peers) and the outer momentum m, both fp32 flat vectors
(the reference keeps bf16 clones; spec 1g says fp32). m starts at 0.

Every H inner steps, with G = this peer plus the other members of its group
(`pairing.noloco_groups`):

    θ̄ = mean over G of the members' current weights θ_j
    m ← μ·m + η·(θ̄ − φ)
    φ ← φ + m
    θ ← φ                (the caller copies φ back into the model)

This is the reference's m ← μ·m + β·Δ̄ + γ·(φ̄ − φ) with Δ_j = θ_j − φ_j, Δ̄ and φ̄ group
means, and β = γ = η (the code uses one `outer_lr` for both): β·(θ̄ − φ̄) + γ·(φ̄ − φ)
collapses to η·(θ̄ − φ), so only θ is exchanged and φ̄ is never needed (spec 1c, "single
tensor"). Signs: θ̄ − φ is the *descent* direction (the opposite of DiLoCo's pseudo-gradient
φ − θ), hence the plus in φ ← φ + m. The update is heavy-ball, not Nesterov, as in the code.

With an empty group (no partner, or the partner timed out) G = {self} and the step is the
local one m ← μ·m + η·(θ − φ) (spec 1c, "peer missing"). With G = every replica the update
equals DiLoCo with heavy-ball momentum (m_NoLoCo = −η·m_DiLoCo); tests/ml/test_optim.py checks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from ._vectors import as_flat_fp32, mean_of

STATE_FORMAT = "peertrain.noloco"
STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class NoLoCoConfig:
    outer_lr: float = 0.7  # η (= β = γ); spec 1d
    momentum: float = 0.5  # μ; the reference configs' value (its builder default is 0.9)

    def __post_init__(self) -> None:
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


def noloco_update(
    phi: torch.Tensor,
    m: torch.Tensor,
    theta_mean: torch.Tensor,
    *,
    outer_lr: float,
    momentum: float,
) -> None:
    """In place: m ← μ·m + η·(θ̄ − φ); φ ← φ + m. `theta_mean` is consumed (overwritten)."""
    direction = theta_mean.sub_(phi)
    m.mul_(momentum).add_(direction, alpha=outer_lr)
    phi.add_(m)


class NoLoCo:
    """One peer's NoLoCo outer optimizer over a flat fp32 parameter vector."""

    def __init__(self, params: torch.Tensor, config: NoLoCoConfig | None = None):
        """`params`: the initial weights (`Trainer.parameters_vector()`); they become φ."""
        self.config = NoLoCoConfig() if config is None else config
        self.phi = as_flat_fp32(params, what="initial parameters").clone()
        self.m = torch.zeros_like(self.phi)
        self.rounds = 0

    def outer_step(
        self,
        theta_local: torch.Tensor,
        group_thetas: Sequence[torch.Tensor] = (),
        *,
        peers: Sequence[str] = (),
        round: int = 0,
    ) -> torch.Tensor:
        """Average with the group, take the momentum step, and return the new φ.

        `theta_local`: this peer's weights after its H inner steps. `group_thetas`: the
        current weights of the *other* members of its group (empty: a local step); who they
        are (`peers`) and the `round` do not change NoLoCo's update. The
        return value is the optimizer's own φ: copy it into the model (θ ← φ) and do not
        modify it.
        """
        mine = as_flat_fp32(theta_local, like=self.phi, what="theta_local")
        others = [
            as_flat_fp32(t, like=self.phi, what=f"group_thetas[{i}]")
            for i, t in enumerate(group_thetas)
        ]
        noloco_update(
            self.phi,
            self.m,
            mean_of(mine, others),
            outer_lr=self.config.outer_lr,
            momentum=self.config.momentum,
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
