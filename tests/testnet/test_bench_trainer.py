"""`node bench trainer` plumbing (no timing assertions): a tiny run writes its device's
block into the trainer section and leaves the other device's block alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from testnet.bench import trainer as bench


def test_a_tiny_cpu_run_writes_its_block_and_keeps_the_other(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    bench.write_block("cuda", "### CUDA\n\nH100 rows stay here.\n", doc)
    text = bench.main(device="cpu", quick=True, d_model=16, layers=1, heads=2, context=16,
                      batch=4, steps=2, rounds=1, compile_=False, doc=doc)
    assert "| plain loop |" in text and "| peertrain Trainer |" in text
    written = doc.read_text()
    assert written.count("<!-- bench:trainer:start -->") == 1
    assert "H100 rows stay here." in written and "| peertrain Trainer |" in written
    assert "node bench trainer --device cuda" in written  # the GPU command is documented


def test_peaks_for_mfu():
    assert bench.gpu_peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert bench.gpu_peak("NVIDIA H100 PCIe") == 756e12
    assert bench.gpu_peak("Some Future GPU") is None
    # 86M model at context 1024: issue 29's 457k tokens/s was 29% MFU on the H100
    fpt = bench.flops_per_token(85_956_096, 12, 768, 1024)
    assert fpt * 457e3 / 989.4e12 == pytest.approx(0.29, abs=0.005)


@pytest.mark.parametrize("args, says", [
    (["--d-model", "30", "--heads", "4"], "error: d_model (30) must be a multiple of n_heads"),
    (["--device", "tpu"], "error: unknown device 'tpu'"),
])
def test_bad_shapes_and_devices_are_one_line_errors(args, says):
    from tests.conftest import run_cli

    r = run_cli("bench", "trainer", "--device", "cpu", "--no-compile", *args, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(says) and len(r.stderr.strip().splitlines()) == 1, r.stderr
