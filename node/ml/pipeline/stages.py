"""Cutting the byte-level GPT (node/ml/trainer/models.py) into pipeline stages.

A stage is a contiguous slice of the model: the first stage also holds the embedding
(token + position tables), the last the final LayerNorm and the output head, and every
stage holds `layers[i]` transformer blocks (0 at an end makes a stage of only the
embedding, or only the head: the layout of the CheckFree simulation, where the
(de)embeddings sit in a stage of their own; specs/algorithms.md §4b).

Tied embeddings. The GPT's head is the token embedding matrix (`lm_head.weight is
wte.weight`). A pipeline must not keep two independently trained copies (they would
drift apart, and averaging them is one of the reference code's pitfalls: "never average a
tied embedding", §4g). Here the **first stage owns it**: it is the first stage's
parameter, in its optimizer, its clipping and its state_dict. The last stage *borrows*
it: `Stage.tied` is an attribute, not a registered parameter, so it is in none of the last
stage's parameters, optimizer or state_dict. In one process (tests, benchmarks) the
borrowed tensor *is* the first stage's parameter, so the head's gradient lands on it.
Across peers the last stage holds a copy (`set_tied`), returns the head's gradient with
the activations' gradient (`tied_grad`), which the owner adds to its own (`add_tied_grad`)
before its step, and receives the updated matrix for the next step: V x d values (256 x
d_model for bytes) each way per step. That is exactly what the tied model computes, with
one optimizer for the one matrix.

Pure torch, no networking: the live service (issue 11) moves the tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from node.ml.trainer.models import GPT, Block, GPTConfig


class Stage(nn.Module):
    """One pipeline stage: [embedding] + blocks + [final norm + head].

    `forward(x)`: the first stage takes token ids (B, T) int64, the others activations
    (B, T, d_model); the last returns logits (B, T, vocab), the others activations.
    `embed`, `run_blocks` and `head` are the three parts, called separately where the
    execution order is not the stage order (CheckFree+'s swap, node/ml/pipeline/schedule.py).
    """

    def __init__(self, config: GPTConfig, index: int, n_stages: int, n_blocks: int) -> None:
        super().__init__()
        self.config = config
        self.index = index
        self.n_stages = n_stages
        self.is_first = index == 0
        self.is_last = index == n_stages - 1
        if self.is_first:
            self.wte = nn.Embedding(config.vocab_size, config.d_model)
            self.wpe = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(n_blocks))
        self.tied: torch.Tensor | None = None  # the last stage's borrowed head matrix
        if self.is_last:
            self.ln_f = nn.LayerNorm(config.d_model)
            if self.is_first:
                self.borrow(self.wte.weight)
            else:  # a placeholder until the owner's matrix is set (split_gpt, set_tied)
                self.borrow(torch.zeros(config.vocab_size, config.d_model, requires_grad=True))

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        if not self.is_first:
            raise RuntimeError(f"stage {self.index} holds no embedding")
        T = idx.shape[1]
        if self.config.context < T:
            raise ValueError(f"sequence of {T} exceeds the model's context {self.config.context}")
        return self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_last or self.tied is None:
            raise RuntimeError(f"stage {self.index} holds no head")
        return self.ln_f(x) @ self.tied.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x)
        x = self.run_blocks(x)
        return self.head(x) if self.is_last else x

    # -- the borrowed head matrix, across peers ------------------------------------------

    def borrow(self, weight: torch.Tensor) -> None:
        """Use `weight` as the head matrix without registering it: nn.Module would make an
        assigned Parameter one of ours (in our optimizer and state_dict), which it is not."""
        object.__setattr__(self, "tied", weight)

    def set_tied(self, weight: torch.Tensor) -> None:
        """Last stage, on another peer than the first: take the owner's current matrix."""
        if not self.is_last or self.is_first:
            raise RuntimeError(f"stage {self.index} borrows no head matrix")
        expected = (self.config.vocab_size, self.config.d_model)
        if tuple(weight.shape) != expected:
            raise ValueError(f"head matrix must be {expected}, got {tuple(weight.shape)}")
        self.borrow(weight.detach().clone().float().requires_grad_(True))

    def tied_grad(self) -> torch.Tensor | None:
        """Last stage: the head's gradient on the borrowed matrix, to send to the owner."""
        return None if self.tied is None or self.tied.grad is None else self.tied.grad

    def add_tied_grad(self, grad: torch.Tensor) -> None:
        """First stage: add the last stage's head gradient to the embedding's own."""
        if not self.is_first:
            raise RuntimeError(f"stage {self.index} does not own the embedding")
        w = self.wte.weight
        w.grad = grad.detach().clone() if w.grad is None else w.grad + grad

    # -- what recovery works on ------------------------------------------------------------

    def blocks_state(self) -> dict[str, torch.Tensor]:
        """The transformer blocks' weights, keys relative to the stage ("0.attn.qkv.weight"):
        the part CheckFree averages and CheckFree+ copies between stages."""
        return {k: v.detach().clone() for k, v in self.blocks.state_dict().items()}

    def load_blocks_state(self, state: dict[str, torch.Tensor]) -> None:
        self.blocks.load_state_dict(state, strict=True)

    def ends_state(self) -> dict[str, torch.Tensor]:
        """The embedding (first stage) and final norm (last): what neighbours keep copies
        of for CheckFree+. The borrowed head matrix is not here: it is the embedding's."""
        return {k: v.detach().clone() for k, v in self.state_dict().items()
                if not k.startswith("blocks.")}

    def load_ends_state(self, state: dict[str, torch.Tensor]) -> None:
        own = {k: v for k, v in self.state_dict().items() if not k.startswith("blocks.")}
        if set(own) != set(state):
            raise ValueError(f"stage {self.index}: ends state has keys {sorted(state)}, "
                             f"expected {sorted(own)}")
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v)


def split_gpt(model: GPT, layers: Sequence[int]) -> list[Stage]:
    """The stages of `model`, with its weights (copied): `layers[i]` blocks in stage i.

    The stages compute exactly what `model` computes (tests/ml/test_pipeline.py checks it to
    float tolerance). In the returned list the last stage borrows the first's embedding
    matrix as its head (see the module docstring).
    """
    config = model.config
    if sum(layers) != config.n_layers or not layers or min(layers) < 0:
        raise ValueError(f"layers {list(layers)} must be >= 0 and add up to {config.n_layers}")
    stages = [Stage(config, i, len(layers), n) for i, n in enumerate(layers)]
    at = 0
    for stage, n in zip(stages, layers, strict=True):
        for j in range(n):
            stage.blocks[j].load_state_dict(model.blocks[at + j].state_dict())
        at += n
    with torch.no_grad():
        stages[0].wte.weight.copy_(model.wte.weight)
        stages[0].wpe.weight.copy_(model.wpe.weight)
        stages[-1].ln_f.load_state_dict(model.ln_f.state_dict())
    stages[-1].borrow(stages[0].wte.weight)
    return stages


def build_stages(config: GPTConfig, layers: Sequence[int], seed: int) -> list[Stage]:
    """Fresh stages drawn as `GPT(config)` draws them from `seed` (so every peer that cuts
    the same manifest gets the same initial stage weights, whichever stage it hosts)."""
    torch.manual_seed(seed)
    return split_gpt(GPT(config), layers)


def init_blocks_state(config: GPTConfig, n_blocks: int, generator: torch.Generator
                      ) -> dict[str, torch.Tensor]:
    """A stage's blocks freshly initialised as GPT initialises them (the re-init baseline)."""
    std = 0.02
    residual_std = 0.02 / (2 * config.n_layers) ** 0.5
    blocks = nn.ModuleList(Block(config) for _ in range(n_blocks))
    out = {}
    for k, v in blocks.state_dict().items():
        if k.endswith("proj.weight"):
            out[k] = torch.randn(v.shape, generator=generator) * residual_std
        elif k.endswith(".weight") and v.dim() == 2:
            out[k] = torch.randn(v.shape, generator=generator) * std
        else:  # LayerNorm: weight 1, bias 0
            out[k] = copy.deepcopy(v)
    return out


def own_parameters(stage: Stage) -> list[nn.Parameter]:
    """The parameters this stage's optimizer updates (never the borrowed head matrix)."""
    return list(stage.parameters())


def copy_vector_into(params: list[nn.Parameter], vector: torch.Tensor) -> None:
    """Copy a flat vector (parameters_to_vector's layout) into `params`, onto their device
    and dtype. Not torch's vector_to_parameters: that makes each parameter a *view* of
    `vector`, so an outer optimizer's φ handed in would move with every inner step."""
    if vector.numel() != sum(p.numel() for p in params):
        raise ValueError(f"a vector of {vector.numel()} values for "
                         f"{sum(p.numel() for p in params)} parameters")
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

