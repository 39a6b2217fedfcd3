"""Compressed exchange at equal compute: bf16 NoLoCo and DiLoCo vs their "topk" versions.

    node bench convergence --compression [--quick]

8 and 32 replicas of a tiny byte-level GPT in one process, the real trainer (node/ml/trainer)
and outer optimizers (node/ml/optim), no network (as `node bench convergence`). Methods:

- noloco: NoLoCo in random pairs (η 0.7, heavy-ball μ 0.5), θ exchanged in bf16 (the
  default codec; the bench rounds θ to bf16 as the wire would);
- noloco-topk: `CompressedNoLoCo`, the "topk" frame (protocols/sparse.py): top-k of the
  error-fed θ − φ per chunk of 4096, 2-bit values, the anchor's 4-bit modulo codes at the
  sent indices, the unsent residual kept in the model (keep_residual); every frame goes
  through `sparse.encode` and `sparse.decode`;
- diloco: DiLoCo over all replicas (Nesterov, η 0.7, μ 0.9), pseudo-gradients in bf16;
- diloco-topk: `CompressedDiLoCo` with SparseLoCo's rule (EF decay 0.95, no outer momentum,
  η 1), the same frames without anchor codes: the SparseLoCo baseline;
- none: no communication (the floor any exchange must beat; 0 bytes), at the smallest
  replica count only (independent replicas: the mean does not depend on their number).

Bytes per outer step: what one peer sends per outer step, its encoded payload (frames'
actual lengths; bf16: 2 bytes a value). A pair exchange sends it once each way; an
all-reduce of n workers moves ~2(n-1)/n of it per worker (ring), an all-gather of frames
(SparseLoCo's) sends it to each of n - 1 others (or once to a bucket they read).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from rich.console import Console

from node.ml.optim import DiLoCo, NoLoCo, noloco_groups
from node.ml.optim.compress import CompressedDiLoCo, CompressedNoLoCo, TopKConfig
from node.ml.trainer import TaskConfig, TrainConfig, Trainer, TrainingDiverged, build_task
from node.ml.trainer.tasks import Task
from protocols import codecs, sparse
from testnet.bench.convergence import DILOCO, NOLOCO, Evaluator, replica_spread
from testnet.bench.report import DOC, machine, md_table, print_tables, pyplot, write_section

METHODS = ("noloco", "noloco-topk", "diloco", "diloco-topk", "none")
COLORS = {"noloco": "tab:blue", "noloco-topk": "tab:cyan", "diloco": "tab:orange",
          "diloco-topk": "tab:red", "none": "tab:gray"}
TOPK_NOLOCO = TopKConfig(chunk=4096, density=1 / 64, value_bits=2, ef_decay=1.0,
                         anchor_bits=2, anchor_range=4.0, keep_residual=1.0)
TOPK_DILOCO = TopKConfig(chunk=4096, density=1 / 64, value_bits=2, ef_decay=0.95,
                         anchor_bits=0, keep_residual=0.0)  # SparseLoCo's rule
BOUNDS = sparse.Bounds(max_density=1 / 16, max_value_bits=4, max_anchor_bits=8)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    replicas: tuple[int, ...] = (8, 32)
    steps: int = 700
    h: int = 50
    marks: tuple[int, ...] = (100, 300, 500, 700)
    batch: int = 8
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 4
    context: int = 32
    max_bytes: int = 2_000_000
    lr: float = 2e-3
    warmup_steps: int = 100
    eval_batch: int = 64
    eval_batches: int = 3
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(replicas=(4, 8), steps=120, h=20, marks=(40, 80, 120), warmup_steps=20,
                    max_bytes=1_000_000)


@dataclass(slots=True)
class Result:
    method: str
    replicas: int
    val: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # mean, min, max
    bytes_per_step: float = 0.0  # mean over peers and outer steps
    spread_end: float = 0.0
    anchor_wraps: int = 0  # anchor codes decoded to the wrong grid point (noloco-topk)
    anchor_codes: int = 0
    seconds: float = 0.0
    diverged_at: int | None = None


def methods(cfg: BenchConfig, n: int) -> tuple[str, ...]:
    """The methods run with n replicas: "none" only at the smallest n (its replicas never
    meet, so the mean over them does not depend on how many there are)."""
    return METHODS if n == min(cfg.replicas) else METHODS[:-1]


def build_bench_task(cfg: BenchConfig) -> Task:
    return build_task(TaskConfig(name="bytes-gpt", d_model=cfg.d_model, n_layers=cfg.n_layers,
                                 n_heads=cfg.n_heads, context=cfg.context,
                                 max_bytes=cfg.max_bytes))


def _train_config(cfg: BenchConfig, replica: int) -> TrainConfig:
    return TrainConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.steps,
                       batch_size=cfg.batch, eval_every=0, device="cpu", threads=1,
                       seed=cfg.seed, replica=replica)


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).to(torch.float32)


def _wire(frame: sparse.Frame) -> tuple[sparse.Frame, int]:
    """The frame as the receiver gets it: encoded, then decoded under the run's bounds."""
    payload = sparse.encode(frame)
    return sparse.decode(payload, frame.numel, BOUNDS), len(payload)


def run_method(method: str, n: int, task: Task, cfg: BenchConfig, evaluator: Evaluator,
               topk_noloco: TopKConfig = TOPK_NOLOCO,
               topk_diloco: TopKConfig = TOPK_DILOCO) -> Result:
    """Train `n` replicas with `method` for cfg.steps inner steps (bounded), scoring at marks."""
    trainers = [Trainer(task, _train_config(cfg, i)) for i in range(n)]
    ids = [f"peer{i}" for i in range(n)]
    init = trainers[0].parameters_vector()
    numel = init.numel()
    res = Result(method, n)
    bf16_bytes = codecs.max_encoded_size("bf16", numel)
    sent = 0
    outer_steps = 0
    nol = [NoLoCo(init, NOLOCO) for _ in range(n)] if method == "noloco" else []
    nolc = [CompressedNoLoCo(init, NOLOCO, topk_noloco) for _ in range(n)] \
        if method == "noloco-topk" else []
    dil = DiLoCo(init, DILOCO) if method == "diloco" else None
    dilc = [CompressedDiLoCo(init, topk=topk_diloco) for _ in range(n)] \
        if method == "diloco-topk" else []
    started = time.perf_counter()
    for step in range(1, cfg.steps + 1):  # bounded: cfg.steps inner steps
        try:
            for t in trainers:
                t.step()
        except TrainingDiverged:
            res.diverged_at = step
            break
        if step % cfg.h == 0 and method != "none":
            thetas = [t.parameters_vector() for t in trainers]
            rnd = step // cfg.h - 1
            outer_steps += 1
            if method == "noloco":
                wire = [_bf16(th) for th in thetas]
                sent += n * bf16_bytes
                for group in noloco_groups(rnd, ids):
                    members = [ids.index(p) for p in group]
                    for i in members:
                        phi = nol[i].outer_step(thetas[i], [wire[j] for j in members if j != i])
                        trainers[i].set_parameters_vector(phi)
            elif method == "noloco-topk":
                own = [opt.prepare(th) for opt, th in zip(nolc, thetas, strict=True)]
                wired = [_wire(f) for f in own]
                sent += sum(size for _, size in wired)
                for group in noloco_groups(rnd, ids):
                    members = [ids.index(p) for p in group]
                    for i in members:
                        got = [wired[j][0] for j in members if j != i]
                        for j, f in zip([j for j in members if j != i], got, strict=True):
                            _count_wraps(res, f, nolc[j].phi, nolc[i].phi)
                        phi = nolc[i].outer_step(own[i], got)
                        trainers[i].set_parameters_vector(phi)
            elif method == "diloco":
                assert dil is not None
                sent += n * bf16_bytes
                phi = dil.outer_step([_bf16(dil.pseudo_gradient(th)) for th in thetas])
                for t in trainers:
                    t.set_parameters_vector(phi)
            elif method == "diloco-topk":
                wired = [_wire(opt.prepare(th)) for opt, th in zip(dilc, thetas, strict=True)]
                sent += sum(size for _, size in wired)
                frames = [f for f, _ in wired]
                for opt, t in zip(dilc, trainers, strict=True):
                    t.set_parameters_vector(opt.outer_step(frames))
        if step in cfg.marks:
            vectors = [t.parameters_vector() for t in trainers]
            losses = evaluator.losses(vectors)
            res.val[step] = (sum(losses) / n, min(losses), max(losses))
            if step == cfg.marks[-1]:
                res.spread_end = replica_spread(vectors)
    res.seconds = time.perf_counter() - started
    res.bytes_per_step = sent / max(1, outer_steps * n)  # none: 0
    return res


def _count_wraps(res: Result, frame: sparse.Frame, sender_phi: torch.Tensor,
                 receiver_phi: torch.Tensor) -> None:
    """Anchor codes whose true difference lay outside what the modulo grid resolves."""
    if not frame.anchor_bits or frame.eps is None:
        return
    starts = sparse._chunk_starts(frame.numel, frame.chunk, frame.k)
    eps = torch.from_numpy(frame.eps).repeat_interleave(torch.from_numpy(starts).diff())
    diff = (sender_phi[frame.indices] - receiver_phi[frame.indices]).abs()
    limit = eps * ((1 << (frame.anchor_bits - 1)) - 0.5)
    live = eps > 0
    res.anchor_codes += int(live.sum())
    res.anchor_wraps += int(((diff > limit) & live).sum())


# ------------------------------------------------------------------------------------------


Table = tuple[str, list[str], list[list[str]]]


def _tables(results: list[Result], cfg: BenchConfig) -> list[Table]:
    headers = ["replicas", "method", "bytes / outer step", "vs bf16",
               *[f"val @ {s}" for s in cfg.marks], f"vs noloco @ {cfg.marks[-1]}", "train s"]
    rows = []
    for n in cfg.replicas:
        group = [r for r in results if r.replicas == n]
        base = next(r for r in group if r.method == "noloco")
        for r in group:
            end = r.val.get(cfg.marks[-1])
            gap = (end[0] - base.val[cfg.marks[-1]][0]) / base.val[cfg.marks[-1]][0] \
                if end and cfg.marks[-1] in base.val else float("nan")
            rows.append([str(n), r.method + (f" (diverged at {r.diverged_at})"
                                              if r.diverged_at else ""),
                         f"{r.bytes_per_step:,.0f}",
                         f"{base.bytes_per_step / r.bytes_per_step:.1f}x"
                         if r.bytes_per_step else "-",
                         *[f"{r.val[s][0]:.3f}" if s in r.val else "-" for s in cfg.marks],
                         f"{gap:+.2%}", f"{r.seconds:.0f}"])
    return [("bytes per outer step (one peer's payload) and validation loss, nats/byte",
             headers, rows)]


def plot(results: list[Result], cfg: BenchConfig, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(cfg.replicas) + 1, figsize=(5 * (len(cfg.replicas) + 1), 4.2))
    for ax, n in zip(axes, cfg.replicas, strict=False):
        for r in (r for r in results if r.replicas == n):
            steps = sorted(r.val)
            ax.plot(steps, [r.val[s][0] for s in steps], marker="o", color=COLORS[r.method],
                    label=f"{r.method} ({r.bytes_per_step / 1e3:.2f} kB/outer step)")
            ax.fill_between(steps, [r.val[s][1] for s in steps], [r.val[s][2] for s in steps],
                            color=COLORS[r.method], alpha=0.12)
        ax.set(xlabel="inner step", ylabel="validation loss (nats/byte)",
               title=f"{n} replicas (mean; band = min-max)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    n = cfg.replicas[-1]
    group = [r for r in results if r.replicas == n]
    group = [r for r in group if r.bytes_per_step]
    ax.bar([r.method for r in group], [r.bytes_per_step for r in group],
           color=[COLORS[r.method] for r in group])
    ax.set(yscale="log", ylabel="bytes per outer step (one peer)",
           title=f"payload per outer step ({n} replicas)")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _rel(a: Result, b: Result, step: int) -> float:
    return (a.val[step][0] - b.val[step][0]) / b.val[step][0]


def _findings(results: list[Result], cfg: BenchConfig) -> str:
    end = cfg.marks[-1]
    lines = []
    for n in cfg.replicas:
        by = {r.method: r for r in results if r.replicas == n}
        if any(end not in r.val for r in by.values()):
            lines.append(f"- **{n} replicas**: a method diverged; see the table.")
            continue
        nl, nc, dl, dc = (by[m] for m in METHODS[:-1])
        none = by.get("none") or next((r for r in results if r.method == "none"), None)
        ratio = nl.bytes_per_step / nc.bytes_per_step
        gap = (nc.val[end][0] - nl.val[end][0]) / nl.val[end][0]
        goal = ratio >= 50 and gap <= 0.01
        wraps = (f" {nc.anchor_wraps / nc.anchor_codes:.2%} of the anchor codes decoded "
                 f"outside the grid's range (bounded, not exact)." if nc.anchor_codes else "")
        lines.append(
            f"- **{n} replicas**: compressed NoLoCo sends {ratio:.1f}x fewer bytes per outer "
            f"step than bf16 NoLoCo ({nc.bytes_per_step:,.0f} vs {nl.bytes_per_step:,.0f}) "
            f"and ends at {nc.val[end][0]:.3f} against {nl.val[end][0]:.3f} ({gap:+.2%}): "
            f"the goal (>= 50x, within 1%) is {'met' if goal else 'not met'}. "
            f"SparseLoCo (diloco-topk) ends at {dc.val[end][0]:.3f} against DiLoCo's "
            f"{dl.val[end][0]:.3f} ({(dc.val[end][0] - dl.val[end][0]) / dl.val[end][0]:+.2%}) "
            f"with {dl.bytes_per_step / dc.bytes_per_step:.1f}x fewer bytes. Replica spread "
            f"at step {end}: noloco {nl.spread_end:.2e}, noloco-topk {nc.spread_end:.2e}"
            + (f", none {none.spread_end:.2e} ({none.replicas} replicas). No communication "
               f"ends at {none.val[end][0]:.3f} ({_rel(none, nl, end):+.2%} from bf16 NoLoCo)."
               if none and end in none.val else ".")
            + wraps)
    by8 = {r.method: r for r in results if r.replicas == min(cfg.replicas)}
    if {"noloco", "noloco-topk", "none"} <= by8.keys() and all(
            end in by8[m].val for m in ("noloco", "noloco-topk", "none")):
        nl, nc, none = by8["noloco"], by8["noloco-topk"], by8["none"]
        weak = abs(_rel(none, nl, end)) <= 0.01
        lines.append(
            "- **What the 1% goal says here**: "
            + (f"little. No communication is also within 1% of bf16 NoLoCo "
               f"({_rel(none, nl, end):+.2%}), so at this scale the loss cannot tell a good "
               f"exchange from none. " if weak else "")
            + "The spread can: compressed NoLoCo's replicas end "
            f"{nc.spread_end / nl.spread_end:.0f}x further apart than bf16 NoLoCo's, "
            f"{nc.spread_end / none.spread_end:.2f}x the spread of replicas that never "
            "communicate. With λ = 1 each replica keeps its unsent progress, and at 1.6% "
            "density the exchanged part is too small to pull the replicas together in 14 "
            "rounds: the bytes goal is met, the coupling NoLoCo's "
            "exchange exists for is mostly not. SparseLoCo's reset rule (diloco-topk) keeps "
            "the replicas identical but loses the unsent progress, which 14 rounds are too few "
            "to deliver.")
    big = 86_000_000
    bf16 = codecs.max_encoded_size("bf16", big)
    tn, td = TOPK_NOLOCO.frame_bytes(big, anchor=True), TOPK_DILOCO.frame_bytes(big, anchor=False)
    lines.append(
        f"- Bytes at scale: the frame's size follows from its header, so for the 86M model of "
        f"issue 29 a peer would send {tn / 1e6:.2f} MB "
        f"per outer step (noloco-topk) and {td / 1e6:.2f} MB (diloco-topk) against "
        f"{bf16 / 1e6:.0f} MB in bf16: {bf16 / tn:.1f}x and {bf16 / td:.1f}x. The bench's "
        "tiny model gets less (its last, ragged chunk keeps as many values as a full one, "
        "and per-chunk scales weigh more).")
    lines.append("- One seed, one run of each; differences of a fraction of a percent may "
                 "be noise. The model is tiny so that the whole bench stays bounded on 2 "
                 "shared cores.")
    return "\n".join(lines)


def _section(results: list[Result], cfg: BenchConfig, quick: bool, n_params: int,
             total_s: float, has_plot: bool, workers: int) -> str:
    tables = "\n\n".join(f"**{t}**\n\n{md_table(h, rows)}" for t, h, rows in _tables(results, cfg))
    tn, td = TOPK_NOLOCO, TOPK_DILOCO
    setup = (
        f"Replicas of a byte-level GPT (d_model {cfg.d_model}, {cfg.n_layers} layer, "
        f"{cfg.n_heads} heads, context {cfg.context}, {n_params:,} parameters) on the stdlib "
        f"corpus ({cfg.max_bytes / 1e6:g} MB), in one process with the real trainer and "
        f"outer optimizers, no network. Equal compute: every method takes {cfg.steps} inner "
        f"steps of batch {cfg.batch} per replica (AdamW, lr {cfg.lr:g}, {cfg.warmup_steps} "
        f"warm-up steps, cosine to lr/10), outer step every H = {cfg.h}. noloco: pairs, "
        f"η {NOLOCO.outer_lr}, heavy-ball μ {NOLOCO.momentum}, θ in bf16. noloco-topk: the "
        f"same η, μ; frames of the error-fed θ − φ (β {tn.ef_decay}), top {tn.k} of every "
        f"{tn.chunk} values ({tn.density:.2%}), {tn.value_bits}-bit values, the anchor's "
        f"{tn.anchor_bits}-bit modulo codes at the sent indices (grid "
        f"±{tn.anchor_range:g}·max|m| per chunk), the unsent residual left in the model "
        f"(θ ← φ + e). diloco: Nesterov η {DILOCO.outer_lr}, μ {DILOCO.momentum}, bf16. "
        f"diloco-topk (SparseLoCo): EF β {td.ef_decay}, top {td.k}/{td.chunk}, "
        f"{td.value_bits}-bit values, φ ← φ − mean of the frames (η 1, no outer momentum), "
        f"θ ← φ. none: no communication. "
        f"Every frame is encoded and decoded (protocols/sparse.py); bytes per outer step are "
        f"one peer's payload (module docstring of testnet/bench/compression.py for what an "
        f"all-reduce or all-gather multiplies). Validation loss in nats/byte on "
        f"{cfg.eval_batches}x{cfg.eval_batch} fixed windows, mean over replicas.")
    image = ("![compression](compression.png)" if has_plot
             else "(No plot: matplotlib is not installed; `pip install -e '.[bench]'`.)")
    flag = " --quick" if quick else ""
    return "\n\n".join([
        "## Training: compressed exchange",
        f"`node bench convergence --compression{flag}` on {machine()}; "
        f"{sum(r.seconds for r in results) / 60:.0f} min of runs (`train s`, each run's wall "
        f"time, up to {workers} at a time in worker processes of one thread; the machine's "
        "cores were shared with other work at a load of about 18-35, so `train s` measures "
        f"the load as much as the method; {total_s:.0f} s in the invocation that wrote this, "
        "finished runs being reused from the cache).",
        setup, tables, image, "What the numbers show:\n\n" + _findings(results, cfg),
        "Rerun: `node bench convergence --compression` (or `--quick`: 4 and 8 replicas, 120 "
        "steps); it rewrites this section and docs/compression.png.",
    ])


def _job(cfg: BenchConfig, method: str, n: int, cache: Path | None) -> Result:
    """One (method, replicas) run in a worker process (its own task and evaluator); its
    result is saved in `cache` as soon as it is done, so an interrupted bench resumes."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    task = build_bench_task(cfg)
    res = run_method(method, n, task, cfg, Evaluator(task, cfg))
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{n}-{method}.json").write_text(json.dumps(asdict(res)))
    return res


def _cached(cache: Path | None, n: int, method: str) -> Result | None:
    path = None if cache is None else cache / f"{n}-{method}.json"
    if path is None or not path.exists():
        return None
    doc = json.loads(path.read_text())
    doc["val"] = {int(k): tuple(v) for k, v in doc["val"].items()}
    return Result(**doc)


def cache_dir(cfg: BenchConfig) -> Path:
    """Where a configuration's finished runs are kept (keyed by the config and the topk
    settings, so a changed bench never reuses old numbers)."""
    same = replace(cfg, replicas=())  # a run of n replicas is the same in any set of sizes
    key = hashlib.sha256(repr((same, TOPK_NOLOCO, TOPK_DILOCO, NOLOCO, DILOCO)).encode())
    return Path(tempfile.gettempdir()) / f"peertrain-compression-{key.hexdigest()[:12]}"


def run(cfg: BenchConfig, doc_path: Path, quick: bool = False,
        console: Console | None = None, workers: int = 2, resume: bool = True
        ) -> list[Result]:
    """Every (replicas, method) run, `workers` at a time (one process each, one thread
    each: the runs are independent), largest first; finished runs of the same
    configuration are reused when `resume` (cache_dir)."""
    console = console or Console()
    started = time.perf_counter()
    torch.set_num_threads(1)
    cache = cache_dir(cfg) if resume else None
    done: dict[tuple[int, str], Result] = {}
    for n in cfg.replicas:
        for m in methods(cfg, n):
            hit = _cached(cache, n, m)
            if hit is not None:
                done[(n, m)] = hit
                console.print(f"  {n} x {m}: reused from {cache}")
    jobs = sorted(((n, m) for n in cfg.replicas for m in methods(cfg, n) if (n, m) not in done),
                  key=lambda j: -j[0])
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(_job, cfg, m, n, cache): (n, m) for n, m in jobs}
        for fut in as_completed(futures):
            r = fut.result()
            done[futures[fut]] = r
            console.print(f"  {r.replicas} x {r.method}: {r.seconds:.0f} s, "
                          f"{r.bytes_per_step:,.0f} B/outer step, "
                          f"val {r.val.get(cfg.marks[-1], (float('nan'),))[0]:.3f}")
    results = [done[(n, m)] for n in cfg.replicas for m in methods(cfg, n)]
    evaluator = Evaluator(build_bench_task(cfg), cfg)
    print_tables(console, _tables(results, cfg))
    has_plot = plot(results, cfg, doc_path.parent / "compression.png")
    total = time.perf_counter() - started
    write_section("compression", _section(results, cfg, quick, evaluator.trainer.n_params,
                                          total, has_plot, workers), doc_path)
    console.print(_findings(results, cfg))
    console.print(f"wrote {doc_path}; {total:.0f} s in all")
    return results


def main(quick: bool = False, doc_path: Path | None = None, workers: int = 2) -> list[Result]:
    """`node bench convergence --compression [--quick] [--workers N]`."""
    return run(QUICK if quick else FULL, DOC if doc_path is None else Path(doc_path), quick,
               workers=workers)


if __name__ == "__main__":  # pragma: no cover
    import sys

    main(quick="--quick" in sys.argv[1:])
