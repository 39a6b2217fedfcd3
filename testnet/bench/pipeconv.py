"""NoLoCo with pipelines: replicas of each stage, random routing on and off.

    node bench convergence --pipeline [--quick]

The NoLoCo paper's claim over DiLoCo is made for pipelines whose activations are routed at
random between the replicas of the next stage (specs/algorithms.md §1c; §1f's optional
"2 stages x 4 replicas, with and without routing"). This benchmark simulates that in one
process: a byte-level GPT cut into 2 stages (node/ml/pipeline: the embedding and first block;
the second block, final norm and head), 4 replicas of each stage, each stage replica with
its own AdamW (the trainer's settings and schedule) and gradient clipping. Every replica of
the first stage reads its own data stream; every sequence is its own micro-batch and
follows `node.ml.pipeline.path` (seeded by the run seed, step and sequence): with random
routing a sequence may cross to any replica of the next stage, with fixed routing it stays
on its own replica's stages, which makes 4 independent data-parallel models.

The head is tied to the embedding of the replica the sequence started at, so its gradient
reaches that embedding: in one process exactly what the live pipeline approximates by
borrowing the owner's matrix (node/pipe). Every H inner steps each stage takes its outer
step over that stage's replicas: NoLoCo in random pairs (`noloco_groups`, per stage),
DiLoCo over all 4, or none. Evaluation uses fixed routing (replica r's own stages), as the
reference does; the loss is the mean over the 4 replica pipelines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

from node.ml.optim import DiLoCo, NoLoCo, noloco_groups
from node.ml.pipeline import Stage, build_stages, path
from node.ml.pipeline.runner import clip_and_norm
from node.ml.pipeline.stages import copy_vector_into
from node.ml.trainer import TaskConfig, TrainConfig, build_task
from node.ml.trainer.adamw import AdamW
from node.ml.trainer.loop import lr_at
from node.ml.trainer.models import GPTConfig
from node.ml.trainer.tasks import Task
from testnet.bench.convergence import DILOCO, NOLOCO, replica_spread
from testnet.bench.report import DOC, machine, md_table, print_tables, pyplot, write_section

METHODS = ("noloco", "diloco", "none")
ROUTINGS = ("random", "fixed")
RUNS = tuple((m, r) for m in METHODS for r in ROUTINGS)
COLORS = {"noloco": "tab:blue", "diloco": "tab:orange", "none": "tab:red"}


@dataclass(frozen=True, slots=True)
class PipeConfig:
    stages: int = 2
    replicas: int = 4
    steps: int = 700
    h: int = 50  # inner steps per outer round
    eval_every: int = 50
    marks: tuple[int, ...] = (100, 300, 500, 700)
    batch: int = 8  # sequences per first-stage replica per step, one micro-batch each
    d_model: int = 64
    n_layers: int = 2  # split evenly over the stages
    n_heads: int = 4
    context: int = 64
    max_bytes: int = 4_000_000
    lr: float = 2e-3
    warmup_steps: int = 100
    eval_batch: int = 64
    eval_batches: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.stages < 2 or self.replicas < 2 or self.n_layers % self.stages:
            raise ValueError(f"need >= 2 stages and replicas, layers a multiple of stages: {self}")
        for mark in self.marks:
            if mark > self.steps or mark % self.eval_every or mark % self.h:
                raise ValueError(f"mark {mark} is not an evaluation step at an outer boundary")

    @property
    def layers(self) -> list[int]:
        return [self.n_layers // self.stages] * self.stages


FULL = PipeConfig()
QUICK = PipeConfig(steps=120, h=20, eval_every=40, marks=(40, 80, 120), max_bytes=1_000_000,
                   warmup_steps=20)


@dataclass(slots=True)
class RunResult:
    method: str
    routing: str
    eval_steps: list[int] = field(default_factory=list)
    val_mean: list[float] = field(default_factory=list)
    val_min: list[float] = field(default_factory=list)
    val_max: list[float] = field(default_factory=list)
    spread: list[float] = field(default_factory=list)  # per stage, mean, at the last step
    train_seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.method}, {self.routing} routing"

    def val_at(self, step: int) -> float | None:
        return self.val_mean[self.eval_steps.index(step)] if step in self.eval_steps else None


def build_bench_task(cfg: PipeConfig) -> Task:
    return build_task(TaskConfig(name="bytes-gpt", d_model=cfg.d_model, n_layers=cfg.n_layers,
                                 n_heads=cfg.n_heads, context=cfg.context,
                                 max_bytes=cfg.max_bytes))


def _train_config(cfg: PipeConfig) -> TrainConfig:
    return TrainConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.steps)


def _adamw(stage: Stage, tc: TrainConfig) -> AdamW:
    """The trainer's AdamW: weight decay on matrices only."""
    params = list(stage.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2))


def _vector(stage: Stage) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(stage.parameters()).detach().clone()


def _load(stage: Stage, vector: torch.Tensor) -> None:
    copy_vector_into(list(stage.parameters()), vector)


class Grid:
    """grid[s][r]: replica r of stage s, all starting from the same weights (the seed)."""

    def __init__(self, cfg: PipeConfig) -> None:
        gpt = GPTConfig(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                        context=cfg.context)
        replicas = [build_stages(gpt, cfg.layers, cfg.seed) for _ in range(cfg.replicas)]
        self.stages: list[list[Stage]] = [list(col) for col in zip(*replicas, strict=True)]
        self.cfg = cfg
        tc = _train_config(cfg)
        self.optimizers = [[_adamw(st, tc) for st in row] for row in self.stages]

    def loss(self, step: int, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             routing: str) -> torch.Tensor:
        """Sum over first-stage replicas of each one's mean loss over its sequences; every
        later stage's replica receives one sequence per micro-batch index (a permutation),
        so its gradient is the mean over what it processed too."""
        cfg, rows = self.cfg, self.stages
        seqs = [(r, k) for r in range(cfg.replicas) for k in range(len(batches[r][0]))]
        where = {(r, k): path(cfg.seed, step, k, cfg.stages, cfg.replicas, r, routing)
                 for r, k in seqs}
        acts: dict[tuple[int, int], torch.Tensor] = {}
        for r, (x, _) in enumerate(batches):
            h = rows[0][r].embed(x)
            acts.update({(r, k): h[k : k + 1] for k in range(len(x))})
        for s, row in enumerate(rows):  # each replica runs the sequences routed to it at once
            for q, stage in enumerate(row):
                here = [sk for sk in seqs if where[sk][s] == q]
                out = stage.run_blocks(torch.cat([acts[sk] for sk in here]))
                acts.update({sk: out[i : i + 1] for i, sk in enumerate(here)})
        total = torch.zeros(())
        for q, last in enumerate(rows[-1]):
            for r, (_, y) in enumerate(batches):  # the head tied to the sequence's origin
                group = [k for rr, k in seqs if rr == r and where[(r, k)][-1] == q]
                if not group:
                    continue
                last.borrow(rows[0][r].wte.weight)
                logits = last.head(torch.cat([acts[(r, k)] for k in group]))
                total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                y[group].reshape(-1), reduction="sum")
        x0 = batches[0][0]
        return total / (x0.shape[0] * x0.shape[1])  # tokens per replica

    def step(self, lr: float) -> None:
        for row, opts in zip(self.stages, self.optimizers, strict=True):
            for stage, opt in zip(row, opts, strict=True):
                clip_and_norm(stage, 1.0)
                for g in opt.param_groups:
                    g["lr"] = lr
                opt.step()
                opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Each replica pipeline r (fixed routing) on the same batches."""
        out = []
        for r in range(self.cfg.replicas):
            losses = []
            for x, y in batches:
                h = self.stages[0][r].embed(x)
                for row in self.stages:
                    h = row[r].run_blocks(h)
                last = self.stages[-1][r]
                last.borrow(self.stages[0][r].wte.weight)
                logits = last.head(h)
                losses.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                    y.reshape(-1))))
            out.append(sum(losses) / len(losses))
        return out


def run_one(method: str, routing: str, task: Task, cfg: PipeConfig,
            progress: Callable[[str, int], None] | None = None) -> RunResult:
    """Train one (method, routing) for cfg.steps steps; every run sees the same data."""
    torch.manual_seed(cfg.seed)
    grid = Grid(cfg)
    tc = _train_config(cfg)
    streams = [torch.Generator().manual_seed(cfg.seed * 1000 + 1 + r) for r in range(cfg.replicas)]
    eval_set = list(task.eval_batches(cfg.eval_batch, cfg.eval_batches,
                                      torch.Generator().manual_seed(cfg.seed + 3)))
    ids = [f"replica{r}" for r in range(cfg.replicas)]
    # Per stage: one NoLoCo per replica, or one DiLoCo (its replicas are identical after
    # each outer step, so they share φ and momentum).
    noloco = [[NoLoCo(_vector(st), NOLOCO) for st in row] for row in grid.stages] \
        if method == "noloco" else []
    diloco = [DiLoCo(_vector(row[0]), DILOCO) for row in grid.stages] \
        if method == "diloco" else []
    result = RunResult(method, routing)

    def record(step: int) -> None:
        losses = grid.evaluate(eval_set)
        result.eval_steps.append(step)
        result.val_mean.append(sum(losses) / len(losses))
        result.val_min.append(min(losses))
        result.val_max.append(max(losses))

    record(0)
    for step in range(1, cfg.steps + 1):  # bounded: cfg.steps steps
        started = time.perf_counter()
        batches = [task.train_batch(cfg.batch, g) for g in streams]
        grid.loss(step, batches, routing).backward()
        grid.step(lr_at(step - 1, tc))
        if method != "none" and step % cfg.h == 0:
            for s, row in enumerate(grid.stages):
                thetas = [_vector(st) for st in row]
                if method == "noloco":
                    for group in noloco_groups(step // cfg.h - 1, ids):
                        members = [ids.index(p) for p in group]
                        for i in members:
                            _load(row[i], noloco[s][i].outer_step(
                                thetas[i], [thetas[j] for j in members if j != i]))
                else:
                    phi = diloco[s].outer_step([diloco[s].pseudo_gradient(t) for t in thetas])
                    for st in row:
                        _load(st, phi)
        result.train_seconds += time.perf_counter() - started
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record(step)
        if progress is not None:
            progress(result.name, step)
    result.spread = [replica_spread([_vector(st) for st in row]) for row in grid.stages]
    return result


# ------------------------------------------------------------------------------------------
# Reporting


def _pct(x: float) -> str:
    text = f"{x:+.1%}"
    return "0.0%" if text in ("+0.0%", "-0.0%") else text


def table(results: Sequence[RunResult], cfg: PipeConfig) -> tuple[str, list[str], list[list[str]]]:
    end = cfg.marks[-1]
    headers = ["method, routing", *[f"@ {s}" for s in cfg.marks], f"min-max @ {end}",
               *[f"spread stage {s}" for s in range(cfg.stages)], "train s"]
    rows = []
    for res in results:
        i = res.eval_steps.index(end)
        rows.append([res.name, *[f"{res.val_at(s):.3f}" for s in cfg.marks],
                     f"{res.val_min[i]:.3f}-{res.val_max[i]:.3f}",
                     *[f"{x:.2e}" for x in res.spread], f"{res.train_seconds:.0f}"])
    return "validation loss, nats/byte (mean over the replica pipelines)", headers, rows


def findings(results: Sequence[RunResult], cfg: PipeConfig) -> str:
    """What the numbers say, worded from the numbers."""
    end = cfg.marks[-1]
    val = {(r.method, r.routing): r.val_at(end) for r in results}
    lines = []
    for routing in ROUTINGS:
        nol, dil, none = (val[(m, routing)] for m in METHODS)
        span = none - dil
        closed = f"; it closes {(none - nol) / span:.0%} of the gap between no " \
                 f"communication ({none:.3f}) and DiLoCo" if span > 0 else ""
        lines.append(f"- **{routing.capitalize()} routing**: at step {end} NoLoCo "
                     f"{nol:.3f}, DiLoCo {dil:.3f} (NoLoCo {_pct((nol - dil) / dil)}){closed}.")
    moves = ", ".join(f"{m} {_pct((val[(m, 'random')] - val[(m, 'fixed')]) / val[(m, 'fixed')])}"
                      for m in METHODS)
    lines.append(f"- **What random routing changes** (random against fixed, same method): "
                 f"{moves}. With fixed routing the {cfg.replicas} replica pipelines are "
                 f"independent models coupled only by the outer step; routing mixes every "
                 f"stage's replicas on every step.")
    spread = {(r.method, r.routing): sum(r.spread) / len(r.spread) for r in results}
    lines.append(f"- **Replica spread** at step {end} (mean over stages): no communication "
                 f"{spread[('none', 'random')]:.2e} with routing, "
                 f"{spread[('none', 'fixed')]:.2e} without; NoLoCo "
                 f"{spread[('noloco', 'random')]:.2e} and {spread[('noloco', 'fixed')]:.2e}; "
                 f"DiLoCo's replicas are identical after each outer step.")
    lines.append(f"- One seed, one run each, a {cfg.eval_batches * cfg.eval_batch}-window "
                 f"validation set; differences of a fraction of a percent may be noise.")
    return "\n".join(lines)


def plot(results: Sequence[RunResult], path_: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        ax.plot(res.eval_steps, res.val_mean, color=COLORS[res.method],
                linestyle="-" if res.routing == "random" else "--", label=res.name)
    low = min(min(r.val_mean) for r in results)
    high = max(r.val_mean[min(1, len(r.val_mean) - 1)] for r in results)
    ax.set_ylim(bottom=max(0.0, low - 0.1), top=high + 0.05)
    ax.set(xlabel="inner step", ylabel="validation loss (nats/byte)",
           title="2 stages x 4 replicas: routing on (solid) and off (dashed)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path_.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path_, dpi=100)
    plt.close(fig)
    return True


def _section(results: Sequence[RunResult], cfg: PipeConfig, quick: bool, n_params: int,
             total_s: float, has_plot: bool) -> str:
    title, headers, rows = table(results, cfg)
    flag = " --quick" if quick else ""
    setup = (
        f"{cfg.stages} stages x {cfg.replicas} replicas of a byte-level GPT (d_model "
        f"{cfg.d_model}, {cfg.n_layers} layers split {cfg.layers}, {cfg.n_heads} heads, "
        f"context {cfg.context}, {n_params:,} parameters) on the stdlib corpus, in one "
        f"process (testnet/bench/pipeconv.py). Each stage replica has its own AdamW (lr "
        f"{cfg.lr:g}, {cfg.warmup_steps} warm-up steps, cosine to lr/10, weight decay on "
        f"matrices) and clips its own gradient to 1. Each first-stage replica reads its own "
        f"stream, {cfg.batch} sequences per step, every sequence its own micro-batch "
        f"(spec §1c); random routing sends each to a replica of the next stage by "
        f"`node.ml.pipeline.path`, fixed routing keeps it on its replica's stages. The head is "
        f"tied to the embedding of the sequence's first-stage replica. Every H = {cfg.h} "
        f"steps each stage's replicas take the outer step: NoLoCo in random pairs, η "
        f"{NOLOCO.outer_lr}, heavy-ball μ {NOLOCO.momentum}; DiLoCo over all "
        f"{cfg.replicas}, Nesterov, η {DILOCO.outer_lr}, μ {DILOCO.momentum}; none. "
        f"Validation with fixed routing on {cfg.eval_batches}x{cfg.eval_batch} fixed "
        f"windows, the mean over the {cfg.replicas} replica pipelines (min-max across them). "
        f"Spread: sqrt(mean over parameters of the variance across a stage's replicas).")
    image = "![pipeline convergence](pipeconv.png)" if has_plot else \
        "(No plot: matplotlib is not installed; `pip install -e '.[bench]'`.)"
    rerun = (f"Rerun: `node bench convergence --pipeline` ({FULL.steps} steps) or with "
             f"`--quick` ({QUICK.steps} steps, H {QUICK.h}); both rewrite this section and "
             f"docs/pipeconv.png.")
    return "\n\n".join([
        "## Training: NoLoCo with pipelines",
        f"`node bench convergence --pipeline{flag}` on {machine()}; {total_s:.0f} s in all.",
        setup, f"**{title}**\n\n{md_table(headers, rows)}", image, findings(results, cfg),
        rerun])


def run(cfg: PipeConfig, doc_path: Path, quick: bool = False,
        console: Console | None = None) -> list[RunResult]:
    console = console or Console()
    torch.set_num_threads(1)
    started = time.perf_counter()
    task = build_bench_task(cfg)
    results = []
    with console.status("") as status:

        def progress(name: str, step: int) -> None:
            if step % 10 == 0:
                status.update(f"{name}: step {step}/{cfg.steps}")

        for method, routing in RUNS:
            res = run_one(method, routing, task, cfg, progress)
            results.append(res)
            console.print(f"  {res.name}: {res.train_seconds:.0f} s training, "
                          f"val {res.val_mean[-1]:.3f}")
    print_tables(console, [table(results, cfg)])
    has_plot = plot(results, doc_path.parent / "pipeconv.png")
    total = time.perf_counter() - started
    n_params = sum(p.numel() for row in Grid(cfg).stages for p in row[0].parameters())
    write_section("pipeconv", _section(results, cfg, quick, n_params, total, has_plot), doc_path)
    console.print(findings(results, cfg))
    console.print(f"wrote {doc_path}" + (" and pipeconv.png" if has_plot else "")
                  + f"; {total:.0f} s in all")
    return results


def main(quick: bool = False, doc_path: Path | None = None) -> list[RunResult]:
    """`node bench convergence --pipeline [--quick]`."""
    return run(QUICK if quick else FULL, DOC if doc_path is None else Path(doc_path), quick=quick)
