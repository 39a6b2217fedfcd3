"""`node join <run-id>` with no --bootstrap: real node processes on a loopback testnet.

The joiner finds the run through the config file (named by PEERTRAIN_CONFIG), then, on
its next start, through the peers it remembered (a dead one among them is logged and
skipped), and a fresh node joins through a ticket from `node run ticket`. mDNS is off in
these tests (--no-mdns): the testnet's own nodes advertise on loopback, and the point here
is each other source alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from node.discovery import remembered
from node.status.control import query_control
from testnet import launcher
from tests.conftest import FAST_RUN, REPO, cli, run_cli, wait_until

DEAD = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWMjaBEkKWfJNw1JoiV6UqwyqrtfienDAHyutXwAgii5RE"


def join(run: str, state: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "join", run, "--no-train", "--no-mdns", "--device", "cpu",
         "--listen", launcher.LOOPBACK, "--state-dir", str(state)],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def phase(state: Path) -> str | None:
    try:
        return query_control(state, timeout=2.0).get("phase")
    except Exception:
        return None


def wait_running(p: subprocess.Popen, state: Path) -> dict:
    wait_until(lambda: phase(state) == "running" or p.poll() is not None, 120,
               "the joiner to run")
    assert p.poll() is None, p.communicate()[1][-3000:]
    return query_control(state)


def stop(p: subprocess.Popen) -> str:
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    return err


@pytest.mark.slow
def test_a_node_joins_by_run_id_from_config_then_remembered_peers_then_a_ticket(
        testnet_factory, tmp_path: Path):
    manifest = tmp_path / "fast.toml"
    manifest.write_text(FAST_RUN)
    net = testnet_factory(1, manifest=manifest, extra_node_args=["--no-train", "--no-mdns"])
    node1 = next(p for p in net.procs if p.name == "node1")
    node1_id = json.loads((Path(node1.state_dir) / "addrs.json").read_text())["peer_id"]
    boot_id = net.bootstrap_addr.rsplit("/p2p/", 1)[1]
    config = tmp_path / "peertrain.toml"
    config.write_text(f'[join]\nbootstrap = ["{net.bootstrap_addr}"]\n')
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    env.pop("PEERTRAIN_BOOTSTRAP", None)
    state = tmp_path / "joiner"

    # 1. the config file names the bootstrap
    p = join(net.run_id, state, {**env, "PEERTRAIN_CONFIG": str(config)})
    try:
        wait_running(p, state)
        peers_file = remembered.path_for(state, net.run_id)
        wait_until(lambda: {boot_id, node1_id} <= {
            e["peer"] for e in remembered.load(state, net.run_id)}, 60,
            "the bootstrap and node1 to be remembered")
    finally:
        err = stop(p)
    assert f"reached 1 peer(s) through the config file {config}" in (state / "node.log").read_text()

    # 2. no flag, no variable, no config: remembered peers (a dead one first is skipped)
    doc = json.loads(peers_file.read_text())
    doc["peers"].insert(0, {"peer": DEAD.rsplit("/", 1)[1], "addrs": [DEAD], "seen": 2e9})
    peers_file.write_text(json.dumps(doc))
    p = join(net.run_id, state, env)
    try:
        st = wait_running(p, state)
        assert st["run"] == net.run_id
        wait_until(lambda: node1_id in [e["peer_id"] for e in (query_control(state).get(
            "membership") or {}).get("peers", [])], 60, "node1 to be heard")
    finally:
        err = stop(p)
    assert f"bootstrap (remembered peers): cannot reach {DEAD}" in err
    assert "through remembered peers" in err

    # 3. a fresh node, given only a ticket from the bootstrap
    r = cli("run", "ticket", net.run_id, "--state-dir", str(Path(net.dir) / "bootstrap"))
    assert r.returncode == 0, r.stderr
    ticket = r.stdout.strip()
    assert ticket.startswith("pt1") and "\n" not in ticket
    fresh = tmp_path / "fresh"
    p = join(ticket, fresh, env)
    try:
        assert wait_running(p, fresh)["run"] == net.run_id
    finally:
        err = stop(p)
    assert "reached 1 peer(s) through the ticket" in err


@pytest.mark.slow
def test_only_dead_remembered_peers_is_a_one_line_error_listing_them(tmp_path: Path,
                                                                     monkeypatch):
    from protocols import manifest as mf

    run = mf.run_id(b"a run nobody serves")
    state = tmp_path / "n"
    state.mkdir()
    remembered.save(state, run, [{"peer": DEAD.rsplit("/", 1)[1], "addrs": [DEAD],
                                  "seen": 2e9}])
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PEERTRAIN_BOOTSTRAP", raising=False)
    r = run_cli("join", run, "--no-mdns", "--listen", launcher.LOOPBACK,
                "--state-dir", str(state))
    assert r.returncode == 3, r.stderr
    assert "no peer answered from remembered peers; trying the next source" in r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert error == ["error: could not reach any bootstrap peer:"]
    assert f"remembered peers: cannot reach {DEAD}: connection refused" in r.stderr
    assert "Traceback" not in r.stderr
