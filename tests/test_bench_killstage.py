"""The kill-stage benchmark's report (testnet/bench/killstage.py) from made-up readings; the
live path it drives is tests/test_pipeline_edge.py's and tests/test_pipeline_live.py's."""

from __future__ import annotations

from pathlib import Path

from testnet.bench import killstage as bench


def case(rule: str | None, after: list[tuple[int, float]]) -> bench.Case:
    return bench.Case("edge", 0, "checkfree+", load="3.1 / 2.0",
                      before=[(10 + i, 2.0 + 0.1 * i) for i in range(5)], started_s=4.2,
                      rebuilt_s=21.5 if rule else None, rule=rule, rebuild_s=0.02,
                      first_step_s=22.0 if after else None, after=after)


def test_the_table_reads_the_spike_and_the_recovery():
    headers, rows = bench.table([case("copy+ends", [(20, 3.4), (21, 3.0), (22, 2.7),
                                                    (23, 2.5), (24, 2.4), (25, 2.3)])])
    row = dict(zip(headers, rows[0], strict=True))
    assert row["case"] == "edge stage 0, checkfree+" and row["rule"] == "copy+ends"
    assert row["loss before"] == "2.20"  # mean of 2.0 .. 2.4
    assert row["first loss after"] == "3.40" and row["worst after"] == "3.40"
    assert row["mean of last 5 after"] == "2.58 (steps 6)"
    assert row["rebuilt s"] == "21.5" and row["first step s"] == "22"


def test_a_case_that_never_recovered_says_so_and_the_section_is_written(tmp_path: Path):
    headers, rows = bench.table([case(None, [])])
    row = dict(zip(headers, rows[0], strict=True))
    assert row["rule"] == row["rebuilt s"] == row["first loss after"] == "-"
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    from testnet.bench.report import write_section

    write_section("killstage", bench.section([case("copy+ends", [(20, 3.0)])], True, 12.0), doc)
    text = doc.read_text()
    assert "node bench kill-stage --quick" in text and "| edge stage 0, checkfree+ |" in text
