"""The scale policies in 32 real node processes (issue 30): the stretched heartbeat
interval, the sender's bound on its own heartbeats, and the 2-entry run document.

32 is the most this 2-core machine carries beside the rest of the suite: at the default
target (50 heartbeats a second in) the interval only stretches past 50 nodes, so these
nodes run `--heartbeat-target 8`, which stretches it to 32 / 8 = 4 s once every view holds
all 32. The per-node message rates beside the simulator's are `node bench sim --real`'s
(docs/simulator.md); here only what holds whatever the machine's load: the interval each
node computes, an upper bound on what it sends, and what the document holds.
"""

from __future__ import annotations

import time

import pytest

from protocols.heartbeat import SLACK
from tests.conftest import answer, nodes, peers, status, wait_until

pytestmark = pytest.mark.slow  # 32 node processes

N = 32
TARGET = 8.0  # heartbeats a second each node receives at most
INTERVAL_S = N / TARGET  # what every node beats at once its view holds the whole swarm


def membership(p) -> dict:
    return status(p).get("membership") or {}


def test_32_nodes_stretch_their_heartbeats_and_keep_two_document_entries_each(
        testnet_factory):
    net = testnet_factory(N, extra_node_args=["--no-train", "--heartbeat-target", f"{TARGET:g}"],
                          timeout=400)
    swarm = nodes(net)
    ids = {answer(p)["peer_id"] for p in swarm}
    assert len(ids) == N
    for p in swarm:
        wait_until(lambda p=p: len(peers(p)) >= N - 1, 300,
                   f"{p.name} to see the other {N - 1} nodes")
        wait_until(lambda p=p: membership(p).get("heartbeat_interval_s") == INTERVAL_S, 120,
                   f"{p.name}'s heartbeat interval to stretch to {INTERVAL_S} s")
        m = membership(p)
        # the inbound bound is a constant, whatever N (protocols/heartbeat.py)
        assert m["inbound_heartbeat_bound_per_s"] == pytest.approx(SLACK * TARGET, abs=0.1)

    # A sender never beats faster than its interval: over a window, at most one beat per
    # interval plus the one under way (trio's sleeps only run long on a loaded machine).
    node1 = swarm[0]
    before, t0 = membership(node1)["heartbeats_sent"], time.monotonic()
    wait_until(lambda: time.monotonic() - t0 >= 2 * INTERVAL_S, 60, "two intervals")
    after = membership(node1)
    assert after["heartbeats_sent"] - before <= (time.monotonic() - t0) / INTERVAL_S + 1

    # The run document: one info entry and last_seen per node, no per-field keys.
    def own_keys() -> dict[str, set[str]]:
        keys: dict[str, set[str]] = {}
        for key in answer(node1, "rundoc"):
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "peer" and parts[1] in ids:
                keys.setdefault(parts[1], set()).add(parts[2])
        return keys

    held = wait_until(lambda: (k := own_keys()) and len(k) == N
                      and all(v == {"info", "last_seen"} for v in k.values()) and k, 120,
                      "node1's document to hold every node's info and last_seen, nothing more")
    assert set(held) == ids
