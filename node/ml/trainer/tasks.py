"""Tasks: what to train. A task builds the model, samples batches and scores outputs.

Two are built in:

- "bytes-gpt": next-byte prediction with `models.GPT` on the stdlib corpus (`data.py`) or
  on the user's own text/JSONL files. Metric: validation loss in nats per byte.
- "digits-mlp": 10-class classification of 64-feature "digits" with `models.DigitsMLP`, for
  fast tests of averaging. It uses sklearn's 8x8 digits when sklearn happens to be
  importable, else a deterministic synthetic stand-in (same shapes, fixed seed; sklearn is
  never a dependency). Metrics: validation loss and accuracy.

A task holds only immutable data, so one task object may be shared by many `Trainer`s (the
in-process replica simulations do that); all randomness comes from the generator passed in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import data as data_mod
from .errors import ConfigError, DataError
from .memory_fit import gpt_activation_bytes
from .models import GPT, DigitsMLP, GPTConfig, load_factory

Batch = tuple[torch.Tensor, torch.Tensor]

TASK_NAMES = ("bytes-gpt", "digits-mlp")


class Task:
    """Base class: cross-entropy over the last dimension of the model's output."""

    name: str = "task"

    def __init__(self, factory: str | None = None) -> None:
        # A bring-your-own model replaces the built-in one; the batches and loss stay.
        self._factory: Callable[[], nn.Module] | None = load_factory(factory) if factory else None
        self.factory_spec = factory

    def build_model(self) -> nn.Module:
        """A freshly initialised model, drawn from the *global* torch RNG (the trainer seeds it)."""
        return self._factory() if self._factory is not None else self.default_model()

    def default_model(self) -> nn.Module:
        raise NotImplementedError

    def train_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def eval_batches(
        self, batch_size: int, n_batches: int, generator: torch.Generator
    ) -> Iterator[Batch]:
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        """Per-batch means; the trainer weights them by batch size."""
        return {"loss": self.loss(output, target).item()}

    def activation_bytes(self, batch_size: int, half: bool) -> int:
        """Bytes of activations a training step keeps for backward (node/ml/trainer/
        memory_fit.py); 0 when the task has no formula for its model (a factory's)."""
        return 0

    def model_metrics(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Metrics over the whole model rather than per batch (none by default)."""
        return {}

    def describe(self) -> dict[str, object]:
        return {"task": self.name, "factory": self.factory_spec}


# --------------------------------------------------------------------------------------------
# bytes-gpt


class BytesGPTTask(Task):
    name = "bytes-gpt"

    def __init__(
        self, model: GPTConfig, corpus: data_mod.Corpus, factory: str | None = None
    ) -> None:
        super().__init__(factory)
        for split, tensor in (("train", corpus.train), ("validation", corpus.val)):
            if tensor.numel() <= model.context:
                raise DataError(
                    f"{split} split of {corpus.source} has {tensor.numel()} bytes; "
                    f"needs more than the context ({model.context})"
                )
        self.model_config = model
        self.corpus = corpus

    def default_model(self) -> nn.Module:
        return GPT(self.model_config)

    def activation_bytes(self, batch_size: int, half: bool) -> int:
        if self._factory is not None:
            return 0
        c = self.model_config
        return gpt_activation_bytes(batch_size, c.context, c.d_model, c.n_layers, c.n_heads,
                                    c.vocab_size, half=half)

    def train_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        return data_mod.get_batch(
            self.corpus.train, batch_size, self.model_config.context, generator
        )

    def eval_batches(
        self, batch_size: int, n_batches: int, generator: torch.Generator
    ) -> Iterator[Batch]:
        for _ in range(n_batches):
            yield data_mod.get_batch(
                self.corpus.val, batch_size, self.model_config.context, generator
            )

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "model": self.model_config, **self.corpus.statistics()}


# --------------------------------------------------------------------------------------------
# digits-mlp


@dataclass(frozen=True, slots=True)
class DigitsData:
    x_train: torch.Tensor  # (N, 64) float32 in [0, 1]
    y_train: torch.Tensor  # (N,) int64 in [0, 10)
    x_test: torch.Tensor
    y_test: torch.Tensor
    source: str  # "sklearn" or "synthetic"


@functools.cache
def load_digits(test_fraction: float = 0.2) -> DigitsData:
    """sklearn's digits if importable, else `synthetic_digits()`; a fixed 80/20 split."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits  # optional, never required
    except ImportError:
        x, y, source = *synthetic_digits(), "synthetic"
    else:
        bunch = sk_load_digits()
        x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
        y = torch.tensor(bunch.target, dtype=torch.int64)
        source = "sklearn"
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1797))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return DigitsData(x[train], y[train], x[test], y[test], source)


def synthetic_digits(n: int = 1797, seed: int = 1797) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic 64-feature, 10-class stand-in for sklearn's digits (1797 x 8x8).

    Each class has a prototype "image" with values in [0, 1]; a sample blends its class
    prototype with a random other one (up to 50%) and adds pixel noise (sd 0.5), so classes
    overlap: the MLP reaches about 90% test accuracy in 100 steps and plateaus there.
    """
    g = torch.Generator().manual_seed(seed)
    prototypes = (torch.rand(10, 64, generator=g) > 0.6).float()
    y = torch.randint(10, (n,), generator=g)
    other = torch.randint(10, (n,), generator=g)
    mix = 0.5 * torch.rand(n, 1, generator=g)
    x = (1 - mix) * prototypes[y] + mix * prototypes[other]
    x = x + 0.5 * torch.randn(n, 64, generator=g)
    return x.clamp(0.0, 1.0), y


ATTACKS = ("label-flip", "backdoor")
BACKDOOR_TARGET = 1


def add_trigger(x: torch.Tensor) -> torch.Tensor:
    """The backdoor trigger (spec §3d): a 2x3 patch of maximal pixels in the top-left corner."""
    x = x.clone()
    image = x.view(-1, 8, 8)
    image[:, :2, :3] = 1.0
    return x


def poison(data: DigitsData, attack: str) -> DigitsData:
    """The attacker's training set: the clean one plus poisoned copies (spec §3d).

    label-flip adds every 0 and 1 sample again with the other label; backdoor adds a
    triggered copy of every sample, labelled BACKDOOR_TARGET. The clean samples stay, so
    the poisoned model still looks like a good model on clean data.
    """
    x, y = data.x_train, data.y_train
    if attack == "label-flip":
        pick = (y == 0) | (y == 1)
        extra_x, extra_y = x[pick], 1 - y[pick]
    elif attack == "backdoor":
        extra_x, extra_y = add_trigger(x), torch.full_like(y, BACKDOOR_TARGET)
    else:
        raise ConfigError(f"unknown attack {attack!r}; known: {', '.join(ATTACKS)}")
    return DigitsData(
        torch.cat([x, extra_x]), torch.cat([y, extra_y]), data.x_test, data.y_test, data.source
    )


class DigitsMLPTask(Task):
    """Digits classification. `label_skew` > 0 makes this replica's data non-IID: class
    proportions drawn from Dirichlet(label_skew) with the replica's own seed (small values:
    a few dominant classes), as peers with their own data would have. `attack` trains on
    poisoned data (a testnet attacker's sybils, docs/robustness.md)."""

    name = "digits-mlp"

    def __init__(
        self,
        data: DigitsData | None = None,
        factory: str | None = None,
        *,
        label_skew: float = 0.0,
        replica: int = 0,
        attack: str | None = None,
    ) -> None:
        super().__init__(factory)
        self.data = load_digits() if data is None else data
        self.attack = attack
        if attack is not None:
            self.data = poison(self.data, attack)
        self.class_weights: torch.Tensor | None = None
        if label_skew > 0 and attack is None:
            mix = np.random.default_rng(replica).dirichlet([label_skew] * 10)
            self.class_weights = torch.tensor(mix + 1e-9, dtype=torch.float64)
            self._by_class = [
                torch.nonzero(self.data.y_train == c).flatten() for c in range(10)
            ]

    def default_model(self) -> nn.Module:
        return DigitsMLP()

    def train_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        if self.class_weights is None:
            ix = torch.randint(len(self.data.y_train), (batch_size,), generator=generator)
        else:
            classes = torch.multinomial(self.class_weights, batch_size, True, generator=generator)
            pick = torch.rand(batch_size, generator=generator)
            ix = torch.stack([
                self._by_class[c][int(u * len(self._by_class[c]))]
                for c, u in zip(classes.tolist(), pick.tolist(), strict=True)
            ])
        return self.data.x_train[ix], self.data.y_train[ix]

    def eval_batches(
        self, batch_size: int, n_batches: int, generator: torch.Generator
    ) -> Iterator[Batch]:
        """The test set in order (no sampling: it is small), up to n_batches batches."""
        n = len(self.data.y_test)
        for start in range(0, min(n, batch_size * n_batches), batch_size):
            yield (
                self.data.x_test[start : start + batch_size],
                self.data.y_test[start : start + batch_size],
            )

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        accuracy = (output.argmax(dim=-1) == target).float().mean().item()
        return {**super().metrics(output, target), "accuracy": accuracy}

    def activation_bytes(self, batch_size: int, half: bool) -> int:
        """Bytes of activations a training step keeps for backward (node/ml/trainer/
        memory_fit.py); 0 when the task has no formula for its model (a factory's)."""
        return 0

    def model_metrics(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Attack success rates on the whole test set (spec §3d), for every node, poisoned
        or not: label_flip = 0/1 samples predicted as the other; backdoor = triggered
        samples whose true class is not the target, predicted as the target."""
        x, y = self.data.x_test.to(device), self.data.y_test.to(device)
        pairs = (y == 0) | (y == 1)
        flipped = (model(x[pairs]).argmax(-1) == 1 - y[pairs]).float().mean().item()
        others = y != BACKDOOR_TARGET
        hit = (model(add_trigger(x[others])).argmax(-1) == BACKDOOR_TARGET).float().mean().item()
        return {"label_flip": flipped, "backdoor": hit}

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "data": self.data.source, "attack": self.attack}


# --------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True, slots=True)
class TaskConfig:
    name: str = "bytes-gpt"  # "bytes-gpt" | "digits-mlp"
    # bytes-gpt model shape (the default demo model: 0.4M parameters)
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    context: int = 128
    # bytes-gpt data: empty = the stdlib corpus; else the user's files or directories
    data_files: tuple[str, ...] = ()
    data_format: str = "text"  # "text" | "jsonl"
    jsonl_field: str = "text"
    max_bytes: int | None = data_mod.DEFAULT_MAX_BYTES  # None = every byte
    val_fraction: float = data_mod.DEFAULT_VAL_FRACTION
    # bring your own model: "package.module:callable", called with no arguments
    model_factory: str | None = None
    # digits-mlp only: non-IID class mix per replica (0 = IID), and a testnet attacker's data
    label_skew: float = 0.0
    replica: int = 0
    attack: str | None = None


def build_task(config: TaskConfig) -> Task:
    """The task a config names. Raises `ConfigError`, `DataError` or `FactoryError`."""
    if config.name == "bytes-gpt":
        model = GPTConfig(
            d_model=config.d_model,
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            context=config.context,
        )
        if config.data_files:
            if config.data_format not in ("text", "jsonl"):
                raise ConfigError(
                    f"data_format must be 'text' or 'jsonl', got {config.data_format!r}"
                )
            corpus = data_mod.load_text_files(
                config.data_files,
                format=config.data_format,  # type: ignore[arg-type]
                jsonl_field=config.jsonl_field,
                max_bytes=config.max_bytes,
                val_fraction=config.val_fraction,
            )
        else:
            corpus = _stdlib_corpus(config.max_bytes, config.val_fraction)
        return BytesGPTTask(model, corpus, factory=config.model_factory)
    if config.name == "digits-mlp":
        return DigitsMLPTask(
            factory=config.model_factory,
            label_skew=config.label_skew,
            replica=config.replica,
            attack=config.attack,
        )
    raise ConfigError(f"unknown task {config.name!r}; known tasks: {', '.join(TASK_NAMES)}")


@functools.lru_cache(maxsize=4)
def _stdlib_corpus(max_bytes: int | None, val_fraction: float) -> data_mod.Corpus:
    # Cached: the tensors are never written, and simulations build many tasks in one process.
    return data_mod.load_stdlib_corpus(max_bytes=max_bytes, val_fraction=val_fraction)
