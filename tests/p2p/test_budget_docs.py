"""docs/robustness.md lists every budget limit and score setting with its default."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from p2p.budget import BudgetLimits
from p2p.scores import DEFAULT_PENALTIES, ScoreSettings

DOC = (Path(__file__).resolve().parents[2] / "docs" / "robustness.md").read_text()


def test_every_limit_and_setting_is_documented():
    for f in fields(BudgetLimits):
        assert f"`{f.name}`" in DOC, f.name
    for f in fields(ScoreSettings):
        if f.name != "penalties":
            assert f"`{f.name}`" in DOC, f.name
    for kind, penalty in DEFAULT_PENALTIES.items():
        assert f"| `{kind}` | {penalty:g} |" in DOC, kind
