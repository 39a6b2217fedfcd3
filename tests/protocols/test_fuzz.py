"""The fuzz targets (tests/fuzz/) in CI: every seed and every input that once crashed a
decoder replays under its target's invariant (no atheris needed), and a short, seeded,
fixed-count coverage-guided run of every target finds nothing (needs atheris).

The long run is `python -m tests.fuzz --target all --seconds 60`; docs/robustness.md
records its numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from tests.fuzz import targets

REPO = Path(__file__).resolve().parents[2]
RUNS = 200  # per target: a few seconds for all of them
HAVE_ATHERIS = importlib.util.find_spec("atheris") is not None

#: Inputs that crashed a decoder once (target, input); each was fixed in protocols/.
REGRESSIONS: list[tuple[str, bytes]] = [
    # records.decode: a body whose addrs (or runs) is not a list raised TypeError, which
    # the DHT validator (node/membership/records.py) does not catch. Found by the fuzzer in 4 s.
    ("records", msgpack.packb({"seq": 1, "body": {"addrs": 5, "runs": []}, "sig": bytes(64)})),
    ("records", msgpack.packb({"seq": 1, "body": {"addrs": [], "runs": None}, "sig": b""})),
]


@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_seeds_replay_under_each_targets_invariant(name: str) -> None:
    seeds = targets.seeds(name)
    assert seeds
    for seed in seeds:
        targets.run(name, seed)


@pytest.mark.parametrize(("name", "data"), REGRESSIONS)
def test_inputs_that_once_crashed_are_refused(name: str, data: bytes) -> None:
    targets.run(name, data)


@pytest.mark.skipif(
    not HAVE_ATHERIS,
    reason="atheris is not installed (pip install -e '.[test]' on Linux): "
    "the coverage-guided fuzz run is skipped",
)
def test_a_short_seeded_fuzz_run_of_every_target_finds_no_crash(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz", "--target", "all", "--runs", str(RUNS),
         "--seed", "1", "--artifacts", str(tmp_path), "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["target"] for r in results] == list(targets.TARGETS)
    for r in results:
        assert r["executions"] == RUNS and not r["crash"], r
        assert r["cov"] > 0, r
