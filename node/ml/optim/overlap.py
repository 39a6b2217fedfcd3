"""Applying an outer step that arrives late: the overlapped (one-step-stale) round.

The exchange for the outer step taken at boundary r runs while the trainer keeps computing
inner steps; it comes back d inner steps later (d may span several base rounds of H steps:
node/training/service.py, "Spans"). The outer optimizer computes its new anchor φ from the
snapshot θ_r it sent and what the partners sent for the same boundary, exactly as if
nothing had moved since; the live weights θ_{r+d} then keep the progress made meanwhile:

    θ ← φ + (θ_{r+d} − θ_r)

so every inner step's progress counts exactly once: the d steps computed during the
exchange are not undone, and they enter the *next* outer step's pseudo-gradient (NoLoCo's
θ − φ, DiLoCo's φ − θ), taken from the new φ. This is the delayed application of
overlapped DiLoCo ("Streaming DiLoCo", arXiv 2501.18512, with mixing factor α = 0 for the
local side; Kale et al., "Eager updates for overlapped communication ... in DiLoCo",
arXiv 2502.12996, its "naive delayed" variant), and for NoLoCo the pull toward the
partner's θ_r is one exchange stale, as in the reference's own overlap (spec 1c).
docs/training.md writes out the sequence.
"""

from __future__ import annotations

import torch


def apply_late(live: torch.Tensor, snapshot: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """In place on `live` (and returned): θ_{r+d} ← φ + (θ_{r+d} − θ_r).

    In place because the vectors are the whole model (344 MB in fp32 for 86M parameters):
    `phi + (live - snapshot)` held two more of them at once."""
    if not (live.shape == snapshot.shape == phi.shape):
        raise ValueError(f"shapes differ: live {tuple(live.shape)}, snapshot "
                         f"{tuple(snapshot.shape)}, phi {tuple(phi.shape)}")
    return live.sub_(snapshot).add_(phi)
