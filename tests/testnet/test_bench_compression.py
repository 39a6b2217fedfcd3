"""Smoke test of the compression benchmark (testnet/bench/compression.py) at tiny sizes:
frames really go through the codec (bytes per outer step are the frames' lengths), DiLoCo
variants keep their replicas identical, and the section lands between its markers. No
timing is asserted."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from protocols import codecs, sparse
from testnet.bench import compression as bench

TINY = bench.BenchConfig(replicas=(2, 4), steps=12, h=4, marks=(4, 8, 12), batch=4, d_model=16,
                         n_heads=2, context=16, max_bytes=200_000, warmup_steps=2,
                         eval_batch=8, eval_batches=1)


@pytest.fixture(scope="module")
def results() -> dict[str, bench.Result]:
    task = bench.build_bench_task(TINY)
    ev = bench.Evaluator(task, TINY)
    return {m: bench.run_method(m, 4, task, TINY, ev) for m in bench.METHODS}


def test_bytes_are_the_frames_and_diloco_replicas_agree(results: dict[str, bench.Result]
                                                        ) -> None:
    numel = bench.Evaluator(bench.build_bench_task(TINY), TINY).trainer.n_params
    assert results["noloco"].bytes_per_step == codecs.max_encoded_size("bf16", numel)
    tn, td = bench.TOPK_NOLOCO, bench.TOPK_DILOCO
    assert results["noloco-topk"].bytes_per_step == sparse.encoded_size(
        numel, tn.chunk, tn.k, tn.value_bits, tn.anchor_bits)
    assert results["diloco-topk"].bytes_per_step == sparse.encoded_size(
        numel, td.chunk, td.k, td.value_bits, 0)
    assert results["none"].bytes_per_step == 0
    for m in ("diloco", "diloco-topk"):
        assert results[m].spread_end == 0.0, m  # θ ← φ, the same φ everywhere
    for r in results.values():
        assert sorted(r.val) == list(TINY.marks) and r.diverged_at is None


def test_the_section_is_written_between_its_markers(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nbefore\n\n<!-- bench:compression:start -->\nold\n"
                   "<!-- bench:compression:end -->\n\nafter\n")
    monkeypatch.setattr(bench, "cache_dir", lambda cfg: tmp_path / "cache")
    bench.run(TINY, doc, console=Console(file=io.StringIO()), workers=1)
    text = doc.read_text()
    assert "before" in text and "after" in text and "old" not in text
    assert "| 4 | noloco-topk |" in text and "| 2 | none |" in text
    assert "| 4 | none |" not in text  # none at the smallest replica count only
