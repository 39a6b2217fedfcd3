"""Convergence at equal compute: NoLoCo vs DiLoCo vs no communication vs synchronous.

    node bench convergence [--quick]

Eight replicas of a small byte-level GPT on the stdlib corpus, simulated in one process
with the real trainer (node/trainer) and outer optimizers (node/optim); no network, so
the numbers isolate the algorithms. Equal compute: every method does the same number of
inner steps on the same number of samples; the synchronous baseline is one model with an
8x batch. Reported: validation loss at fixed steps (mean over replicas) and the replica
spread sqrt(mean_params var_replicas(θ)), the `eval_weight_variance` of the NoLoCo code.
Which DiLoCo: Nesterov, η 0.7, μ 0.9 (OpenDiLoCo). NoLoCo: pairs, η 0.7, μ 0.5.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from node.optim.diloco import DiLoCo, DiLoCoConfig
from node.optim.noloco import NoLoCo, NoLoCoConfig
from node.optim.pairing import noloco_groups
from node.trainer.loop import TrainConfig, Trainer
from node.trainer.tasks import TaskConfig, build_task
from testnet.bench.report import DOC, machine, md_table, write_section

REPLICAS = 8


def _task(max_bytes: int):
    return build_task(TaskConfig(name="bytes-gpt", d_model=64, n_layers=2, n_heads=4,
                                 context=64, max_bytes=max_bytes))


def _trainers(task, n: int, steps: int, batch: int) -> list[Trainer]:
    return [Trainer(task, TrainConfig(batch_size=batch, lr=2e-3, warmup_steps=20,
                                      max_steps=steps, eval_every=0, eval_batches=4, seed=0,
                                      replica=i)) for i in range(n)]


def spread(trainers: list[Trainer]) -> float:
    if len(trainers) < 2:
        return 0.0
    stacked = torch.stack([t.parameters_vector() for t in trainers])
    return float(stacked.var(dim=0, unbiased=False).mean().sqrt())


def run_method(method: str, task, steps: int, h: int, every: int) -> dict:
    torch.manual_seed(0)
    if method == "sync":
        trainers = _trainers(task, 1, steps, 8 * REPLICAS)
    else:
        trainers = _trainers(task, REPLICAS, steps, 8)
    ids = [f"peer{i}" for i in range(len(trainers))]
    noloco = [NoLoCo(t.parameters_vector(), NoLoCoConfig(0.7, 0.5)) for t in trainers]
    diloco = DiLoCo(trainers[0].parameters_vector(), DiLoCoConfig(0.7, 0.9, nesterov=True))
    curve: list[tuple[int, float, float, float, float]] = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        for t in trainers:
            t.step()
        if step % h == 0 and method == "noloco":
            thetas = [t.parameters_vector() for t in trainers]
            for group in noloco_groups(step // h, ids):
                idx = [ids.index(p) for p in group]
                for i in idx:
                    phi = noloco[i].outer_step(thetas[i], [thetas[j] for j in idx if j != i])
                    trainers[i].set_parameters_vector(phi)
        elif step % h == 0 and method == "diloco":
            phi = diloco.outer_step([diloco.pseudo_gradient(t.parameters_vector())
                                     for t in trainers])
            for t in trainers:
                t.set_parameters_vector(phi)
        if step % every == 0 or step == steps:
            losses = [t.evaluate() for t in trainers]
            curve.append((step, sum(losses) / len(losses), min(losses), max(losses),
                          spread(trainers)))
    return {"curve": curve, "seconds": time.perf_counter() - started}


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for method, res in results.items():
        steps = [c[0] for c in res["curve"]]
        ax1.plot(steps, [c[1] for c in res["curve"]], label=method)
        if method != "sync":
            ax2.plot(steps, [max(c[4], 1e-8) for c in res["curve"]], label=method)
    ax1.set(xlabel="inner step", ylabel="validation loss (nats/byte)",
            title="validation loss, mean of 8 replicas")
    ax2.set(xlabel="inner step", ylabel="replica spread", yscale="log",
            title="spread of weights across replicas")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(quick: bool = False, doc: Path | None = None) -> str:
    from rich.console import Console

    console = Console()
    steps, h, every, max_bytes = (120, 20, 20, 1_000_000) if quick else (600, 30, 60, 4_000_000)
    task = _task(max_bytes)
    results = {}
    for method in ("noloco", "diloco", "none", "sync"):
        with console.status(f"{method}: {steps} steps"):
            results[method] = run_method(method, task, steps, h, every)
    marks = sorted({c[0] for c in results["noloco"]["curve"]})
    marks = [marks[len(marks) // 4], marks[len(marks) // 2], marks[-1]]
    rows = []
    for method, res in results.items():
        by_step = {c[0]: c for c in res["curve"]}
        rows.append([method, *[f"{by_step[s][1]:.3f}" for s in marks],
                     *[f"{by_step[s][4]:.2e}" if method != "sync" else "-" for s in marks],
                     f"{res['seconds']:.0f}"])
    headers = ["method", *[f"val @ {s}" for s in marks], *[f"spread @ {s}" for s in marks],
               "wall s"]
    table = md_table(headers, rows)
    console.print(table)
    doc = doc or DOC
    png = doc.parent / "convergence.png"
    has_plot = plot(results, png)
    final = {m: r["curve"][-1] for m, r in results.items()}
    gap = (final["noloco"][1] - final["diloco"][1]) / final["diloco"][1]
    text = (f"## Training: convergence\n\n`node bench convergence{' --quick' if quick else ''}`"
            f" on {machine()}: {REPLICAS} replicas of a byte-level GPT (d 64, 2 layers, "
            f"context 64, batch 8 each) on the stdlib corpus, {steps} inner steps, outer step "
            f"every {h}; the synchronous baseline is one model with batch {8 * REPLICAS}. "
            f"Simulated in one process with the real trainer and optimizers.\n\n{table}\n\n"
            + ("![convergence](convergence.png)\n\n" if has_plot else "")
            + f"At the last step NoLoCo's validation loss is {gap:+.1%} relative to DiLoCo's; "
            f"replica spread: NoLoCo {final['noloco'][4]:.2e}, no communication "
            f"{final['none'][4]:.2e} (DiLoCo's replicas are identical after each outer step).")
    write_section("convergence", text, doc)
    return text
