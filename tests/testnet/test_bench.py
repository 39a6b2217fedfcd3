"""Benchmark plumbing (no timing assertions): sections are rewritten in place, and the
throughput path moves and verifies real frames between two processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from testnet.bench.p2p import throughput_once
from testnet.bench.report import write_section


def test_sections_are_replaced_not_duplicated(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    write_section("a", "first", doc)
    write_section("b", "other", doc)
    write_section("a", "second", doc)
    text = doc.read_text()
    assert "second" in text and "first" not in text and "other" in text
    assert text.count("<!-- bench:a:start -->") == 1


@pytest.mark.slow  # two libp2p host processes
def test_two_process_throughput_path_runs(tmp_path: Path):
    result = throughput_once("libp2p", 2, tmp_path)
    assert result["mb_s"] > 0 and result["recv_cpu"] > 0
