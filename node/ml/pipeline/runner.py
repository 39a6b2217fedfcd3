"""Executing stages: one stage fed activations and gradients, and a whole pipeline in
one process.

`StageRunner` is what a peer hosting one stage runs (the live service feeds it what
protocols/pipeline.py decodes): `forward(mb, x)` keeps the micro-batch's input and output
for its backward (`mb` is any key: the live worker uses (micro-batch, hop), since with
CheckFree+'s swap an edge stage sees a micro-batch twice, and `hop` says which parts of
the stage run), `backward(mb, grad_out)` returns the gradient of its input, the last
stage's `forward_loss(mb, x, targets)` / `backward_loss(mb)` close the loop, and `step()`
clips this stage's gradient, records its norm *after* clipping (what CheckFree weighs
neighbours by, §4g), and takes the optimizer step. At most `max_in_flight` micro-batches
wait for their backward: a flood is refused (`PipelineFull`), never queued.

`Pipeline` runs every stage of one replica in one process (tests, `node bench
checkfree`): the same per-stage optimizers, clipping and norms, with autograd across the
stage boundaries and CheckFree+'s execution order.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from node.ml.pipeline.schedule import Hop, execution_order
from node.ml.pipeline.stages import Stage, own_parameters
from node.ml.trainer.adamw import AdamW


class PipelineFull(RuntimeError):
    """More micro-batches in flight than the stage keeps: the newest one is refused."""


@dataclass(frozen=True, slots=True)
class StageOptim:
    """A stage's optimizer settings (spec §4d: Adam (0.9, 0.999), no weight decay, clip
    1.0 per stage). `lr_scale` is 1 until CheckFree rebuilds the stage (then 1.1, kept)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0: no clipping
    lr_scale: float = 1.0


def make_optimizer(stage: Stage, cfg: StageOptim) -> AdamW:
    """A fresh Adam(W) over the stage's own parameters (zero moments)."""
    return AdamW(own_parameters(stage), lr=cfg.lr * cfg.lr_scale, betas=cfg.betas,
                 weight_decay=cfg.weight_decay)


def clip_and_norm(stage: Stage, grad_clip: float) -> float:
    """Clip the stage's gradient to `grad_clip` (0: none); return its norm after clipping."""
    params = [p for p in own_parameters(stage) if p.grad is not None]
    if not params:
        return 0.0
    if grad_clip > 0:
        pre = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        return min(pre, grad_clip) if math.isfinite(pre) else pre
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params
                                                       if p.grad is not None])))


class StageRunner:
    """One stage on one peer: forward and backward per micro-batch, one step per step."""

    def __init__(self, stage: Stage, cfg: StageOptim, max_in_flight: int = 8) -> None:
        self.stage = stage
        self.cfg = cfg
        self.optimizer = make_optimizer(stage, cfg)
        self.max_in_flight = max_in_flight
        self.grad_norm = 0.0  # the last step's, after clipping
        self._saved: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}  # (input, out)

    @property
    def in_flight(self) -> int:
        return len(self._saved)

    def _keep(self, mb: Hashable, x_in: torch.Tensor, out: torch.Tensor) -> None:
        if mb in self._saved:
            raise ValueError(f"micro-batch {mb} is already in flight at stage "
                             f"{self.stage.index}")
        if len(self._saved) >= self.max_in_flight:
            raise PipelineFull(f"stage {self.stage.index} holds {len(self._saved)} "
                               f"micro-batches awaiting backward (max {self.max_in_flight})")
        self._saved[mb] = (x_in, out)

    def _run(self, x: torch.Tensor, hop: Hop | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input kept for the backward, output): the whole stage, or the hop's parts."""
        embeds = self.stage.is_first if hop is None else hop.embed
        x_in = x if embeds else x.detach().float().requires_grad_(True)
        if hop is None:
            return x_in, self.stage(x_in)
        if hop.stage != self.stage.index:
            raise ValueError(f"a hop of stage {hop.stage} at stage {self.stage.index}")
        out = self.stage.embed(x_in) if hop.embed else x_in
        out = self.stage.run_blocks(out) if hop.blocks else out
        return x_in, self.stage.head(out) if hop.head else out

    def forward(self, mb: Hashable, x: torch.Tensor, hop: Hop | None = None) -> torch.Tensor:
        """Token ids (embedding) or activations in; activations out (detached: they go
        on the wire). Not where the head runs (`forward_loss`)."""
        if self.stage.is_last if hop is None else hop.head:
            raise RuntimeError("the last stage computes the loss: call forward_loss")
        x_in, out = self._run(x, hop)
        self._keep(mb, x_in, out)
        return out.detach()

    def forward_loss(self, mb: Hashable, x: torch.Tensor, targets: torch.Tensor,
                     hop: Hop | None = None) -> float:
        if not (self.stage.is_last if hop is None else hop.head):
            raise RuntimeError(f"stage {self.stage.index} is not the last")
        x_in, logits = self._run(x, hop)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        self._keep(mb, x_in, loss)
        return float(loss.detach())

    def backward_loss(self, mb: Hashable, scale: float = 1.0) -> torch.Tensor | None:
        """Backward from the loss (times `scale`: 1/micro-batches to average them)."""
        return self.backward(mb, torch.tensor(scale))

    def backward(self, mb: Hashable, grad_out: torch.Tensor) -> torch.Tensor | None:
        """Accumulate this stage's gradient; return the gradient of its input (None where
        the input was token ids: the embedding ran)."""
        saved = self._saved.pop(mb, None)
        if saved is None:
            raise KeyError(f"micro-batch {mb} is not in flight at stage {self.stage.index}")
        x_in, out = saved
        out.backward(grad_out.to(out.dtype))
        return x_in.grad if x_in.requires_grad else None

    def drop(self, mb: Hashable) -> bool:
        """Forget a micro-batch whose other end died: it costs that micro-batch only."""
        return self._saved.pop(mb, None) is not None

    def step(self) -> float:
        """Clip, record the norm after clipping, step, zero the gradients."""
        self.grad_norm = clip_and_norm(self.stage, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.grad_norm

    def reset_optimizer(self, lr_scale: float) -> None:
        """A fresh Adam at lr x `lr_scale` (CheckFree's rebuilt stage keeps the raise)."""
        self.cfg = StageOptim(self.cfg.lr, self.cfg.betas, self.cfg.weight_decay,
                              self.cfg.grad_clip, lr_scale)
        self.optimizer = make_optimizer(self.stage, self.cfg)


class Pipeline:
    """Every stage of one replica in one process, each with its own optimizer."""

    def __init__(self, stages: Sequence[Stage], cfg: StageOptim, swap: bool = False) -> None:
        self.stages = list(stages)
        self.layers = [s.n_blocks for s in self.stages]
        self.swap = swap
        self.runners = [StageRunner(s, cfg) for s in self.stages]

    def forward(self, idx: torch.Tensor, micro_batch: int = 0, swap: bool | None = None
                ) -> torch.Tensor:
        """Logits, the stages' blocks in CheckFree+'s order when swapping."""
        order = execution_order(self.layers, micro_batch, self.swap if swap is None else swap)
        x = self.stages[0].embed(idx)
        for s in order:
            x = self.stages[s].run_blocks(x)
        return self.stages[-1].head(x)

    def train_step(self, mbs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step over equal-sized micro-batches; the mean loss.

        Micro-batches that run in the same order are computed as one batch: every stage
        steps once per iteration, so the accumulated gradient is the same (the mean of the
        micro-batches' losses), in one pass instead of one per micro-batch.
        """
        groups: dict[tuple[int, ...], list[int]] = {}
        for k in range(len(mbs)):
            order = tuple(execution_order(self.layers, k, self.swap))
            groups.setdefault(order, []).append(k)
        total = 0.0
        for ks in groups.values():
            x = torch.cat([mbs[k][0] for k in ks])
            y = torch.cat([mbs[k][1] for k in ks])
            logits = self.forward(x, ks[0])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            (loss * (len(ks) / len(mbs))).backward()
            total += float(loss.detach()) * len(ks)
        for r in self.runners:
            r.step()
        return total / len(mbs)

    def grad_norms(self) -> list[float]:
        return [r.grad_norm for r in self.runners]

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss in the stage order (no swap), as inference runs."""
        losses = []
        for x, y in batches:
            logits = self.forward(x, 0, swap=False)
            losses.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                y.reshape(-1))))
        return sum(losses) / len(losses)
