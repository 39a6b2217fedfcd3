"""`node testnet add-node`: one more node on a running testnet, recorded in testnet.json,
listed by `status`, stopped by `down`; a pipeline joiner's stage checked, not imposed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testnet import launcher
from tests.conftest import REPO, wait_until
from tests.testnet.test_testnet_guard import _sleeper


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "testnet", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_add_node_names_afresh_and_checks_a_pipeline_stage(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(launcher, "_spawn", _sleeper)
    monkeypatch.setattr(launcher, "_phase", lambda p: "running")
    net = launcher.up(tmp_path / "tn", 2, detached=True, extra_node_args=["--no-train"])
    try:
        counts = [2, 1, 2]  # a 3x2 pipeline that lost a stage-1 replica
        monkeypatch.setattr(launcher, "stage_counts", lambda net: counts)
        with pytest.raises(launcher.TestnetError, match=r"--stage 2: a joiner takes the stage "
                           r"with the fewest live hosts, stage 1 \(1 hosts\) now"):
            launcher.grow(net, 2)
        with pytest.raises(launcher.TestnetError, match="this pipeline has stages 0 to 2"):
            launcher.grow(net, 3)
        proc, takes = launcher.grow(net, 1)
        assert (proc.name, takes) == ("node3", 1)
        assert proc.args[-1] == "--no-train"  # as `up` started the others
        assert launcher.grow(net)[0].name == "node4"
        saved = launcher.Testnet.load(tmp_path / "tn")
        assert saved is not None and [p.name for p in saved.procs][-2:] == ["node3", "node4"]
        monkeypatch.setattr(launcher, "stage_counts", lambda net: None)
        with pytest.raises(launcher.TestnetError, match="no node of this testnet hosts a "
                           "pipeline stage"):
            launcher.grow(net, 0)
    finally:
        assert launcher.down(tmp_path / "tn") == 5
    with pytest.raises(launcher.TestnetError, match="no testnet running in"):
        launcher.grow(net)  # testnet.json gone with `down`: what `grow` reads afresh
    got = cli("add-node", "--dir", str(tmp_path / "none"))
    assert got.returncode == 1 and "no testnet in" in got.stderr
    assert len(got.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_node_added_to_a_running_testnet_is_listed_and_stopped_with_it(testnet_factory,
                                                                          tmp_path: Path):
    net = testnet_factory(1, extra_node_args=["--no-train"])
    got = cli("add-node", "--dir", net.dir, "--json")
    assert got.returncode == 0, got.stderr
    added = json.loads(got.stdout)
    assert added["name"] == "node2" and added["stage"] is None

    def running() -> list[str]:
        doc = json.loads(cli("status", "--dir", net.dir, "--json").stdout)
        return [r["name"] for r in doc["processes"]
                if (r.get("status") or {}).get("phase") == "running"]
    wait_until(lambda: running() == ["bootstrap", "node1", "node2"], 120,
               "node2 to join the run")
    procs = launcher.Testnet.load(Path(net.dir)).procs
    assert cli("down", "--dir", net.dir).returncode == 0
    assert not any(launcher.alive(p.pid, p.state_dir) for p in procs)
