"""Interop with a real third-party peer: js-libp2p dials a peertrain node, pings it, reads
its signed DHT record over peertrain's own DHT protocol, and receives its gossip."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from node.control import query_control
from protocols import heartbeat, records

JS = Path(__file__).parent / "interop" / "js"
pytestmark = pytest.mark.interop


def js_peer_ready() -> None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node.js or npm is not installed: the js-libp2p interop test cannot run")
    if not (JS / "node_modules" / "libp2p").exists():
        # A failing install with npm present is a failure, not a skip.
        r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"],
                           cwd=JS, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"npm install failed:\n{r.stdout}\n{r.stderr}"


def test_js_libp2p_peer_pings_reads_dht_and_gets_gossip(testnet_factory):
    js_peer_ready()
    net = testnet_factory(1, extra_node_args=["--no-train"])
    node = next(p for p in net.procs if p.name == "node1")
    st = query_control(Path(node.state_dir))
    r = subprocess.run(["node", "--import", "./polyfill.mjs", "peer.mjs", st["addrs"][0],
                        st["peer_id"], net.run_id], cwd=JS, capture_output=True, text=True,
                       timeout=90)
    steps = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            steps[doc["step"]] = doc
    assert set(steps) == {"connect", "ping", "dht-get", "gossip"}, r.stdout + r.stderr
    assert all(s["ok"] for s in steps.values()), json.dumps(steps, indent=1) + r.stderr
    assert steps["connect"]["remote"] == st["peer_id"]
    # The record js fetched verifies with peertrain's own decoder (signed by the node).
    key = steps["dht-get"]["key"]
    record = records.decode(key, bytes.fromhex(steps["dht-get"]["value"]))
    assert record.peer_id == st["peer_id"] and net.run_id in record.runs
    beat = heartbeat.decode(bytes.fromhex(steps["gossip"]["data"]), steps["gossip"]["from"])
    assert beat.peer == st["peer_id"]
