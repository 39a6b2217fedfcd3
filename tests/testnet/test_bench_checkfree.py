"""The CheckFree benchmark's core (testnet/bench/checkfree.py) at tiny sizes: recovery
leaves finite weights of the right shapes, and the rules are the ones the bench claims.
No timing is asserted."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console

from node.ml.pipeline import micro_batches
from node.ml.recovery import checkfree_average
from testnet.bench import checkfree as bench

TINY = bench.BenchConfig(iterations=16, blocks=4, d_model=16, n_heads=2, context=16,
                         micro_batches=2, micro_batch=2, failure_p=0.0, first_failure=0,
                         eval_every=8, eval_batch=4, eval_batches=1, max_bytes=200_000,
                         window=2, checkpoint_every=4)
SCHEDULE = [(6, 2), (11, 1)]  # an interior stage, then an edge stage (CheckFree+ only)


@pytest.fixture(scope="module")
def task():
    return bench.build_bench_task(TINY)  # on one thread, as the benchmark runs (conftest)


def trained(task, swap: bool = False, steps: int = 3) -> bench.Pipeline:
    torch.manual_seed(0)
    pipe = bench.new_pipeline(TINY, swap)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = task.train_batch(4, g)
        pipe.train_step(micro_batches(x, y, 2))
    return pipe


def test_checkfree_recovered_stage_is_the_norm_weighted_average(task) -> None:
    pipe = trained(task)
    prev, nxt = pipe.stages[1].blocks_state(), pipe.stages[3].blocks_state()
    n_prev, n_next = pipe.runners[1].grad_norm, pipe.runners[3].grad_norm
    assert 0 < n_prev <= TINY.grad_clip and 0 < n_next <= TINY.grad_clip
    w_prev = bench.recover(pipe, "checkfree", 2, TINY, None, torch.Generator())
    assert w_prev == pytest.approx((n_prev + 1e-4) / (n_prev + n_next + 2e-4))
    expected = checkfree_average(prev, nxt, n_prev, n_next)
    got = pipe.stages[2].blocks_state()
    assert set(got) == set(expected)
    for k in got:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0)
    # fresh Adam at the raised learning rate, kept
    assert pipe.runners[2].optimizer.state == {} or all(
        not s for s in pipe.runners[2].optimizer.state.values())
    assert pipe.runners[2].optimizer.param_groups[0]["lr"] == pytest.approx(TINY.lr * 1.1)


def test_checkfree_plus_copies_the_swap_partner(task) -> None:
    pipe = trained(task, swap=True)
    partner = pipe.stages[2].blocks_state()
    bench.recover(pipe, "checkfree+", 1, TINY, None, torch.Generator())
    assert all(torch.equal(v, partner[k]) for k, v in pipe.stages[1].blocks_state().items())


def test_every_run_recovers_to_finite_weights_of_the_right_shapes(task) -> None:
    shapes = {j: {k: v.shape for k, v in s.blocks_state().items()}
              for j, s in enumerate(bench.new_pipeline(TINY, False).stages)}
    results = {}
    for run in bench.RUNS:
        res = bench.run_one(run, task, TINY, SCHEDULE)
        results[run] = res
        assert len(res.losses) == TINY.iterations
        assert all(math.isfinite(x) for x in res.losses + res.val)
        assert res.eval_iters == [0, 8, 15]
    assert [f.stage for f in results["checkfree"].failures] == [2]  # interior only
    assert [f.stage for f in results["checkfree+"].failures] == [2, 1]
    assert results["none"].failures == [] == results["checkfree+ (no failures)"].failures
    # the same data and weights without failures: the failure-free runs agree up to the
    # failure, so every "excess" is the failure's
    assert results["reinit"].losses[:6] == results["none"].losses[:6]
    for run, res in results.items():
        bench.measure(res, results["none"], TINY)
        assert all(math.isfinite(f.spike) for f in res.failures), run
    pipe = bench.new_pipeline(TINY, False)
    for run in ("checkpoint", "reinit", "neighbour-avg", "checkfree"):
        bench.recover(pipe, run, 2, TINY, bench._snapshot(pipe), torch.Generator())
        for j, s in enumerate(pipe.stages):
            state = s.blocks_state()
            assert {k: v.shape for k, v in state.items()} == shapes[j]
            assert all(bool(torch.isfinite(v).all()) for v in state.values())


def test_the_report_writes_its_section_and_plot(task, tmp_path: Path) -> None:
    cfg = dataclasses.replace(TINY, failure_p=0.5, first_failure=4)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- bench:other:start -->\nkeep\n<!-- bench:other:end -->\n")
    console = Console(file=io.StringIO(), width=200)
    results = bench.run(cfg, doc, quick=True, console=console)
    text = doc.read_text()
    assert "keep" in text and "## Pipeline: CheckFree stage recovery" in text
    assert "`node bench checkfree --quick`" in text
    assert set(results) == set(bench.RUNS)
    assert (tmp_path / "checkfree.png").exists() or "No plot" in text
