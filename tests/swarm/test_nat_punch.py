"""Hole punching through real NATs (nftables in network namespaces, testnet/nat.py): two
nodes behind home-router NATs end on a punched direct connection and average over it;
two behind symmetric NATs try, fail and stay relayed. Needs root and nftables; skipped
with the reason otherwise. The loopback tests of the same service are in test_punch.py."""

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


@pytest.mark.slow  # a bootstrap and two symmetric-NAT nodes, each a process
def test_two_symmetric_nat_nodes_try_to_punch_fail_and_stay_relayed(nat_available,
                                                                     testnet_factory):
    net = testnet_factory(2, timeout=180, extra_node_args=["--no-train"],
                          nat={"node1": "symmetric", "node2": "symmetric"},
                          neighbours={"node1": ["node2"]})
    topo = launcher.topology(net)
    assert topo is not None
    _, n1, n2 = net.procs
    ids = {p.name: answer(p)["peer_id"] for p in net.procs}
    driver, other = (n1, n2) if ids["node1"] < ids["node2"] else (n2, n1)

    wait_until(lambda: punch(driver).get("failed", 0) >= 1, 240,
               f"{driver.name}'s first punch to fail")
    st = punch(driver)
    peer = st["peers"][ids[other.name]]
    assert peer["state"] == "retrying" and peer["retry_in_s"] > 0, peer
    assert "no dial" in (peer["error"] or ""), peer
    assert punch(other)["attempts"] == 0
    for p, q in ((n1, n2), (n2, n1)):
        path = paths(p)[ids[q.name]]["path"]
        assert path == f"relayed via {ids['bootstrap']}", path
    assert status(driver)["phase"] == "running"

    launcher.down(Path(net.dir))
    assert netns.existing(topo.tag) == []
