"""Shared checks for the outer optimizers' flat fp32 vectors."""

from __future__ import annotations

import torch

from protocols.codecs import all_finite


def as_flat_fp32(
    tensor: torch.Tensor, *, like: torch.Tensor | None = None, what: str
) -> torch.Tensor:
    """`tensor` as a 1-D fp32 tensor (on `like`'s device), checked for size and finiteness.

    A copy only when dtype or device differ. Non-finite values are refused: one NaN from a
    partner would otherwise spread through every later average.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise ValueError(f"{what} must be a flat vector, got shape {tuple(tensor.shape)}")
    if like is not None:
        if tensor.numel() != like.numel():
            raise ValueError(f"{what} has {tensor.numel()} values, expected {like.numel()}")
        tensor = tensor.to(device=like.device, dtype=torch.float32)
    else:
        tensor = tensor.to(dtype=torch.float32)
    if not all_finite(tensor):
        raise ValueError(f"{what} contains NaN or infinite values")
    return tensor


def mean_of(first: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    """A new tensor holding the mean of `first` and `others` (a running sum, not a stack,
    so the extra memory is one vector however large the group)."""
    total = first.clone()
    for other in others:
        total.add_(other)
    return total.div_(1 + len(others))
