"""The nat scenario with real node processes behind real NATs (nftables) and a real UPnP
gateway (Debian's miniupnpd) in network namespaces: AutoNAT classification, a UPnP
mapping and a dial through it, a gateway that refuses, and a teardown that leaves nothing.
Two symmetric-NAT nodes training through relays: tests/swarm/test_nat_punch.py.
Needs root, iproute2, nftables and miniupnpd (`.ci/run` installs them); skipped with the
reason otherwise."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testnet import launcher, nat, netns
from tests.conftest import REPO, answer, status, wait_until

DIAL = """
import sys, trio, tempfile, pathlib
from p2p.host import Substrate
from p2p.identity import load_or_create_identity
async def main():
    s = Substrate(load_or_create_identity(pathlib.Path(tempfile.mkdtemp())),
                  ["/ip4/0.0.0.0/tcp/0"])
    async with trio.open_nursery() as n:
        await n.start(s.serve)
        print("connected", await s.connect(sys.argv[1], timeout=20))
        n.cancel_scope.cancel()
trio.run(main)
"""


def reach(p: launcher.Proc) -> dict:
    return status(p).get("reach") or {}


def gateway_rules(topo: netns.Topology, name: str) -> str:
    return subprocess.run(["ip", "netns", "exec", topo.gateway(name), "nft", "list", "chain",
                           "inet", "filter", "prerouting_miniupnpd"],
                          capture_output=True, text=True, timeout=10).stdout


@pytest.mark.slow  # a bootstrap and two NATed nodes, each a process in its namespace
def test_autonat_upnp_mapping_dial_through_it_and_a_gateway_that_refuses(
    upnp_available, testnet_factory
):
    net = testnet_factory(2, extra_node_args=["--no-train"], timeout=180,
                          nat={"node1": "upnp", "node2": "upnp-deny"})
    topo = launcher.topology(net)
    assert topo is not None
    boot, n1, n2 = net.procs
    ids = {p.name: answer(p)["peer_id"] for p in net.procs}

    # The public bootstrap: reached on a fresh connection, so public, DHT server.
    wait_until(lambda: reach(boot).get("reachability") == "public", 120, "bootstrap public")
    assert reach(boot)["dht"] == "server"

    # node1 is behind a NAT; its gateway maps a port; a peer reaches it through the mapping.
    wait_until(lambda: reach(n1).get("via") == "upnp", 120, "node1 public via its mapping")
    r1 = reach(n1)
    mapping = r1["upnp"]["mapping"]
    assert r1["reachability"] == "public" and r1["upnp"]["state"] == "mapped"
    assert mapping.startswith(f"/ip4/{topo.wan_ip('node1')}/tcp/")
    port = mapping.rsplit("/", 1)[1]
    assert f"dport {port} dnat ip to {topo.ip('node1')}:{port}" in gateway_rules(topo, "node1")
    # a fresh host on the WAN (in the bootstrap's namespace) dials node1 at the mapping
    dial = subprocess.run([*topo.exec_prefix("bootstrap"), sys.executable, "-c", DIAL,
                           f"{mapping}/p2p/{ids['node1']}"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert dial.returncode == 0 and f"connected {ids['node1']}" in dial.stdout, dial.stderr

    # node2's gateway refuses: private, DHT client, the reason in status and the log; it runs on.
    wait_until(lambda: reach(n2).get("upnp", {}).get("state") == "failed", 120,
               "node2's mapping to fail")
    r2 = reach(n2)
    assert r2["reachability"] == "private" and r2["dht"] == "client", r2
    assert "the gateway refused to map TCP port" in r2["upnp"]["error"]
    log = (Path(n2.state_dir) / "node.log").read_text()
    assert "the gateway refused to map TCP port" in log and "staying private" in log
    assert status(n2)["phase"] == "running"

    # node1 stops: its mapping is removed from the gateway.
    launcher.kill_node(net, "node1", signal.SIGTERM)
    wait_until(lambda: not launcher.alive(n1.pid, n1.state_dir), 30, "node1 to stop")
    assert f"dport {port}" not in gateway_rules(topo, "node1")
    assert "upnp: removed the mapping" in (Path(n1.state_dir) / "node.log").read_text()

    # down leaves no namespace (nor the miniupnpds and STUN responder that ran in them)
    launcher.down(Path(net.dir))
    assert netns.existing(topo.tag) == []


@pytest.mark.slow  # namespaces and a miniupnpd, no node process
def test_namespaces_a_crashed_launcher_left_are_removed_by_down(upnp_available, tmp_path):
    directory = tmp_path / "tn"
    directory.mkdir()
    tag = netns.tag_for(str(directory))
    # what an `up` killed between creating the namespaces and recording them leaves
    nat.create(tag, ["node1", "node2"], {"node1": "upnp", "node2": "home"},
               workdir=str(directory), detached=True)
    inside = subprocess.run(["ip", "netns", "pids", f"pt-{tag}-node1-gw"], capture_output=True,
                            text=True, timeout=10).stdout.split()
    assert inside, "miniupnpd should run in node1's gateway"
    assert launcher.down(directory) == 0
    assert netns.existing(tag) == []
    for pid in inside:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


ECHO_RTT = """
import socket, sys, time
deadline = time.monotonic() + 20
while True:  # until the server (started just before) listens
    try:
        s = socket.create_connection((sys.argv[1], 7000), timeout=10)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
best = 1e9
for _ in range(5):
    t = time.perf_counter(); s.sendall(b"x"); s.recv(1); best = min(best, time.perf_counter() - t)
print(best * 1000)
"""
ECHO_SERVER = """
import socket
s = socket.create_server(("0.0.0.0", 7000)); c, _ = s.accept()
while (d := c.recv(1)): c.sendall(d)
"""


@pytest.mark.slow  # namespaces and a delay line, no node process
def test_the_delay_line_adds_the_round_trip_time_through_a_nat(upnp_available, tmp_path):
    tag = netns.tag_for(str(tmp_path))
    topo = nat.create(tag, ["a", "b"], {"b": "home"}, rtt_ms=40, rate="100mbit",
                      workdir=str(tmp_path))
    try:
        server = subprocess.Popen([*topo.exec_prefix("a"), sys.executable, "-c", ECHO_SERVER])
        r = subprocess.run([*topo.exec_prefix("b"), sys.executable, "-c", ECHO_RTT,
                            topo.wan_ip("a")], capture_output=True, text=True, timeout=60)
        server.kill()
        server.wait(timeout=10)
        # every packet is held 20 ms each way: no round trip can be shorter than 40 ms
        assert r.returncode == 0 and float(r.stdout) >= 40.0, (r.stdout, r.stderr)
    finally:
        netns.destroy(topo)
    assert netns.existing(tag) == []

