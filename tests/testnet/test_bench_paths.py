"""`node bench paths`: its table from recorded rounds (testnet/bench/paths.py); the bench
itself builds NATs in namespaces and runs by hand (docs/benchmarks.md, section paths)."""

from __future__ import annotations

from pathlib import Path

from testnet.bench import paths


def _side(seconds: float, ok: bool = True, **sent: int) -> dict:
    return {"ok": ok, "seconds": seconds, "codec": "bf16", "sent": sent,
            "path": "relayed via QmR"}


def test_a_row_gives_routes_the_first_round_apart_and_the_rounds_lost(tmp_path: Path):
    rounds = [{"a": _side(2.0, lane=4_000_000), "b": _side(1.5, lane=4_000_000)},
              {"a": _side(1.0, stream=4_000_000), "b": _side(0.8, stream=4_000_000)},
              {"a": _side(9.0, ok=False), "b": _side(9.0)},
              {"a": _side(0.5, stream=4_000_000), "b": _side(0.5, stream=4_000_000)}]
    res = {"seen": ["relayed via QmR", "relayed via QmS"], "rounds": rounds, "path_s": 3.0}
    case = paths.CASES[0]
    row = paths._row(case, res, len(rounds))
    assert row[1] == "relayed / relayed"
    assert row[2] == "lane 8 MB, stream 16 MB"  # the lost round's bytes are not counted
    assert row[4] == "2.00; 0.75 [0.50-1.00]"  # the first alone, the slower side's seconds
    assert row[5] == "8.0"  # median of 4.0, 8.0, 16.0 MB/s
    assert row[6] == "1/4"
    doc = tmp_path / "benchmarks.md"
    body = paths.report({case.label: res}, list(paths.CASES), "100mbit", 50.0, 16.0, 4,
                        [1.0, 2.0], doc)
    assert "Cut short: 1 of 6 cases" in body and "<!-- bench:paths:start -->" in doc.read_text()


def test_a_case_that_never_got_its_path_says_so():
    row = paths._row(paths.CASES[3], {"error": "no punched path in 90 s (saw [...])"}, 5)
    assert row[1].startswith("no punched path") and row[2:] == ["-"] * 5
