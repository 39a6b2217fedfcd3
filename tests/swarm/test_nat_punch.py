"""Hole punching through real NATs (nftables in network namespaces, testnet/nat.py): two
nodes behind home-router NATs end on a punched direct connection and average over it;
two behind symmetric NATs try, fail, and train together through the relays of the run's
public nodes. Needs root and nftables; skipped with the reason otherwise. The loopback
tests of the same service are in test_punch.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from testnet import launcher, netns
from tests.conftest import answer, status, training, wait_until


def paths(p: launcher.Proc) -> dict[str, dict]:
    return (status(p).get("peer_paths") or {}).get("peers") or {}


def punch(p: launcher.Proc) -> dict:
    return status(p).get("punch") or {}


@pytest.mark.slow  # a bootstrap and two home-NAT nodes, each a process in its namespace
def test_two_home_nat_nodes_punch_through_and_average_over_the_punched_path(
        nat_available, testnet_factory):
    # node1 and node2 sit behind home routers (port-preserving, unsolicited packets
    # dropped silently); each reaches the other first through the bootstrap's relay. The
    # lower peer id drives the punch; they average only with each other.
    net = testnet_factory(2, timeout=180, nat={"node1": "home", "node2": "home"},
                          neighbours={"node1": ["node2"]})
    topo = launcher.topology(net)
    assert topo is not None
    _, n1, n2 = net.procs
    ids = {p.name: answer(p)["peer_id"] for p in net.procs}
    driver, other = (n1, n2) if ids["node1"] < ids["node2"] else (n2, n1)

    for p, q in ((n1, n2), (n2, n1)):
        wait_until(lambda p=p, q=q: paths(p).get(ids[q.name], {}).get("path") == "punched",
                   240, f"{p.name} to reach {q.name} on a punched connection")
    # the path shows `punched` from the moment the connection appears; the session
    # finishes (and counts) a moment later
    wait_until(lambda: punch(driver).get("punched", 0) >= 1, 60, "the driver's punch to end")
    wait_until(lambda: punch(other).get("answered", 0) >= 1, 60, "the other side's answer")
    assert punch(other)["attempts"] == 0
    # an averaging round over the punched path, after it was punched
    before = {p.name: training(p).get("rounds_averaged", 0) for p in (n1, n2)}
    for p, q in ((n1, n2), (n2, n1)):
        wait_until(lambda p=p: training(p).get("rounds_averaged", 0) > before[p.name], 300,
                   f"{p.name} to average over the punched path")
        assert training(p)["last_partner"] == ids[q.name]
        assert paths(p)[ids[q.name]]["path"] == "punched"
    wait_until(lambda: paths(driver).get(ids[other.name], {}).get("rtt_ms") is not None, 60,
               "an RTT over the punched path")

    launcher.down(Path(net.dir))
    assert netns.existing(topo.tag) == []


def relay(p: launcher.Proc) -> dict:
    return status(p).get("relay") or {}


@pytest.mark.slow  # a bootstrap, a public node and two symmetric-NAT nodes, each a process
def test_two_symmetric_nat_nodes_fail_to_punch_and_train_together_through_relays(
        nat_available, testnet_factory):
    # node1 and node2 average only with each other (fixed neighbours); neither can be
    # dialed (a symmetric NAT drops unsolicited packets and cannot be punched): they try,
    # fail, and every round goes through a circuit that the public nodes (bootstrap, node3)
    # relay.
    net = testnet_factory(3, timeout=180, nat={"node1": "symmetric", "node2": "symmetric"},
                          neighbours={"node1": ["node2"]})
    topo = launcher.topology(net)
    assert topo is not None
    boot, n1, n2, n3 = net.procs
    ids = {p.name: answer(p)["peer_id"] for p in net.procs}
    public = {ids["bootstrap"], ids["node3"]}
    driver, other = (n1, n2) if ids["node1"] < ids["node2"] else (n2, n1)

    for p in (n1, n2):  # private, and a reservation on each of the two public nodes
        wait_until(lambda p=p: (status(p).get("reach") or {}).get("reachability") == "private",
                   120, f"{p.name} private")
        wait_until(lambda p=p: set(relay(p).get("reservations") or {}) == public, 120,
                   f"{p.name}'s reservations on both public nodes")
        addrs = answer(p)["addrs"]
        for relay_id in public:
            assert any(f"/p2p/{relay_id}/p2p-circuit/p2p/{ids[p.name]}" in a for a in addrs)
    # the public nodes relay; a private one does not
    assert relay(boot)["serving"] is not None and relay(n1)["serving"] is None

    # The punch is tried by the lower peer id, fails, and is tried again later, not given
    # up. The status may be read after the 30 s backoff ran out (a loaded machine delays
    # the read, not the timer), so a second attempt may be under way by then: the backoff
    # arithmetic itself is tested on trio's clock in tests/node/reach/test_punch.py.
    wait_until(lambda: punch(driver).get("failed", 0) >= 1, 240,
               f"{driver.name}'s first punch to fail")
    peer = punch(driver)["peers"][ids[other.name]]
    assert ((peer["state"] == "retrying" and 0 <= peer["retry_in_s"] <= 30)
            or (peer["state"] == "punching" and peer["attempts"] >= 2)), peer
    assert "no dial" in (peer["error"] or ""), peer
    assert punch(other)["attempts"] == 0
    assert status(driver)["phase"] == "running"

    # They reach each other only through a relay, and train together.
    for p, q in ((n1, n2), (n2, n1)):
        wait_until(lambda p=p: (training(p).get("rounds_averaged", 0) >= 2),
                   300, f"{p.name} to average twice with {q.name}")
        path = relay(p)["paths"].get(ids[q.name], "")
        assert path.startswith("relayed via ") and path[len("relayed via "):] in public, path
        assert training(p)["last_partner"] == ids[q.name]
    served = [relay(p)["serving"] for p in (boot, n3)]
    assert sum(s["bytes_relayed"] for s in served) > 0
    assert sum(s["circuits_total"] for s in served) >= 1

    launcher.down(Path(net.dir))
    assert netns.existing(topo.tag) == []
