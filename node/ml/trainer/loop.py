"""The inner loop: one `Trainer` owns a model, its AdamW optimizer and its data stream.

It is built to be driven one step at a time from the daemon's dedicated training thread
(`trio.to_thread.run_sync(trainer.step)`, or a plain `threading.Thread`); the outer
optimizers in node/ml/optim/ read and write its weights between steps through
`parameters_vector()` / `set_parameters_vector()`. One thread at a time may call a
`Trainer`; nothing here locks.

Seeding (NoLoCo needs identical initial weights on every replica, spec section 1b):
- the model's initial weights depend only on `seed`, so every replica of a run that shares
  the seed starts from the same weights, on any device (they are drawn on the CPU);
- the training data stream depends on `seed` and `replica`, so replicas see different
  batches;
- evaluation uses the same fixed batches on every call and on every replica, so validation
  losses are comparable across time and peers.

Inner optimiser: AdamW (our own, node/ml/trainer/adamw.py: torch.optim's imports
torch._dynamo), betas (0.9, 0.95), weight decay on matrices and embeddings only (nanoGPT),
linear warm-up then cosine decay to a floor of lr/10, gradient clipping at 1.0 (spec
sections 0d and 1d). Its state is never reset or averaged by the outer step.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import time
from dataclasses import asdict, dataclass

import torch

from node.ml.device import resolve as resolve_device

from .adamw import AdamW
from .errors import ConfigError, DeviceMemoryError, TrainerError
from .memory_fit import estimate, shortfall
from .tasks import Task

CHECKPOINT_FORMAT = "peertrain.trainer"
CHECKPOINT_VERSION = 1


class TrainingDiverged(TrainerError):
    """The loss became NaN or infinite; the weights were left as they were before the step."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"loss is {loss} at step {step}; the update was not applied")
        self.step = step
        self.loss = loss


class TrainerStateError(TrainerError, ValueError):
    """A trainer state dict is not one this trainer can load (format, version, task, shapes).
    Not node/checkpoints' CheckpointError (a checkpoint the store cannot find, fetch or
    verify): that one is a node error with an exit status, which node/ml/ cannot import."""


@dataclass(frozen=True, slots=True)
class TrainConfig:
    lr: float = 2e-3  # peak inner learning rate (2e-3 suits the small byte GPT; stack notes 4)
    min_lr_ratio: float = 0.1  # cosine floor = lr * min_lr_ratio (spec 1d: lr/10)
    warmup_steps: int = 100  # linear warm-up from lr/warmup_steps to lr
    max_steps: int = 10_000  # the cosine reaches its floor here and stays there
    weight_decay: float = 0.1  # AdamW, on tensors with >= 2 dimensions only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    batch_size: int = 16
    eval_every: int = 100  # step() evaluates after every eval_every-th step; 0 = never
    eval_batches: int = 8  # batches per evaluation
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:<i>"
    threads: int = 1  # torch intra-op threads for the training thread; 0 = torch's default
    seed: int = 0  # initial weights depend on this alone
    replica: int = 0  # the data stream depends on (seed, replica)

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr > 0,
            "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "warmup_steps": self.warmup_steps >= 0,
            "max_steps": self.max_steps >= 1,
            "weight_decay": self.weight_decay >= 0,
            "beta1": 0 <= self.beta1 < 1,
            "beta2": 0 <= self.beta2 < 1,
            "grad_clip": self.grad_clip >= 0,
            "batch_size": self.batch_size >= 1,
            "eval_every": self.eval_every >= 0,
            "eval_batches": self.eval_batches >= 1,
            "threads": self.threads >= 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ConfigError(f"TrainConfig out of range: {values}")


@dataclass(frozen=True, slots=True)
class StepStats:
    step: int  # steps completed, this one included
    loss: float  # training loss of this step's batch (before the update)
    lr: float  # learning rate this step used
    seconds: float  # wall time of the training step (evaluation excluded)
    grad_norm: float  # global gradient norm before clipping
    val_loss: float | None = None  # set when this step triggered an evaluation


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate for 0-based `step`: linear warm-up, cosine decay, then the floor."""
    floor = config.lr * config.min_lr_ratio
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.max_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - floor)


def derive_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed from (seed, labels) via SHA-256: stable across processes and machines."""
    text = "/".join(str(part) for part in (seed, *labels))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


class Trainer:
    def __init__(self, task: Task, config: TrainConfig | None = None) -> None:
        self.task = task
        self.config = config = TrainConfig() if config is None else config
        self.device = resolve_device(config.device)

        # Initial weights from `seed` alone, drawn on the CPU without touching the caller's
        # global RNG, so every replica and every device starts from the same weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(config.seed, "init"))
            model = task.build_model()
        self.n_params = sum(p.numel() for p in model.parameters())
        if self.device.type == "cuda":  # before the model moves there: no OOM mid-run
            self.check_memory()
        self.model = model.to(self.device)
        self.params = list(self.model.parameters())  # the order of parameters_vector()

        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=lr_at(0, config),
            betas=(config.beta1, config.beta2),
        )
        self.data_rng = torch.Generator().manual_seed(
            derive_seed(config.seed, "data", config.replica)
        )
        self.eval_seed = derive_seed(config.seed, "eval")
        self.step_count = 0
        self.last_loss: float | None = None
        self.last_eval: dict[str, float] | None = None

    # ----------------------------------------------------------------------------------------
    # Threads and precision

    def ensure_threads(self) -> None:
        """Apply `config.threads` to the calling OS thread.

        `torch.set_num_threads` sets an OpenMP per-thread value: a worker thread started by
        trio (or any thread pool) does not inherit the main thread's setting, and even
        *reports* the main thread's value while it runs with the default (stack notes,
        section 5: a `to_thread` worker reported 1 and used 2 cores). trio's thread cache
        may run successive calls on different threads, so this runs at the top of every
        `step()` and `evaluate()`; it costs under a microsecond.
        """
        if self.config.threads > 0:
            torch.set_num_threads(self.config.threads)

    def check_memory(self, free_bytes: int | None = None) -> None:
        """DeviceMemoryError when a step's estimated memory exceeds the device's free memory
        (node/ml/trainer/memory_fit.py); `free_bytes` defaults to torch.cuda.mem_get_info."""
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
        half = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        est = estimate(self.n_params, self.task.activation_bytes(self.config.batch_size, half))
        reason = shortfall(est, free_bytes, str(self.device), self.config.batch_size)
        if reason is not None:
            raise DeviceMemoryError(reason)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        # bf16 autocast on CUDA only: CPU autocast is slower than fp32 for these shapes, and
        # the weights, gradients and optimizer state stay fp32 in either case.
        if self.device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ----------------------------------------------------------------------------------------
    # Steps

    def step(self) -> StepStats:
        """One inner step: sample a batch, forward, backward, clip, AdamW update."""
        self.ensure_threads()
        started = time.perf_counter()
        lr = lr_at(self.step_count, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        x, y = self.task.train_batch(self.config.batch_size, self.data_rng)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.model.train()
        try:
            with self._autocast():
                loss = self.task.loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        except torch.OutOfMemoryError as e:  # the estimate missed (a factory's model)
            self.optimizer.zero_grad(set_to_none=True)
            raise DeviceMemoryError(
                f"out of memory on {self.device} in step {self.step_count + 1} (batch "
                f"{self.config.batch_size}): use a run with a smaller batch or more pipeline "
                f"stages, or --device cpu ({str(e).splitlines()[0]})") from e
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        loss_value = loss.item()
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(self.step_count + 1, loss_value)
        self.optimizer.step()
        self.step_count += 1
        self.last_loss = loss_value
        seconds = time.perf_counter() - started

        val_loss = None
        if self.config.eval_every and self.step_count % self.config.eval_every == 0:
            val_loss = self.evaluate()
        return StepStats(self.step_count, loss_value, lr, seconds, grad_norm, val_loss)

    def evaluate(self) -> float:
        """Validation loss over `eval_batches` fixed batches (the same on every call)."""
        return self.evaluate_metrics()["loss"]

    @torch.no_grad()
    def evaluate_metrics(self) -> dict[str, float]:
        """Validation metrics ("loss", plus "accuracy" for classification tasks)."""
        self.ensure_threads()
        generator = torch.Generator().manual_seed(self.eval_seed)
        totals: dict[str, float] = {}
        count = 0
        self.model.eval()
        try:
            batches = self.task.eval_batches(
                self.config.batch_size, self.config.eval_batches, generator
            )
            for x, y in batches:
                x, y = x.to(self.device), y.to(self.device)
                with self._autocast():
                    output = self.model(x)
                for name, value in self.task.metrics(output, y).items():
                    totals[name] = totals.get(name, 0.0) + value * len(x)
                count += len(x)
            if count:
                totals.update({k: v * count for k, v in
                               self.task.model_metrics(self.model, self.device).items()})
        finally:
            self.model.train()
        if count == 0:
            raise TrainerError(f"task {self.task.name!r} yielded no evaluation batches")
        self.last_eval = {name: total / count for name, total in totals.items()}
        return self.last_eval

    # ----------------------------------------------------------------------------------------
    # Weights as one vector, for the outer optimizers

    def parameters_vector(self) -> torch.Tensor:
        """A new fp32 CPU vector of every parameter, in `model.parameters()` order.

        Tied weights appear once. The vector is a copy: changing it leaves the model alone.
        """
        with torch.no_grad():
            if self.device.type != "cuda":
                return torch.cat([p.detach().reshape(-1).float() for p in self.params])
            # One flatten on the GPU, one DMA into page-locked host memory (torch's caching
            # host allocator reuses the block): not one blocking copy per tensor into
            # pageable memory plus a host-side cat. The exchange reads the result as is.
            flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
            host = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            return host

    def set_parameters_vector(self, vector: torch.Tensor) -> None:
        """Copy a vector laid out as `parameters_vector()` into the model's parameters.

        The data is copied (the model never aliases `vector`), and the AdamW state is kept:
        the outer step moves the weights, not the inner optimizer (spec section 1b).
        """
        if vector.dim() != 1 or vector.numel() != self.n_params:
            raise ValueError(
                f"expected a vector of {self.n_params} values, got shape {tuple(vector.shape)}"
            )
        with torch.no_grad():
            # On CUDA: one host-to-device copy of the whole vector, then the slices move on
            # the device (not one small transfer per tensor). Blocking: the caller may reuse
            # `vector` as soon as this returns.
            source = vector.to(self.device)
            offset = 0
            for p in self.params:
                n = p.numel()
                p.copy_(source[offset : offset + n].view_as(p))
                offset += n

    # ----------------------------------------------------------------------------------------
    # Checkpoint state

    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume bit-for-bit, saying what it is (STYLE.md point 10).

        A deep copy: torch's own state dicts alias the live tensors, so a snapshot handed to
        another thread (a checkpoint writer) would change under it as training goes on, and a
        second trainer loading it would share the first one's AdamW moments.
        """
        return copy.deepcopy(
            {
                "format": CHECKPOINT_FORMAT,
                "version": CHECKPOINT_VERSION,
                "task": self.task.name,
                "step": self.step_count,
                "n_params": self.n_params,
                "config": asdict(self.config),
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "data_rng": self.data_rng.get_state(),
            }
        )

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore a `state_dict()`; the current config is kept. Raises `TrainerStateError`."""
        if state.get("format") != CHECKPOINT_FORMAT or state.get("version") != CHECKPOINT_VERSION:
            raise TrainerStateError(
                f"not a {CHECKPOINT_FORMAT} v{CHECKPOINT_VERSION} state: "
                f"format={state.get('format')!r} version={state.get('version')!r}"
            )
        if state.get("task") != self.task.name or state.get("n_params") != self.n_params:
            raise TrainerStateError(
                f"state is for task {state.get('task')!r} with {state.get('n_params')} "
                f"parameters; this trainer runs {self.task.name!r} with {self.n_params}"
            )
        try:
            self.model.load_state_dict(state["model"])  # type: ignore[arg-type]
            self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        except (RuntimeError, ValueError, KeyError) as exc:
            raise TrainerStateError(f"state does not fit this model: {exc}") from exc
        self.data_rng.set_state(state["data_rng"])  # type: ignore[arg-type]
        self.step_count = int(state["step"])  # type: ignore[call-overload]
