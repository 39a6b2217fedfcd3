"""The kill-stage benchmark's report (testnet/bench/killstage.py) from made-up readings; the
live path it drives is tests/swarm/test_pipeline_edge.py's and
tests/swarm/test_pipeline_live.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from testnet.bench import killstage as bench
from tests.conftest import wait_until


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


def test_the_new_cases_read_30_s_later_the_drops_and_the_rates():
    c = bench.Case("replica", 1, "checkfree", burner=True, load="9.0 / 8.0",
                   before=[(100 + 2 * i, 2.5) for i in range(5)],
                   before_s=[10.0 + i for i in range(5)], rebuilt_s=30.0, rule="copy",
                   first_step_s=31.0, after=[(120, 3.1), (121, 2.9), (130, 2.6), (140, 2.5)],
                   after_s=[31.0, 40.0, 61.0, 71.0], dropped=12)
    headers, rows = bench.table([c])
    row = dict(zip(headers, rows[0], strict=True))
    assert row["case"] == "one replica of stage 1 (3x2), beside `yes`"
    # from 30 s past the first step: the mean of up to 5 readings, as "loss before"
    assert row["first loss after"] == "3.10" and row["loss 30 s after"] == "2.55"
    assert row["micro-batches dropped"] == "12"
    # 8 steps in 4 s; 10 in the 30 s after the first step; 10 in the 10 s from then on
    assert row["steps/s before -> first 30 s -> next 30 s"] == "2.00 -> 0.33 -> 1.00"
    names = {bench.Case(s.kind, s.stage, s.recovery).name for s in bench.SCENARIOS.values()}
    assert {"stage 2 killed twice in a row", "adjacent stages 1 and 2",
            "edge stage 0, checkfree", "edge stage 0, checkfree+"} <= names
    # not 30 s past the first step yet: no reading to show
    c.after, c.after_s = c.after[:2], c.after_s[:2]
    assert dict(zip(headers, bench.table([c])[1][0], strict=True))["loss 30 s after"] == "-"


def test_a_full_run_s_length_is_stated_and_bad_arguments_refused():
    assert 50 <= bench.full_minutes() <= 80
    assert bench.full_minutes(["interior"], ("idle",)) < 5
    with pytest.raises(ValueError, match="unknown case"):
        bench.main(names=["middle"])
    with pytest.raises(ValueError, match="--load"):
        bench.main(load="heavy")


def test_a_case_that_failed_is_a_row_that_says_why():
    c = bench.Case("twice", 2, "checkfree", load="30.1 / 27.0",
                   error="3 of 5 loss readings from the last stage in 90 s before the kill")
    headers, rows = bench.table([c])
    row = dict(zip(headers, rows[0], strict=True))
    assert row["case"] == "stage 2 killed twice in a row"
    assert row["rule"].startswith("failed: 3 of 5") and row["load 1/5 min"] == "30.1 / 27.0"


def test_the_burner_stops_with_its_case():
    """`yes` runs under timeout(1): a SIGKILL ended timeout alone and left `yes` burning
    for 30 minutes, so each case of the burner half ran beside one more of them; a SIGTERM
    to timeout right after its fork (this test, beside a loaded suite) left it for good."""
    with bench.burning(True) as yes:
        assert yes is not None
        children = Path(f"/proc/{yes.pid}/task/{yes.pid}/children")
        child = wait_until(lambda: children.read_text().split(), 10, "timeout to start yes")

    def gone() -> bool:  # exited (a zombie is exited, not yet reaped)
        try:
            return Path(f"/proc/{child[0]}/stat").read_text().split()[2] == "Z"
        except OSError:
            return True

    # a bounded wait: `yes` gets its SIGTERM with timeout(1), not after it (the bugs this
    # guards against left it running for 30 min, or for good)
    wait_until(gone, 10, "yes to stop with its case")
    with bench.burning(False) as none:
        assert none is None
