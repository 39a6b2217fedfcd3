"""What every aggregator shares: the model type, what arrives in a round, input checks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

State = dict[str, torch.Tensor]  # a model's named tensors, like a state_dict


@dataclass(frozen=True)
class Incoming:
    """One model received this round, and who sent it."""

    peer: str
    state: State


@dataclass
class AggregateResult:
    """The new model; the normalised weight each accepted model got ("self" for ours);
    and why any received model was refused."""

    state: State
    weights: dict[str, float]
    rejected: dict[str, str] = field(default_factory=dict)


def validate_incoming(
    own: State, incoming: Sequence[Incoming], *, self_id: str | None = None
) -> tuple[list[Incoming], dict[str, str]]:
    """Split `incoming` into models that match ours tensor for tensor (names, shapes,
    dtypes) with finite values, and the refused ones with the reason. A poisoned or
    malformed model never reaches the arithmetic. With `self_id`, a model sent in our own
    name (or as "self", the key our own weight is reported under) is refused too."""
    accepted: list[Incoming] = []
    rejected: dict[str, str] = {}
    for item in incoming:
        if item.peer in ("self", self_id):
            rejected[item.peer] = "a model in our own name"
            continue
        reason = _problem(own, item.state)
        if reason is None and any(i.peer == item.peer for i in accepted):
            reason = "a second model from the same peer this round"
        if reason is None:
            accepted.append(item)
        else:
            rejected[item.peer] = reason
    return accepted, rejected


def _problem(own: State, state: object) -> str | None:
    if not isinstance(state, dict):
        return f"not a named-tensor map ({type(state).__name__})"
    if state.keys() != own.keys():
        missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        return f"tensor names differ (missing {missing[:3]}, extra {extra[:3]})"
    for name, mine in own.items():
        theirs = state[name]
        if not isinstance(theirs, torch.Tensor):
            return f"{name}: not a tensor"
        if theirs.shape != mine.shape:
            return f"{name}: shape {tuple(theirs.shape)}, ours is {tuple(mine.shape)}"
        if theirs.dtype != mine.dtype:
            return f"{name}: dtype {theirs.dtype}, ours is {mine.dtype}"
        if theirs.is_floating_point() and not bool(torch.isfinite(theirs).all()):
            return f"{name}: NaN or Inf values"
    return None


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to do arithmetic in: at least fp32 (bf16/fp16 sums lose too much), but
    fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def copy_state(state: State) -> State:
    return {k: v.detach().clone() for k, v in state.items()}


def weighted_average(states: Sequence[State], weights: Sequence[float]) -> State:
    """Σ w_i·state_i / Σ w_i per float tensor; non-float tensors (counters) are taken from
    the first state, which callers make their own model. Σ w_i must be positive."""
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights must sum to a positive number, not {total}")
    out: State = {}
    for name, first in states[0].items():
        if not first.is_floating_point():
            out[name] = first.detach().clone()
            continue
        acc = torch.zeros_like(first, dtype=work_dtype(first.dtype))
        for s, w in zip(states, weights, strict=True):
            if w:
                acc.add_(s[name].to(acc.dtype), alpha=w / total)
        out[name] = acc.to(first.dtype)
    return out


def flat(state: State) -> torch.Tensor:
    """All float tensors of a state as one fp32 vector, in sorted name order: two models
    with the same names flatten alike whatever their dict order, here and on other peers
    (gossiped SybilWall histories are compared element by element)."""
    parts = [
        state[k].detach().reshape(-1).float() for k in sorted(state) if state[k].is_floating_point()
    ]
    return torch.cat(parts) if parts else torch.zeros(0)
