"""`node logs` folds the progress records: a training node writes one as often as every
2 s (each point of its loss history), and `node logs` showed nothing else."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import cli


def _record(ts: float, msg: str, **extra) -> str:
    return json.dumps({"ts": ts, "level": "info", "logger": "node", "msg": msg, **extra})


def test_progress_records_do_not_bury_the_other_lines(tmp_path: Path):
    lines = [_record(1000.0, "found 12D3x on mDNS")]
    lines += [_record(1000.0 + 2 * i, "progress", event="progress", step=i, loss=2.0)
              for i in range(1, 101)]  # 200 s of progress, one every 2 s
    (tmp_path / "node.log").write_text("\n".join(lines) + "\n")
    r = cli("logs", "--state-dir", str(tmp_path), "-n", "10")
    assert r.returncode == 0, r.stderr
    shown = r.stdout.splitlines()
    assert "found 12D3x on mDNS" in shown[0]
    assert 3 <= sum("progress" in line for line in shown) <= 4  # one a minute
    r = cli("logs", "--state-dir", str(tmp_path), "-n", "10", "--progress")
    assert sum("progress" in line for line in r.stdout.splitlines()) == 10
