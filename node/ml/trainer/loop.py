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

At the GPU's speed (issue 29; docs/training.md): the loss and gradient norm are copied back
every `sync_every` steps without the host waiting for them, a non-finite step is skipped on
the device and raised once its read-back is in, AdamW runs its fused kernel on CUDA, a
batch may be split into micro-batches, and `torch.compile` runs beside training (eager
until it is ready).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from node.ml.device import resolve as resolve_device

from .adamw import AdamW
from .errors import ConfigError, DeviceMemoryError, TrainerError
from .memory_fit import estimate, shortfall
from .tasks import Task

CHECKPOINT_FORMAT = "peertrain.trainer"
CHECKPOINT_VERSION = 1
CUDA_SYNC_EVERY = 10  # sync_every's "auto" on CUDA: loss and grad norm read back every 10 steps

log = logging.getLogger("node.training")

# compiler(model, example input) -> a forward for training, compiled (forward and backward)
# before it returns; called in a thread beside the training one (`Trainer`, "Compiling").
Compiler = Callable[[nn.Module, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


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
    # micro-batches per step (batch_size / grad_accum samples each, gradients summed: the
    # same update as the whole batch); 0 = as few as fit the GPU's free memory (1 on a CPU)
    grad_accum: int = 0
    # loss and grad norm read back to the host every sync_every steps (non-finite steps are
    # caught on the device meanwhile); 0 = 1 on a CPU (a read costs nothing), 10 on CUDA
    sync_every: int = 0
    fused: bool | None = None  # AdamW's fused kernel; None = on CUDA only
    compile: bool | None = None  # torch.compile beside training; None = on CUDA only

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
            "grad_accum": self.grad_accum >= 0 and (
                self.grad_accum == 0 or self.batch_size % self.grad_accum == 0),
            "sync_every": self.sync_every >= 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ConfigError(f"TrainConfig out of range: {values}")


@dataclass(frozen=True, slots=True)
class StepStats:
    step: int  # steps completed, this one included
    # training loss (before the update) and global gradient norm (before clipping) of step
    # `measured`: the newest step read back to the host (every `sync_every` steps; on a CPU
    # every step, so measured == step)
    loss: float
    lr: float  # learning rate this step used
    # host wall time of the step (evaluation excluded); on CUDA the host runs ahead of the
    # kernels, so only sums of steps between two flush()es are the GPU's time
    seconds: float
    grad_norm: float
    val_loss: float | None = None  # set when this step triggered an evaluation
    measured: int = 0  # the step `loss` and `grad_norm` belong to


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


def torch_compiler(model: nn.Module, example: torch.Tensor) -> Callable[[torch.Tensor],
                                                                         torch.Tensor]:
    """`torch.compile(model)`, traced and compiled for training on `example` now.

    The forward runs once with gradients on, so the training graph is the one compiled, and
    AOTAutograd compiles its backward at the same time (it would otherwise wait for the
    first backward, in the training thread). Nothing is backpropagated: the model's
    gradients and weights are not touched."""
    import torch._functorch.config as functorch_config

    compiled = torch.compile(model)
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        compiled(example)
    return compiled


def _landed(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()


class Trainer:
    def __init__(self, task: Task, config: TrainConfig | None = None, *,
                 compiler: Compiler | None = None) -> None:
        self.task = task
        self.config = config = TrainConfig() if config is None else config
        self.device = resolve_device(config.device)
        cuda = self.device.type == "cuda"

        # Initial weights from `seed` alone, drawn on the CPU without touching the caller's
        # global RNG, so every replica and every device starts from the same weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(config.seed, "init"))
            model = task.build_model()
        self.n_params = sum(p.numel() for p in model.parameters())
        self.accum = config.grad_accum or 1
        want_compile = cuda if config.compile is None else config.compile
        if cuda:  # before the model moves there: no OOM mid-run
            self.accum = self.check_memory()
            want_compile = want_compile and self._warmup_fits()
        self.micro_batch = config.batch_size // self.accum
        self.sync_every = config.sync_every or (CUDA_SYNC_EVERY if cuda else 1)
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
            fused=cuda if config.fused is None else config.fused,
        )
        self.data_rng = torch.Generator().manual_seed(
            derive_seed(config.seed, "data", config.replica)
        )
        self.eval_seed = derive_seed(config.seed, "eval")
        self.step_count = 0
        self.last_loss: float | None = None
        self.last_grad_norm: float | None = None
        self.measured = 0  # the step last_loss and last_grad_norm belong to
        self.last_eval: dict[str, float] | None = None
        # Steps not read back yet: (step, loss, grad norm) as device tensors; and the flag
        # that makes AdamW skip every update from the first non-finite step on (see step()).
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._found_inf = torch.zeros((), device=self.device)
        # On CUDA a read-back is a copy queued behind the step's kernels and collected once it
        # has landed (the next step that finds it done, or the next read-back), so the host
        # never waits for the GPU in steady state: a blocking read would drain the GPU's queue
        # every `sync_every` steps. On a CPU the values are there when the step returns.
        self.read_back_async = cuda
        self._in_flight: tuple[list[int], torch.Tensor, torch.cuda.Event | None] | None = None

        # Compiling beside training: the steps run eager until the compiled forward is
        # ready, so compile time never delays a step (a join's first one included).
        self._compiled: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.compile_status = "off"  # "off" | "compiling" | "ready" | "failed: <why>"
        self.compile_done = threading.Event()
        if want_compile:
            self.compile_status = "compiling"
            threading.Thread(target=self._compile_beside, args=(compiler or torch_compiler,),
                             daemon=True, name="peertrain-compile").start()
        else:
            self.compile_done.set()

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

    def _half(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_bf16_supported()

    def check_memory(self, free_bytes: int | None = None) -> int:
        """The micro-batches per step that fit the device's free memory (`config.grad_accum`,
        or with 0 the fewest that fit); DeviceMemoryError when none does
        (node/ml/trainer/memory_fit.py). `free_bytes` defaults to torch.cuda.mem_get_info."""
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
        batch, half = self.config.batch_size, self._half()
        cuda = self.device.type == "cuda"
        tries = ([self.config.grad_accum] if self.config.grad_accum else
                 [k for k in range(1, batch + 1) if batch % k == 0])
        for accum in tries:
            est = estimate(self.n_params, self.task.activation_bytes(batch // accum, half),
                           half=half, cuda=cuda)
            if shortfall(est, free_bytes, str(self.device), batch // accum) is None:
                return accum
        # none fits: say so for the whole batch (or the micro-batch asked for), with the
        # batch that would fit
        micro = batch // tries[0]
        est = estimate(self.n_params, self.task.activation_bytes(micro, half), half=half,
                       cuda=cuda)
        raise DeviceMemoryError(shortfall(est, free_bytes, str(self.device), micro) or "")

    def _warmup_fits(self) -> bool:
        """Whether one more micro-batch's activations (the compile's warm-up forward, beside
        the training step) fit too; if not, the trainer stays eager."""
        free, _ = torch.cuda.mem_get_info(self.device)
        half = self._half()
        act = self.task.activation_bytes(self.config.batch_size // self.accum, half)
        if estimate(self.n_params, 2 * act, half=half, cuda=True).total <= free:
            return True
        log.info("not compiling: the compile's warm-up would not fit beside training")
        return False

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        # bf16 autocast on CUDA only: CPU autocast is slower than fp32 for these shapes, and
        # the weights, gradients and optimizer state stay fp32 in either case.
        if self._half():
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _compile_beside(self, compiler: Compiler) -> None:
        """Compile a twin of the model (its own module objects, the same parameter tensors)
        on a batch of the training shape; the steps switch to it once it is ready.

        A twin, so that evaluation switching the model to eval mode meanwhile cannot change
        what is traced (its guards would then fail and recompile in the training thread).
        Only a forward runs here: the weights and gradients are the training thread's."""
        started = time.perf_counter()
        try:
            shared = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
            twin = copy.deepcopy(self.model, memo=shared).train()
            example, _ = self.task.train_batch(
                self.micro_batch, torch.Generator().manual_seed(
                    derive_seed(self.config.seed, "compile")))
            with torch.enable_grad(), self._autocast():
                forward = compiler(twin, example.to(self.device))
        except Exception as e:  # eager it stays: slower, never wrong
            self.compile_status = f"failed: {type(e).__name__}: {str(e)[:200]}"
            log.warning("torch.compile failed, training stays eager: %s", self.compile_status)
        else:
            self._compiled = forward
            self.compile_status = "ready"
            log.info("torch.compile ready after %.1f s; the steps run compiled from now on",
                     time.perf_counter() - started)
        finally:
            self.compile_done.set()

    # ----------------------------------------------------------------------------------------
    # Steps

    def step(self) -> StepStats:
        """One inner step: sample a batch, forward and backward (in `accum` micro-batches),
        clip, AdamW update.

        No read-back to the host except every `sync_every` steps (and the first step, and
        before an evaluation): a GPU keeps computing while the host queues the next step. A
        non-finite loss or gradient norm is caught on the device: it sets a flag that makes
        AdamW skip this update and every later one until the next read-back, which raises
        `TrainingDiverged` for the first such step and leaves the trainer as it was before
        it (weights, AdamW state, step count)."""
        self.ensure_threads()
        started = time.perf_counter()
        number = self.step_count + 1
        lr = lr_at(self.step_count, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        x, y = self.task.train_batch(self.config.batch_size, self.data_rng)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            loss = self._forward_backward(x, y)
        except torch.OutOfMemoryError as e:  # the estimate missed (a factory's model)
            self.optimizer.zero_grad(set_to_none=True)
            raise DeviceMemoryError(
                f"out of memory on {self.device} in step {number} (batch "
                f"{self.config.batch_size} in {self.accum} micro-batches): use a run with a "
                f"smaller batch or more pipeline stages, or --device cpu "
                f"({str(e).splitlines()[0]})") from e
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()
        torch.maximum(self._found_inf, bad, out=self._found_inf)  # stays set until read
        self.optimizer.step(found_inf=self._found_inf)
        self.step_count = number
        self._pending.append((number, loss, grad_norm))
        evaluating = bool(self.config.eval_every) and number % self.config.eval_every == 0
        if evaluating or self.last_loss is None:
            self.flush()
        elif number % self.sync_every == 0:
            self._read_back_later()
        elif self._in_flight is not None and _landed(self._in_flight[2]):
            self._collect()
        seconds = time.perf_counter() - started

        val_loss = self.evaluate() if evaluating else None
        assert self.last_loss is not None and self.last_grad_norm is not None
        return StepStats(number, self.last_loss, lr, seconds, self.last_grad_norm, val_loss,
                         measured=self.measured)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradients of the batch's mean loss, summed over `accum` equal micro-batches (the
        same gradient as the whole batch at once); returns the mean loss, on the device."""
        cuda = self.device.type == "cuda"
        total: torch.Tensor | None = None
        for xm, ym in zip(x.chunk(self.accum), y.chunk(self.accum), strict=True):
            if cuda:  # page-locked, so the copy is queued behind the running kernels
                xm, ym = xm.pin_memory(), ym.pin_memory()
            xm = xm.to(self.device, non_blocking=True)
            ym = ym.to(self.device, non_blocking=True)
            with self._autocast():
                loss = self.task.loss(self._forward(xm), ym)
            (loss / self.accum if self.accum > 1 else loss).backward()
            loss = loss.detach()
            total = loss if total is None else total + loss
        assert total is not None
        return total / self.accum if self.accum > 1 else total

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        compiled = self._compiled
        if compiled is None:
            return self.model(x)
        try:
            return compiled(x)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a compiled graph that fails later: eager from now on
            self._compiled = None
            self.compile_status = f"failed: {type(e).__name__}: {str(e)[:200]}"
            log.warning("the compiled model failed, training goes on eager: %s",
                        self.compile_status)
            return self.model(x)

    def flush(self) -> None:
        """Read every step not read back yet to the host (one sync), and raise
        `TrainingDiverged` for the first non-finite one: the device skipped its update and
        every later one, so the trainer goes back to the step before it."""
        self._collect()
        if self._pending:
            self._launch_read_back()
            self._collect()

    def _read_back_later(self) -> None:
        """The pending steps' read-back queued (synchronous where `read_back_async` is off);
        the one before it, long landed, collected first."""
        self._collect()
        self._launch_read_back()
        if not self.read_back_async:
            self._collect()

    def _launch_read_back(self) -> None:
        pending, self._pending = self._pending, []
        values = torch.stack([torch.stack([loss.float(), norm.float()])
                              for _, loss, norm in pending])
        event = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self._in_flight = ([number for number, _, _ in pending], values, event)

    def _collect(self) -> None:
        """Take in the read-back in flight (waiting for it if it has not landed)."""
        if self._in_flight is None:
            return
        numbers, host, event = self._in_flight
        self._in_flight = None
        if event is not None:
            event.synchronize()
        for number, (loss, norm) in zip(numbers, host.tolist(), strict=True):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                self.step_count = number - 1
                self._found_inf.zero_()
                self._pending = []  # skipped on the device too (found_inf was set)
                self.optimizer.zero_grad(set_to_none=True)
                raise TrainingDiverged(number, loss)
            self.last_loss, self.last_grad_norm = loss, norm
            self.measured = number

    def evaluate(self) -> float:
        """Validation loss over `eval_batches` fixed batches (the same on every call)."""
        return self.evaluate_metrics()["loss"]

    @torch.no_grad()
    def evaluate_metrics(self) -> dict[str, float]:
        """Validation metrics ("loss", plus "accuracy" for classification tasks). Pending
        steps are read back first (`flush`): a diverged step raises here, before it counts."""
        self.ensure_threads()
        self.flush()
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
        Pending steps are read back first (`flush`, free: the copy waits for them anyway), so
        a diverged step raises `TrainingDiverged` before its window's weights go anywhere.
        """
        self.flush()
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
        self.flush()
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
        second trainer loading it would share the first one's AdamW moments. Pending steps
        are read back first (`flush`).
        """
        self.flush()
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
        self._pending, self._in_flight = [], None  # about weights that are gone
        self._found_inf.zero_()
