"""Smoke tests of `node bench join|pull|partition --quick`: each runs end to end and writes
its table into the benchmarks document (no assertion on speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testnet import netns
from testnet.bench import join, partition, pull

pytestmark = pytest.mark.slow  # each bench starts a testnet


def test_join_bench_writes_its_phases(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    join.main(quick=True, doc=doc)
    text = doc.read_text()
    assert "<!-- bench:join:start -->" in text
    assert "| joiner | start-up | connect | discover | sync state | find providers |" in text
    row = next(line for line in text.splitlines() if line.startswith("| join1 |"))
    assert "providers" in row  # the joiner downloaded a checkpoint before its first step


def test_pull_bench_compares_one_and_three_providers(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    pull.main(quick=True, doc=doc)
    text = doc.read_text()
    assert "<!-- bench:pull:start -->" in text
    assert "| loopback | 1 | 16 |" in text and "| loopback | 3 | 16 |" in text


def test_partition_bench_measures_a_heal(tmp_path: Path):
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    doc = tmp_path / "benchmarks.md"
    partition.main(quick=True, doc=doc)
    text = doc.read_text()
    assert "<!-- bench:partition:start -->" in text
    assert "| split s | steps during split" in text and "\n| 5 |" in text
