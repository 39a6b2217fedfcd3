"""Smoke test of the robust-aggregation benchmark (testnet/bench/robust.py) in --quick mode.

It runs the quick sweep once (every aggregator against K = 10 sybils, the four
variance-correction runs) into a temporary doc and checks behaviour that could break: the
section written between its markers without touching anything else, the plain mean
poisoned by identical sybils where SybilWall is not, the 1/(K+1) variance collapse of
averaging independent models that vc undoes, and the harness's seeded determinism.
No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from testnet.bench import robust as bench
from testnet.bench import robust_sim as sim

# The quick sweep with two of its five aggregators: the plain mean that sybils poison and
# SybilWall that resists them (each aggregator's own rule is tested in test_aggregate.py).
SMOKE = replace(bench.QUICK, aggregators=("mean", "sybilwall"))
OTHER = "<!-- bench:other:start -->\n## Other\n\nkeep me\n<!-- bench:other:end -->"


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[bench.Results, Path, str]:
    doc = tmp_path_factory.mktemp("docs") / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro stays\n\n{OTHER}\n")
    out = io.StringIO()
    results = bench.run(SMOKE, doc, quick=True, console=Console(file=out, width=160))
    return results, doc, out.getvalue()


def test_doc_section_and_plot(quick: tuple[bench.Results, Path, str]) -> None:
    _, doc, printed = quick
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro stays\n")
    assert OTHER in text
    assert text.count("<!-- bench:robust:start -->") == 1
    assert text.count("<!-- bench:robust:end -->") == 1
    block = text.split("<!-- bench:robust:start -->")[1].split("<!-- bench:robust:end")[0]
    assert "## Robust aggregation" in block
    assert "node bench robust --quick" in block
    for agg in SMOKE.aggregators:
        assert f"| {agg} |" in block
    for label in ("mean, independent init", "vc, independent init", "mean, shared init"):
        assert f"| {label} |" in block
    assert "Acceptance (issue 5)" in block
    png = doc.parent / "robust.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![robust aggregation](robust.png)" in block
    else:
        assert not png.exists()
    assert "attack success" in printed


def test_sybils_poison_the_mean_not_sybilwall(quick: tuple[bench.Results, Path, str]) -> None:
    res, _, _ = quick
    for attack in bench.ATTACKS:
        mean, wall = res.get("mean", attack, 10), res.get("sybilwall", attack, 10)
        floor = res.get("mean", None, 0).base_rates[attack]
        assert mean.attack_rate > floor + 0.3, attack  # ten identical sybils poison the mean
        assert mean.attack_rate > wall.attack_rate + 0.3, attack
        assert mean.sybil_weight is not None and mean.sybil_weight > 0.1
        # Identical sybil histories get weight 0 (spec §5, equivalence tests) once two meet.
        assert wall.sybil_weight is not None and wall.sybil_weight < mean.sybil_weight
    for r in res.sybil.values():
        assert 0.0 <= r.accuracy_min <= r.accuracy <= 1.0
        assert len(r.accuracy_by_round) == bench.QUICK.sybil.rounds


def test_variance_collapse_and_correction(quick: tuple[bench.Results, Path, str]) -> None:
    res, _, _ = quick
    plain = res.vc["mean, independent init"]
    vc = res.vc["vc, independent init"]
    shared = res.vc["mean, shared init"]
    rescale_only = res.vc["vc, equal weights, shared init"]
    rounds = bench.QUICK.vc.rounds
    for r in res.vc.values():
        assert len(r.accuracy) == rounds + 1
        # Xavier init: every layer starts at the Xavier variance (up to sampling).
        assert all(0.8 < ratios[0] < 1.2 for ratios in r.variance_ratio.values())
    # Averaging 5 independent models keeps ~1/5 of the variance (spec §2a)...
    assert all(0.1 < ratios[1] < 0.3 for ratios in plain.variance_ratio.values())
    # ...vc restores it...
    assert all(ratios[1] > 0.6 for ratios in vc.variance_ratio.values())
    # ...and learns faster for it, closing most of the gap to a shared init.
    assert vc.accuracy[-1] > plain.accuracy[-1] + 0.1
    assert bench.gap_closed(res) > 0.5
    # From one shared init the rescaling alone (the mean's weights) changes almost nothing.
    pairs = zip(rescale_only.accuracy, shared.accuracy, strict=True)
    assert max(abs(a - b) for a, b in pairs) < 0.03


def test_harness_is_deterministic() -> None:
    params = sim.SybilParams(rounds=2)
    setting = sim.SybilSetting("mean", "label-flip", 2)
    a, b = sim.run_sybil(params, setting), sim.run_sybil(params, setting)
    assert a.accuracy_by_round == b.accuracy_by_round
    assert a.base_rates == b.base_rates


def test_split_and_graph() -> None:
    y = sim.load_digits().y_train
    shards = sim.dirichlet_split(y, 21, 0.1, np.random.default_rng(0))
    joined = torch.cat(shards).sort().values
    assert torch.equal(joined, torch.arange(len(y)))  # a partition: disjoint, complete
    assert min(len(s) for s in shards) >= 8
    adj = sim.random_regular_graph(16, 4, np.random.default_rng(0))
    assert all(len(set(n)) == 4 and i not in n for i, n in enumerate(adj))
    assert all(i in adj[j] for i, n in enumerate(adj) for j in n)  # undirected
    with pytest.raises(ValueError):
        sim.random_regular_graph(5, 3, np.random.default_rng(0))  # odd degree sum


def test_poisoned_sets() -> None:
    data = sim.load_digits()
    own = torch.arange(50)
    x, y = sim.poisoned_set(data, own, "label-flip")
    zero_one = (data.y_train == 0) | (data.y_train == 1)
    assert len(y) == 50 + int(zero_one.sum())
    assert not torch.any(y[50:] == data.y_train[zero_one])  # every extra label is swapped
    x, y = sim.poisoned_set(data, own, "backdoor")
    assert len(y) == 50 + len(data.y_train)
    assert torch.all(y[50:] == 1) and torch.all(x[50:].view(-1, 8, 8)[:, :2, :3] == 1.0)
    with pytest.raises(ValueError):
        sim.poisoned_set(data, own, "gradient-ascent")


def test_config_checks() -> None:
    with pytest.raises(ValueError):
        bench.BenchConfig(ks=())
    with pytest.raises(ValueError):
        bench.BenchConfig(aggregators=("mean", "trimmed-mean"))
    with pytest.raises(ValueError):
        bench.BenchConfig(vc_marks=(1, 500))
