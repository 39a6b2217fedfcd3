"""The pipeline convergence benchmark (testnet/bench/pipeconv.py) at tiny sizes: where the
gradients go under each routing, what each outer step leaves behind, and the doc section.
No timing is asserted."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

from testnet.bench import pipeconv as bench

TINY = bench.PipeConfig(replicas=4, steps=24, h=4, eval_every=8, marks=(8, 16, 24), batch=4,
                        d_model=16, n_layers=2, n_heads=2, context=16, max_bytes=200_000,
                        lr=1e-2, warmup_steps=2, eval_batch=8, eval_batches=2)


@pytest.fixture(scope="module")
def task():
    return bench.build_bench_task(TINY)


def grads(task, routing: str, second_batch_seed: int) -> list[list[dict[str, torch.Tensor]]]:
    """Every stage replica's gradient after one loss, replica 1 reading another stream."""
    torch.manual_seed(0)
    grid = bench.Grid(TINY)
    batches = [task.train_batch(TINY.batch, torch.Generator().manual_seed(s))
               for s in (1, second_batch_seed, 4, 5)]
    grid.loss(3, batches, routing).backward()
    return [[{n: p.grad.clone() for n, p in st.named_parameters()} for st in row]
            for row in grid.stages]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_fixed_routing_keeps_replicas_apart_and_random_routing_mixes_them(task):
    # Replica 1 reads other data; with fixed routing nothing of replica 0 notices.
    base, other = grads(task, "fixed", 2), grads(task, "fixed", 3)
    assert same(base[0][0], other[0][0]) and same(base[1][0], other[1][0])
    assert not same(base[0][1], other[0][1])
    # With random routing replica 0 of the last stage processes replica 1's sequences, but
    # their head gradient reaches replica 1's embedding (the tie follows the sequence's
    # origin), so replica 0 of the first stage still sees its own sequences only.
    base, other = grads(task, "random", 2), grads(task, "random", 3)
    assert not same(base[1][0], other[1][0])
    assert same(base[0][0], other[0][0])


def test_the_loss_is_each_replicas_mean_summed(task):
    torch.manual_seed(0)
    grid = bench.Grid(TINY)
    batches = [task.train_batch(TINY.batch, torch.Generator().manual_seed(s))
               for s in (1, 2, 3, 4)]
    expected = 0.0
    with torch.no_grad():
        loss = float(grid.loss(3, batches, "fixed"))
        for r, (x, y) in enumerate(batches):  # replica r's whole pipeline on its own batch
            h = grid.stages[0][r].embed(x)
            for row in grid.stages:
                h = row[r].run_blocks(h)
            grid.stages[-1][r].borrow(grid.stages[0][r].wte.weight)
            logits = grid.stages[-1][r].head(h)
            expected += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    assert loss == pytest.approx(expected, rel=1e-5)


@pytest.fixture(scope="module")
def results(task) -> dict[tuple[str, str], bench.RunResult]:
    return {(m, r): bench.run_one(m, r, task, TINY) for m, r in bench.RUNS}


def test_an_outer_step_copies_into_the_parameters():
    torch.manual_seed(0)
    stage = bench.Grid(TINY).stages[0][0]
    phi = bench._vector(stage) + 1.0
    bench._load(stage, phi)
    assert torch.equal(bench._vector(stage), phi)
    phi.zero_()  # the optimizer's own φ moves on: the model must not move with it
    assert not torch.equal(bench._vector(stage), phi)


def test_outer_steps_and_loss(results):
    for (method, routing), res in results.items():
        assert res.eval_steps == [0, 8, 16, 24], (method, routing)
        assert res.val_mean[-1] < res.val_mean[0] - 0.5, (method, routing)
        assert res.val_min[-1] <= res.val_mean[-1] <= res.val_max[-1]
        assert len(res.spread) == TINY.stages
    # DiLoCo ends on an outer step: every stage's replicas identical; NoLoCo's pairs
    # average, so closer than the uncoupled replicas but not identical.
    for routing in bench.ROUTINGS:
        assert results[("diloco", routing)].spread == [0.0, 0.0]
        nol, none = results[("noloco", routing)].spread, results[("none", routing)].spread
        assert all(0 < a < b for a, b in zip(nol, none, strict=True)), (nol, none)
    # Same start, same data: every run scores the same before training.
    assert len({res.val_mean[0] for res in results.values()}) == 1


def test_doc_section(tmp_path: Path):
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text("# Benchmarks\n\nintro stays\n")
    out = io.StringIO()
    for _ in range(2):
        bench.run(TINY, doc, quick=True, console=Console(file=out, width=120))
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro stays\n")
    assert text.count("<!-- bench:pipeconv:start -->") == 1
    block = text.split("<!-- bench:pipeconv:start -->")[1]
    assert "## Training: NoLoCo with pipelines" in block
    assert "node bench convergence --pipeline --quick" in block
    for method, routing in bench.RUNS:
        assert f"| {method}, {routing} routing |" in block
    assert "Random routing" in block and "Fixed routing" in block
