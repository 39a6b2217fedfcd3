"""Convergence at equal compute: NoLoCo vs DiLoCo vs no communication vs synchronous.

    node bench convergence [--quick]

Eight replicas of a small byte-level GPT on the stdlib corpus, simulated in one process
with the real inner loop (node/ml/trainer) and outer optimizers (node/ml/optim); no network, so
the numbers isolate the algorithms (issue 3; spec section 1, "small-scale reproduction").

Methods, all with the same inner AdamW settings, schedule, number of inner steps and
samples:

- noloco: every H inner steps, pairs from `noloco_groups(round, peers)`, each member takes
  `NoLoCo.outer_step` (η 0.7, heavy-ball μ 0.5) with its partner's θ;
- diloco: every H inner steps, the mean of all 8 pseudo-gradients, Nesterov outer step
  (η 0.7, μ 0.9; OpenDiLoCo's variant, spec 0d);
- noloco-all: NoLoCo's update with all 8 replicas in one group, which is DiLoCo with
  heavy-ball μ 0.5 (spec 1c, "reduction to DiLoCo"): the diagnostic that separates what
  pairing costs (noloco vs noloco-all) from what the outer optimizer costs (noloco-all vs
  diloco);
- none: 8 independent trainers that never communicate;
- sync: one model whose batch is the 8 replicas' batches together (8 x 8 = 64), i.e.
  synchronous data parallelism with a gradient all-reduce on every step.

Every replica starts from the same weights (the trainer draws them from `seed` alone) and
reads its own data stream (`TrainConfig.replica`). Every model is scored by one evaluator
on the same fixed validation batches (`Trainer.evaluate()` draws its batches with the
trainer's own batch size, which differs for the sync model). Replica spread is
sqrt(mean over parameters of the variance across replicas), population variance, the
`eval_weight_variance` of the NoLoCo code; it is recorded at every outer boundary both
before the outer step (the θ that are exchanged) and after it (the models as they stand).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Protocol

import torch
from rich.console import Console

from node.ml.optim import DiLoCo, DiLoCoConfig, NoLoCo, NoLoCoConfig, noloco_groups
from node.ml.trainer import TaskConfig, TrainConfig, Trainer, TrainingDiverged, build_task
from node.ml.trainer.tasks import Task
from testnet.bench.report import DOC, machine, md_table, print_tables, pyplot, write_section

METHODS = ("noloco", "diloco", "noloco-all", "none", "sync")
NOLOCO = NoLoCoConfig(outer_lr=0.7, momentum=0.5)
DILOCO = DiLoCoConfig(outer_lr=0.7, momentum=0.9, nesterov=True)
COLORS = {
    "noloco": "tab:blue",
    "diloco": "tab:orange",
    "noloco-all": "tab:purple",
    "none": "tab:red",
    "sync": "tab:green",
}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    replicas: int = 8
    steps: int = 700  # inner steps per replica (the sync model takes as many, 8x the batch)
    h: int = 50  # inner steps per outer round (spec 1d: H 50 for NoLoCo)
    eval_every: int = 50  # validation loss every this many steps (and at step 0 and the end)
    marks: tuple[int, ...] = (100, 300, 500, 700)  # steps shown in the table
    batch: int = 8  # per replica
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    context: int = 64
    max_bytes: int = 4_000_000
    lr: float = 2e-3
    warmup_steps: int = 100
    eval_batch: int = 64  # the shared evaluator: eval_batches x eval_batch windows
    eval_batches: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 2 or self.steps < 1 or self.h < 1 or self.eval_every < 1:
            raise ValueError(f"bad benchmark sizes: {self}")
        for mark in self.marks:
            if not (0 < mark <= self.steps and (mark % self.eval_every == 0 or mark == self.steps)):
                raise ValueError(f"mark {mark} is not an evaluation step of {self}")
            if mark % self.h:
                raise ValueError(f"mark {mark} is not an outer boundary (H {self.h})")


FULL = BenchConfig()
QUICK = BenchConfig(
    steps=120, h=20, eval_every=40, marks=(40, 80, 120), max_bytes=1_000_000, warmup_steps=20
)


@dataclass(slots=True)
class MethodResult:
    method: str
    n_models: int
    eval_steps: list[int] = field(default_factory=list)
    val_mean: list[float] = field(default_factory=list)
    val_min: list[float] = field(default_factory=list)
    val_max: list[float] = field(default_factory=list)
    spread_steps: list[int] = field(default_factory=list)  # 0 and every outer boundary
    spread_pre: list[float] = field(default_factory=list)  # before the outer step
    spread_post: list[float] = field(default_factory=list)  # after it (= pre for none)
    train_seconds: float = 0.0  # inner + outer steps, evaluation excluded
    eval_seconds: float = 0.0
    diverged_at: int | None = None

    def val_at(self, step: int) -> tuple[float, float, float] | None:
        if step not in self.eval_steps:
            return None
        i = self.eval_steps.index(step)
        return self.val_mean[i], self.val_min[i], self.val_max[i]

    def spread_at(self, step: int) -> tuple[float, float] | None:
        if self.n_models < 2 or step not in self.spread_steps:
            return None
        i = self.spread_steps.index(step)
        return self.spread_pre[i], self.spread_post[i]


def replica_spread(vectors: Sequence[torch.Tensor]) -> float:
    """sqrt(mean over parameters of the population variance across replicas)."""
    if len(vectors) < 2:
        return 0.0
    stacked = torch.stack(list(vectors))
    return float(stacked.var(dim=0, unbiased=False).mean().sqrt())


def build_bench_task(cfg: BenchConfig) -> Task:
    return build_task(
        TaskConfig(
            name="bytes-gpt",
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            context=cfg.context,
            max_bytes=cfg.max_bytes,
        )
    )


def _train_config(cfg: BenchConfig, batch: int, replica: int) -> TrainConfig:
    return TrainConfig(
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        max_steps=cfg.steps,
        batch_size=batch,
        eval_every=0,
        device="cpu",
        threads=1,
        seed=cfg.seed,
        replica=replica,
    )


class _EvalSettings(Protocol):
    eval_batch: int
    eval_batches: int
    seed: int


class Evaluator:
    """Scores any weight vector on the same fixed validation batches (this bench's and
    testnet/bench/compression.py's)."""

    def __init__(self, task: Task, cfg: _EvalSettings) -> None:
        config = TrainConfig(
            batch_size=cfg.eval_batch,
            eval_batches=cfg.eval_batches,
            eval_every=0,
            device="cpu",
            threads=1,
            seed=cfg.seed,
        )
        self.trainer = Trainer(task, config)

    def losses(self, vectors: Sequence[torch.Tensor]) -> list[float]:
        # Identical replicas (step 0, DiLoCo after its outer step) are scored once.
        if all(torch.equal(v, vectors[0]) for v in vectors[1:]):
            self.trainer.set_parameters_vector(vectors[0])
            return [self.trainer.evaluate()] * len(vectors)
        out = []
        for v in vectors:
            self.trainer.set_parameters_vector(v)
            out.append(self.trainer.evaluate())
        return out


def run_method(
    method: str,
    task: Task,
    cfg: BenchConfig,
    evaluator: Evaluator,
    progress: Callable[[str, int], None] | None = None,
) -> MethodResult:
    """Train one method for `cfg.steps` inner steps, recording loss and spread."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    n = 1 if method == "sync" else cfg.replicas
    batch = cfg.batch * cfg.replicas if method == "sync" else cfg.batch
    trainers = [Trainer(task, _train_config(cfg, batch, i)) for i in range(n)]
    ids = [f"peer{i}" for i in range(n)]
    init = trainers[0].parameters_vector()
    noloco = [NoLoCo(init, NOLOCO) for _ in trainers] if method.startswith("noloco") else []
    diloco = DiLoCo(init, DILOCO) if method == "diloco" else None
    result = MethodResult(method, n)

    def record(step: int, pre: float | None = None) -> None:
        vectors = [t.parameters_vector() for t in trainers]
        if step == 0 or step % cfg.h == 0:
            post = replica_spread(vectors)
            result.spread_steps.append(step)
            result.spread_pre.append(post if pre is None else pre)
            result.spread_post.append(post)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            started = time.perf_counter()
            losses = evaluator.losses(vectors)
            result.eval_seconds += time.perf_counter() - started
            result.eval_steps.append(step)
            result.val_mean.append(sum(losses) / len(losses))
            result.val_min.append(min(losses))
            result.val_max.append(max(losses))

    record(0)
    for step in range(1, cfg.steps + 1):  # bounded: cfg.steps inner steps
        started = time.perf_counter()
        try:
            for t in trainers:
                t.step()
        except TrainingDiverged:
            result.diverged_at = step
            break
        pre = None
        if step % cfg.h == 0 and method != "none" and method != "sync":
            thetas = [t.parameters_vector() for t in trainers]
            pre = replica_spread(thetas)
            if noloco:
                rnd = step // cfg.h - 1
                groups = [ids] if method == "noloco-all" else noloco_groups(rnd, ids)
                for group in groups:
                    members = [ids.index(p) for p in group]
                    for i in members:
                        phi = noloco[i].outer_step(
                            thetas[i], [thetas[j] for j in members if j != i]
                        )
                        trainers[i].set_parameters_vector(phi)
            else:
                assert diloco is not None
                phi = diloco.outer_step([diloco.pseudo_gradient(th) for th in thetas])
                for t in trainers:
                    t.set_parameters_vector(phi)
        result.train_seconds += time.perf_counter() - started
        record(step, pre)
        if progress is not None:
            progress(method, step)
    return result


# ------------------------------------------------------------------------------------------
# Reporting


def plot(results: dict[str, MethodResult], cfg: BenchConfig, path: Path) -> bool:
    """The two-panel PNG; False (and nothing written) when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, res in results.items():
        color = COLORS[method]
        label = method if res.n_models == 1 else f"{method} (mean; band = min-max)"
        ax1.plot(res.eval_steps, res.val_mean, color=color, label=label)
        if res.n_models > 1:
            ax1.fill_between(res.eval_steps, res.val_min, res.val_max, color=color, alpha=0.15)
        if res.n_models < 2:
            continue
        steps = res.spread_steps[1:]  # step 0: all replicas identical, log scale can't show 0
        if method == "noloco-all":  # ~1e-9 after each outer step (rounding), ~DiLoCo before
            continue
        if method != "diloco":  # DiLoCo's replicas are identical after each outer step
            ax2.plot(steps, res.spread_post[1:], color=color, label=f"{method}")
        if method != "none":
            ax2.plot(
                steps,
                res.spread_pre[1:],
                color=color,
                linestyle="--",
                label=f"{method}, before the outer step",
            )
    # Start the y axis below the best curve and at the first evaluation after step 0: the
    # untrained ln(256) = 5.5 would squash the differences that matter.
    low = min(min(r.val_mean) for r in results.values())
    high = max(r.val_mean[min(1, len(r.val_mean) - 1)] for r in results.values())
    ax1.set_ylim(bottom=max(0.0, low - 0.1), top=high + 0.05)
    ax1.set(
        xlabel="inner step",
        ylabel="validation loss (nats/byte)",
        title=f"validation loss, {cfg.replicas} replicas",
    )
    ax2.set(
        xlabel="inner step",
        ylabel="replica spread",
        yscale="log",
        title=f"weight spread across replicas (outer step every {cfg.h})",
    )
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


Table_ = tuple[str, list[str], list[list[str]]]  # title, headers, rows


def _tables(results: dict[str, MethodResult], cfg: BenchConfig) -> list[Table_]:
    """Validation loss and replica spread at the marks (two tables, to fit a terminal)."""
    marks = list(cfg.marks)
    val_headers = ["method", *[f"@ {s}" for s in marks], f"min-max @ {marks[-1]}", "train s"]
    spread_headers = ["method", *[f"@ {s}" for s in marks], f"before outer step @ {marks[-1]}"]
    val_rows, spread_rows = [], []
    for method, res in results.items():
        name = method + (f" (diverged at step {res.diverged_at})" if res.diverged_at else "")
        vals = [res.val_at(s) for s in marks]
        last = vals[-1]
        val_rows.append(
            [name]
            + [f"{v[0]:.3f}" if v else "-" for v in vals]
            + [f"{last[1]:.3f}-{last[2]:.3f}" if last and res.n_models > 1 else "-"]
            + [f"{res.train_seconds:.0f}"]
        )
        if res.n_models > 1:
            spreads = [res.spread_at(s) for s in marks]
            spread_rows.append(
                [name]
                + [f"{sp[1]:.2e}" if sp else "-" for sp in spreads]
                + [f"{spreads[-1][0]:.2e}" if spreads[-1] else "-"]
            )
    return [
        ("validation loss, nats/byte (mean over replicas)", val_headers, val_rows),
        ("replica spread (after the outer step)", spread_headers, spread_rows),
    ]


def _pct(x: float) -> str:
    """A signed percentage, without the "-0.0%" of a tiny negative number."""
    text = f"{x:+.1%}"
    return "0.0%" if text in ("+0.0%", "-0.0%") else text


def _findings(results: dict[str, MethodResult], cfg: BenchConfig) -> str:
    """What the numbers say, worded from the numbers (not written in advance)."""
    end, first = cfg.marks[-1], cfg.marks[0]
    final = {m: r.val_at(end) for m, r in results.items()}
    if any(v is None for v in final.values()):
        return "At least one method diverged; see the table."
    val = {m: v[0] for m, v in final.items() if v is not None}
    lines = []
    gap = (val["noloco"] - val["diloco"]) / val["diloco"]
    verdict = next(
        (f"within {limit:.0%}" for limit in (0.01, 0.02, 0.05) if abs(gap) <= limit),
        "more than 5% apart",
    )
    span = val["none"] - val["diloco"]
    closed = (val["none"] - val["noloco"]) / span if span > 0 else float("nan")
    lines.append(
        f"- **NoLoCo vs DiLoCo**: at step {end} NoLoCo's mean validation loss is "
        f"{val['noloco']:.3f} against DiLoCo's {val['diloco']:.3f} ({_pct(gap)}, {verdict}). "
        + (
            f"Of the gap between no communication ({val['none']:.3f}) and DiLoCo, NoLoCo "
            f"closes {closed:.0%}."
            if span > 0
            else f"No communication reaches {val['none']:.3f}, not worse than DiLoCo."
        )
    )
    pairing = (val["noloco"] - val["noloco-all"]) / val["noloco-all"]
    outer = (val["noloco-all"] - val["diloco"]) / val["diloco"]
    lines.append(
        f"- **Where the gap comes from**: NoLoCo's update with all {cfg.replicas} replicas in "
        f"one group (noloco-all, i.e. DiLoCo with heavy-ball μ {NOLOCO.momentum}) reaches "
        f"{val['noloco-all']:.3f}. Averaging in random pairs instead of over everyone "
        f"costs {_pct(pairing)}; the outer optimizer (heavy-ball μ {NOLOCO.momentum} instead "
        f"of Nesterov μ {DILOCO.momentum}, same η) accounts for {_pct(outer)}."
    )
    rel = {m: (val[m] - val["sync"]) / val["sync"] for m in ("noloco", "diloco", "none")}
    lines.append(
        f"- **Against synchronous data parallelism** ({val['sync']:.3f}, the same "
        f"samples with an all-reduce on every step): NoLoCo {_pct(rel['noloco'])}, "
        f"DiLoCo {_pct(rel['diloco'])}, no communication {_pct(rel['none'])}."
        + (
            f" At this scale (batch {cfg.batch} x {cfg.context} bytes per replica step) "
            f"averaging only every {cfg.h} steps loses much of the benefit of the "
            f"{cfg.replicas}x larger batch."
            if min(rel.values()) > 0.05
            else ""
        )
    )
    none, nol = results["none"], results["noloco"]
    none_first, none_end = none.spread_at(first), none.spread_at(end)
    nol_first, nol_end = nol.spread_at(first), nol.spread_at(end)
    dil_end = results["diloco"].spread_at(end)
    if none_first and none_end and nol_first and nol_end and dil_end:
        none_curve = none.spread_post[1:]
        monotone = all(b >= a for a, b in pairwise(none_curve))
        grows = (
            ("grows steadily" if monotone else "grows")
            if none_end[1] > none_first[1]
            else "does not grow"
        )
        peak = max(range(1, len(nol.spread_post)), key=lambda i: nol.spread_post[i])
        ratio_first = none_first[1] / max(nol_first[1], 1e-30)
        ratio_end = none_end[1] / max(nol_end[1], 1e-30)
        bounded = nol_end[1] <= nol.spread_post[peak] and ratio_end >= ratio_first
        lines.append(
            f"- **Replica spread**: without communication it {grows}, from "
            f"{none_first[1]:.2e} at step {first} to {none_end[1]:.2e} at step {end}. "
            f"NoLoCo's (after each outer step) peaks at {nol.spread_post[peak]:.2e} "
            f"(step {nol.spread_steps[peak]}) and is {nol_end[1]:.2e} at step {end}: "
            f"{ratio_first:.1f}x below no communication at step {first}, {ratio_end:.1f}x at "
            f"step {end}. "
            + (
                "So it stays bounded while the uncoupled replicas drift apart."
                if bounded
                else "So it is not (yet) clearly bounded at this length of run."
            )
            + f" Just before an outer step the replicas have drifted to {nol_end[0]:.2e} "
            f"(NoLoCo) and {dil_end[0]:.2e} (DiLoCo, whose replicas are identical again "
            f"after it)."
        )
    lines.append(
        f"- One seed, one run of each method, a {cfg.eval_batches * cfg.eval_batch}-"
        f"window validation set shared by all; run-to-run variation was not measured, "
        f"so differences of a fraction of a percent may be noise."
    )
    return "\n".join(lines)


def _section(
    results: dict[str, MethodResult],
    cfg: BenchConfig,
    quick: bool,
    n_params: int,
    step_ms: dict[str, float],
    total_s: float,
    has_plot: bool,
) -> str:
    tables = "\n\n".join(
        f"**{title}**\n\n{md_table(headers, rows)}"
        for title, headers, rows in _tables(results, cfg)
    )
    flag = " --quick" if quick else ""
    setup = (
        f"{cfg.replicas} replicas of a byte-level GPT (d_model {cfg.d_model}, "
        f"{cfg.n_layers} layers, {cfg.n_heads} heads, context {cfg.context}, "
        f"{n_params:,} parameters) on the stdlib corpus ({cfg.max_bytes / 1e6:g} MB), "
        f"simulated in one process with the real trainer and outer optimizers, no network. "
        f"Equal compute: every method takes {cfg.steps} inner steps of batch {cfg.batch} per "
        f"replica (AdamW, lr {cfg.lr:g}, {cfg.warmup_steps} warm-up steps, cosine to lr/10); "
        f"the sync baseline is one model with batch {cfg.batch * cfg.replicas}. Outer step "
        f"every H = {cfg.h} inner steps: NoLoCo in random pairs (`noloco_groups`), "
        f"η {NOLOCO.outer_lr}, heavy-ball μ {NOLOCO.momentum}; DiLoCo all-reduces the "
        f"{cfg.replicas} pseudo-gradients, Nesterov, η {DILOCO.outer_lr}, μ {DILOCO.momentum} "
        f"(OpenDiLoCo's baseline, not the gensyn repo's heavy-ball μ 0.3); noloco-all is "
        f"NoLoCo's update with all {cfg.replicas} replicas in one group (= DiLoCo with "
        f"heavy-ball μ {NOLOCO.momentum}), a diagnostic. Same initial "
        f"weights on every replica, a different data stream each. Validation loss in "
        f"nats/byte on the same {cfg.eval_batches}x{cfg.eval_batch} fixed windows for every "
        f"model (mean over replicas; min-max across them). Spread = sqrt(mean over "
        f"parameters of the variance across replicas), after the outer step unless said "
        f"otherwise. Measured step time (1 thread): {step_ms['replica']:.1f} ms per replica "
        f"step (batch {cfg.batch}), {step_ms['sync']:.1f} ms per sync step "
        f"(batch {cfg.batch * cfg.replicas}); `train s` excludes evaluation."
    )
    image = (
        "![convergence](convergence.png)"
        if has_plot
        else "(No plot: matplotlib is not installed; `pip install -e '.[bench]'`.)"
    )
    rerun = (
        f"Rerun: `node bench convergence` ({FULL.steps} steps, ~6 min on 2 cores) or "
        f"`node bench convergence --quick` ({QUICK.steps} steps, H {QUICK.h}, ~1 min); both "
        f"rewrite this section and docs/convergence.png."
    )
    return "\n\n".join(
        [
            "## Training: convergence",
            f"`node bench convergence{flag}` on {machine()}; {total_s:.0f} s in all.",
            setup,
            tables,
            image,
            "What the numbers show:\n\n" + _findings(results, cfg),
            rerun,
        ]
    )


def _step_times(task: Task, cfg: BenchConfig) -> dict[str, float]:
    """Median wall time of one inner step, per replica and for the sync model (ms)."""
    out = {}
    for name, batch in (("replica", cfg.batch), ("sync", cfg.batch * cfg.replicas)):
        trainer = Trainer(task, _train_config(cfg, batch, 0))
        times = []
        for i in range(13):  # 3 warm-up steps, then 10 timed
            started = time.perf_counter()
            trainer.step()
            if i >= 3:
                times.append(time.perf_counter() - started)
        out[name] = sorted(times)[len(times) // 2] * 1e3
    return out


def run(
    cfg: BenchConfig, doc_path: Path, quick: bool = False, console: Console | None = None
) -> dict[str, MethodResult]:
    """Run every method, print the table, write the PNG and the doc section."""
    console = console or Console()
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    task = build_bench_task(cfg)
    step_ms = _step_times(task, cfg)
    estimate = cfg.steps * (cfg.replicas * 3 * step_ms["replica"] + step_ms["sync"]) / 1e3
    console.print(
        f"convergence: {cfg.replicas} replicas x {cfg.steps} steps, H {cfg.h}; "
        f"step {step_ms['replica']:.1f} ms (replica), {step_ms['sync']:.1f} ms (sync);"
        f" about {estimate:.0f} s of training"
    )
    evaluator = Evaluator(task, cfg)
    results: dict[str, MethodResult] = {}
    with console.status("") as status:

        def progress(method: str, step: int) -> None:
            if step % 10 == 0:
                status.update(f"{method}: step {step}/{cfg.steps}")

        for method in METHODS:
            results[method] = run_method(method, task, cfg, evaluator, progress)
            res = results[method]
            console.print(
                f"  {method}: {res.train_seconds:.0f} s training, "
                f"{res.eval_seconds:.0f} s evaluating"
            )
    print_tables(console, _tables(results, cfg))
    has_plot = plot(results, cfg, doc_path.parent / "convergence.png")
    total = time.perf_counter() - started
    n_params = evaluator.trainer.n_params
    write_section(
        "convergence", _section(results, cfg, quick, n_params, step_ms, total, has_plot), doc_path
    )
    console.print(_findings(results, cfg))
    console.print(
        f"wrote {doc_path}"
        + (" and convergence.png" if has_plot else " (no plot: matplotlib is not installed)")
        + f"; {total:.0f} s in all"
    )
    return results


def main(quick: bool = False, doc_path: Path | None = None) -> dict[str, MethodResult]:
    """`node bench convergence [--quick]`: the full run takes ~6 min on 2 cores, quick ~1."""
    return run(QUICK if quick else FULL, DOC if doc_path is None else Path(doc_path), quick=quick)


if __name__ == "__main__":  # pragma: no cover
    import sys

    main(quick="--quick" in sys.argv[1:])
