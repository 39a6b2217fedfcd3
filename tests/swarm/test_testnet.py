"""Integration: real node processes on loopback converge on membership and survive churn."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from testnet import launcher
from tests.conftest import answer, cli, nodes, peers, shared_testnet, status, wait_until

pytestmark = pytest.mark.slow  # every test here starts node processes


def peers_of(proc: launcher.Proc) -> set[str]:
    return {p["peer_id"] for p in peers(proc)}


def ids(net: launcher.Testnet) -> dict[str, str]:
    return {p.name: answer(p)["peer_id"] for p in net.procs}


#: Four idle nodes for the two tests below, in this order: node3 is killed and comes back,
#: then all four must see each other before `down` stops them (the fixture's own `down`
#: then finds nothing left).
net = shared_testnet(4, extra_node_args=["--no-train"], timeout=120)


def test_sigkilled_node_leaves_views_and_comes_back_with_same_id(net):
    peer_ids = ids(net)
    victim = peer_ids["node3"]
    survivors = [p for p in net.procs if p.name in ("node1", "node2")]
    for p in survivors:
        wait_until(lambda p=p: victim in peers_of(p), 60, f"{p.name} to see node3")

    node3 = launcher.kill_node(net, "node3", signal.SIGKILL)
    wait_until(lambda: not launcher.alive(node3.pid, node3.state_dir), 30, "node3 to die")
    # Leaving a view takes the peer TTL (5 s) plus a heartbeat on an idle machine; the
    # deadline is for a loaded one (the TTL itself: tests/p2p/test_peerbook.py).
    for p in survivors:
        wait_until(lambda p=p: victim not in peers_of(p), 60, f"{p.name} to drop node3")

    launcher.restart_node(net, "node3")
    node3 = next(p for p in net.procs if p.name == "node3")
    wait_until(lambda: status(node3).get("phase") == "running", 120, "node3 to rejoin")
    assert answer(node3)["peer_id"] == victim
    for p in survivors:
        wait_until(lambda p=p: victim in peers_of(p), 60, f"{p.name} to see node3 again")


def test_four_nodes_see_each_other_then_down_leaves_nothing(net):
    members = nodes(net)
    peer_ids = ids(net)
    # A deadline, not a timed assertion: how fast views converge is a benchmark's business
    # (docs/benchmarks.md), and a loaded 2-core machine is slower than an idle one.
    for p in members:
        others = {peer_ids[q.name] for q in members if q is not p}
        wait_until(lambda p=p, o=others: peers_of(p) == o, 60, f"{p.name} to list 3 peers")

    # `node testnet status --json` and `node status --json` agree with the control endpoint.
    r = cli("testnet", "status", "--json", "--dir", net.dir)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["run"] == net.run_id
    assert {row["name"] for row in doc["processes"]} == {p.name for p in net.procs}
    r = cli("status", "--json", "--state-dir", members[0].state_dir)
    st = json.loads(r.stdout)
    assert st["run"] == net.run_id and st["phase"] == "running"
    assert st["run_name"].startswith("testnet-default.")  # tagged: a run per testnet dir
    # a loopback node never looks for a UPnP gateway: SSDP would multicast off this machine
    assert st["reach"]["upnp"]["state"] == "off (loopback only)"

    pids = [p.pid for p in net.procs]
    assert launcher.down(Path(net.dir)) == 5
    assert not any(launcher.alive(pid) for pid in pids)


def test_ctrl_c_and_sigterm_stop_a_node_quietly(testnet_factory):
    net = testnet_factory(1, extra_node_args=["--no-train"])
    node = next(p for p in net.procs if p.name == "node1")
    os.killpg(node.pid, signal.SIGINT)
    wait_until(lambda: not launcher.alive(node.pid, node.state_dir), 60, "node1 to exit")
    output = (Path(node.state_dir) / "stdout.log").read_text()
    assert "Traceback" not in output
    assert "shutting down" in output
