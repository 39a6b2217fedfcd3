"""Integration: real node processes on loopback converge on membership and survive churn."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from node.status.control import query_control
from testnet import launcher
from tests.conftest import run_cli, wait_until


def peers_of(proc: launcher.Proc) -> set[str]:
    try:
        st = query_control(Path(proc.state_dir))
        return {p["peer_id"] for p in (st.get("membership") or {}).get("peers", [])}
    except Exception:
        return set()


def ids(net: launcher.Testnet) -> dict[str, str]:
    return {p.name: query_control(Path(p.state_dir))["peer_id"] for p in net.procs}


def test_four_nodes_see_each_other_then_down_leaves_nothing(testnet_factory):
    net = testnet_factory(4, extra_node_args=["--no-train"])
    nodes = [p for p in net.procs if p.name != "bootstrap"]
    peer_ids = ids(net)
    started = time.monotonic()
    for p in nodes:
        others = {peer_ids[q.name] for q in nodes if q is not p}
        wait_until(lambda p=p, o=others: peers_of(p) == o, 20, f"{p.name} to list 3 peers")
    assert time.monotonic() - started < 20

    # `node testnet status --json` and `node status --json` agree with the control endpoint.
    r = run_cli("testnet", "status", "--json", "--dir", net.dir)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["run"] == net.run_id
    assert {row["name"] for row in doc["processes"]} == {p.name for p in net.procs}
    r = run_cli("status", "--json", "--state-dir", nodes[0].state_dir)
    st = json.loads(r.stdout)
    assert st["run"] == net.run_id and st["phase"] == "running"
    assert st["run_name"] == "testnet-default"

    pids = [p.pid for p in net.procs]
    assert launcher.down(Path(net.dir)) == 5
    assert not any(launcher.alive(pid) for pid in pids)


def test_sigkilled_node_leaves_views_and_comes_back_with_same_id(testnet_factory):
    net = testnet_factory(3, extra_node_args=["--no-train"])
    peer_ids = ids(net)
    victim = peer_ids["node3"]
    survivors = [p for p in net.procs if p.name in ("node1", "node2")]
    for p in survivors:
        wait_until(lambda p=p: victim in peers_of(p), 20, f"{p.name} to see node3")

    launcher.kill_node(net, "node3", signal.SIGKILL)
    killed_at = time.monotonic()
    for p in survivors:
        wait_until(lambda p=p: victim not in peers_of(p), 15, f"{p.name} to drop node3")
    # Bounded by the peer TTL (5 s) plus a heartbeat and a status poll.
    assert time.monotonic() - killed_at < 10

    launcher.restart_node(net, "node3")
    node3 = next(p for p in net.procs if p.name == "node3")
    wait_until(lambda: launcher._phase(node3) == "running", 30, "node3 to rejoin")
    assert query_control(Path(node3.state_dir))["peer_id"] == victim
    for p in survivors:
        wait_until(lambda p=p: victim in peers_of(p), 20, f"{p.name} to see node3 again")


def test_ctrl_c_and_sigterm_stop_a_node_quietly(testnet_factory):
    net = testnet_factory(1, extra_node_args=["--no-train"])
    node = next(p for p in net.procs if p.name == "node1")
    os.killpg(node.pid, signal.SIGINT)
    wait_until(lambda: not launcher.alive(node.pid, node.state_dir), 10, "node1 to exit")
    output = (Path(node.state_dir) / "stdout.log").read_text()
    assert "Traceback" not in output
    assert "shutting down" in output
