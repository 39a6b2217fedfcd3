"""Smoke test of the convergence benchmark (testnet/bench/convergence.py) at tiny sizes.

It runs the four methods for a few dozen steps of a tiny GPT and checks behaviour that
could break: identical starting weights, DiLoCo's replicas identical after each outer step,
the no-communication spread growing while NoLoCo's stays below it, the loss falling, and
the doc section being written between its markers without touching anything else.
No timing is asserted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import math
from pathlib import Path

import pytest
from rich.console import Console

from testnet.bench import convergence as bench

TINY = bench.BenchConfig(
    replicas=4,
    steps=24,
    h=4,
    eval_every=8,
    marks=(8, 16, 24),
    batch=4,
    d_model=16,
    n_layers=1,
    n_heads=2,
    context=16,
    max_bytes=200_000,
    lr=3e-3,
    warmup_steps=4,
    eval_batch=8,
    eval_batches=2,
)


@pytest.fixture(scope="module")
def results() -> dict[str, bench.MethodResult]:
    task = bench.build_bench_task(TINY)
    evaluator = bench.Evaluator(task, TINY)
    return {m: bench.run_method(m, task, TINY, evaluator) for m in bench.METHODS}


def test_sizes_and_records(results: dict[str, bench.MethodResult]) -> None:
    for method, res in results.items():
        assert res.diverged_at is None, method
        assert res.n_models == (1 if method == "sync" else TINY.replicas)
        assert res.eval_steps == [0, 8, 16, 24]
        assert res.spread_steps == list(range(0, TINY.steps + 1, TINY.h))
        assert all(math.isfinite(v) for v in res.val_mean + res.val_min + res.val_max)
        assert all(
            lo <= mean <= hi
            for lo, mean, hi in zip(res.val_min, res.val_mean, res.val_max, strict=True)
        )
        # One shared evaluator: every method starts from the same weights and the same score.
        assert res.val_mean[0] == results["sync"].val_mean[0]


def test_spread(results: dict[str, bench.MethodResult]) -> None:
    none, noloco, diloco = results["none"], results["noloco"], results["diloco"]
    for res in (none, noloco, diloco):
        assert res.spread_post[0] == 0.0  # identical initial weights on every replica
    # Without communication the replicas drift apart, and keep drifting.
    assert 0 < none.spread_post[1] < none.spread_post[-1]
    # NoLoCo's pairwise averaging keeps its replicas closer than no communication...
    assert noloco.spread_post[-1] < none.spread_post[-1]
    # ...and each outer step pulls the pairs together.
    assert all(
        post < pre for pre, post in zip(noloco.spread_pre[1:], noloco.spread_post[1:], strict=True)
    )
    # DiLoCo's all-reduce makes the replicas identical after every outer step, but they
    # diverge during the inner steps.
    assert all(s == 0.0 for s in diloco.spread_post)
    assert all(s > 0.0 for s in diloco.spread_pre[1:])
    # NoLoCo's update with everyone in one group also leaves the replicas together (up to
    # rounding: each replica sums the group in its own order).
    together = results["noloco-all"]
    assert max(together.spread_post) < 1e-3 * none.spread_post[-1]
    assert all(s > 0.0 for s in together.spread_pre[1:])
    # The same inner steps from the same weights: before the first outer step, DiLoCo's,
    # NoLoCo's and the uncoupled replicas are the same.
    assert (
        diloco.spread_pre[1]
        == noloco.spread_pre[1]
        == together.spread_pre[1]
        == none.spread_post[1]
    )


def test_loss_falls(results: dict[str, bench.MethodResult]) -> None:
    for method, res in results.items():
        assert res.val_mean[-1] < res.val_mean[0] - 0.5, method


def test_doc_section_and_plot(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    other = "<!-- bench:other:start -->\n## Other\n\nkeep me\n<!-- bench:other:end -->"
    doc.write_text(f"# Benchmarks\n\nintro stays\n\n{other}\n")
    out = io.StringIO()
    console = Console(file=out, width=120)
    for _ in range(2):  # rewriting replaces the block, never duplicates it
        bench.run(TINY, doc, quick=True, console=console)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro stays\n")
    assert other in text
    assert text.count("<!-- bench:convergence:start -->") == 1
    assert text.count("<!-- bench:convergence:end -->") == 1
    block = text.split("<!-- bench:convergence:start -->")[1].split("<!-- bench:convergence:end")[0]
    assert "## Training: convergence" in block
    assert "node bench convergence --quick" in block
    for method in bench.METHODS:
        assert f"| {method} |" in block
    png = doc.parent / "convergence.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![convergence](convergence.png)" in block
    else:
        assert not png.exists()
    assert "validation loss" in out.getvalue()


def test_new_doc_is_created(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    tiny = dataclasses.replace(TINY, steps=8, marks=(8,))
    bench.run(tiny, doc, console=Console(file=io.StringIO()))
    text = doc.read_text()
    assert text.startswith("# Benchmarks")
    assert "<!-- bench:convergence:start -->\n## Training: convergence" in text


def test_config_checks() -> None:
    with pytest.raises(ValueError):
        bench.BenchConfig(steps=100, h=30, eval_every=10, marks=(100,))  # not a boundary
    with pytest.raises(ValueError):
        bench.BenchConfig(replicas=1)
    with pytest.raises(ValueError):
        bench.run_method("gossip", None, TINY, None)  # type: ignore[arg-type]
