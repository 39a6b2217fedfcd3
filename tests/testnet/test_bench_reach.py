"""`node bench reach --pairs`: which pairs it takes, and that a run of some pairs writes a
section of its own, leaving the full matrix's as it is (testnet/bench/reach.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testnet.bench import reach
from testnet.bench.report import write_section


def test_pairs_are_kind_kind_among_the_scenario_s_kinds():
    assert reach.parse_pairs("home-upnp, upnp-upnp") == [("home", "upnp"), ("upnp", "upnp")]
    for bad in ("home", "home-cgnat", "home_upnp"):
        with pytest.raises(ValueError, match="KIND-KIND"):
            reach.parse_pairs(bad)


def test_a_run_of_some_pairs_writes_its_own_section(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    write_section("reach", "## Reachability matrix (`node bench reach`)\n\nthe full one", doc)
    kinds = {"home1": "home", "upnp1": "upnp"}
    results = {("home", "upnp"): [{"path": "upnp", "s": 0.05, "dialer": "home1"}]}
    body = reach.report(results, 1, kinds, [1.0], doc, [("home", "upnp")])
    text = doc.read_text()
    assert "the full one" in text and "<!-- bench:reach-pairs:start -->" in text
    assert "--pairs home-upnp" in body and "| home ↔ upnp | upnp (1/1) |" in body
