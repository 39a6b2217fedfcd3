"""The models: a small byte-level GPT, a digits MLP, and bring-your-own factories.

The GPT follows nanoGPT's `model.py` (karpathy/nanoGPT): pre-LayerNorm blocks, causal
self-attention through `F.scaled_dot_product_attention(is_causal=True)`, a 4x GELU MLP,
learned positions, the output head tied to the token embedding, every weight drawn from
N(0, 0.02) and the residual projections from N(0, 0.02 / sqrt(2 * n_layers)) (GPT-2 paper,
section 2.3). The vocabulary is the 256 byte values: no tokenizer to ship or agree on.

Models never import the trainer.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, FactoryError


@dataclass(frozen=True, slots=True)
class GPTConfig:
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    context: int = 128  # the longest sequence the position table covers
    vocab_size: int = 256  # bytes

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "context", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=False)
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Byte-level GPT: `forward(idx (B, T) int64) -> logits (B, T, vocab_size)`."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, counted once in parameters()
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if self.config.context < T:
            raise ValueError(f"sequence of {T} exceeds the model's context {self.config.context}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class DigitsMLP(nn.Module):
    """64-256-256-10 ReLU MLP for 8x8 digit images (85K parameters)."""

    def __init__(self, n_features: int = 64, hidden: int = 256, n_classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights once


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """Resolve "pkg.module:callable" to a zero-argument callable that builds an `nn.Module`.

    The callable is imported now (errors surface at start-up, not at the first step) and
    wrapped so that calling it checks the result is an `nn.Module`. Raises `FactoryError`.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise FactoryError("expected the form 'package.module:callable'", spec=spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(f"cannot import module {module_name!r}: {exc}", spec=spec) from exc
    target: object = module
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise FactoryError(
                f"{module_name!r} has no attribute {attr_path!r}", spec=spec
            ) from None
    if not callable(target):
        raise FactoryError(f"{attr_path!r} is a {type(target).__name__}, not callable", spec=spec)
    factory = target

    def build() -> nn.Module:
        try:
            model = factory()
        except Exception as exc:
            raise FactoryError(f"calling it raised {type(exc).__name__}: {exc}", spec=spec) from exc
        if not isinstance(model, nn.Module):
            raise FactoryError(
                f"returned a {type(model).__name__}, not a torch.nn.Module", spec=spec
            )
        return model

    return build
