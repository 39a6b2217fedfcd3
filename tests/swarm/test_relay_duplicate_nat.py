"""Duplicate relayed connections behind real NATs (issue 26, item 6): two peers behind
symmetric NATs (nftables, testnet/nat.py), both reserved on one public relay, dial each
other's relayed address at the same moment, again and again: every dial a new relayed
connection beside the ones open, each carrying a stream of echoed data. Each keeps its
own connection to the relay (the same one, open) and its reservation, and the relay
keeps bringing circuits. A capture on the relay's WAN link (SYN, FIN, RST) is printed.

The issue saw a node close its connection to the relay within 0.5 s of such a dial. Here
the old code lost a relay link in up to 1 run in 3 (docs/nat.md), always at the first
dial after py-libp2p's grace period, when both swarms trim the duplicates and the relay
ends their circuits together: it cancelled a circuit's other direction in the middle of
a Yamux frame write on the relay link, the frame's Noise nonce was spent but the frame
not sent, and the peer behind it failed to decrypt the next message and closed the link
(p2p/muxer.py; tests/p2p/test_muxer.py is the deterministic form). The loopback form of
this scenario is tests/test_relay_duplicate.py. Needs root and nftables; skipped with
the reason otherwise. One process per namespace (testnet/relaydup.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testnet import nat, netns
from tests.conftest import REPO, wait_until

# 3 dials in a burst, 57 more once py-libp2p's grace period is over, every 0.3 s; the
# grace period set to 1 s (testnet/relaydup.py): the old code failed 2 runs in 6 so,
# 1 in 11 with the real 20 s and no data (docs/nat.md)
ROUNDS = 60
KNOBS = {"RELAYDUP_GRACE": "2", "RELAYDUP_ROUND": "0.3"}


def _spawn(topo: netns.Topology, name: str, args: list[str], d: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **KNOBS}
    return subprocess.Popen([*topo.exec_prefix(name), sys.executable, "-m", "testnet.relaydup",
                             *args], cwd=REPO, env=env, stdout=open(d / f"{name}.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _capture(topo: netns.Topology, d: Path) -> subprocess.Popen | None:
    """tcpdump on the relay's WAN link: SYN, FIN and RST segments only (None without it)."""
    if shutil.which("tcpdump") is None:
        return None
    return subprocess.Popen([*topo.exec_prefix("relay"), "tcpdump", "-i", "eth0", "-n", "-l",
                             "-U", "tcp[tcpflags] & (tcp-syn|tcp-fin|tcp-rst) != 0"],
                            stdout=open(d / "capture.txt", "wb"), stderr=subprocess.DEVNULL,
                            start_new_session=True)


@pytest.mark.slow  # a relay and two symmetric-NAT peers, each a process in its namespace
def test_simultaneous_duplicate_relayed_dials_keep_both_relay_links(nat_available, tmp_path):
    tag = netns.tag_for(str(tmp_path))
    topo = nat.create(tag, ["relay", "a", "b"], {"a": "symmetric", "b": "symmetric"},
                      workdir=str(tmp_path))
    procs: list[subprocess.Popen] = []
    cap = None
    try:
        cap = _capture(topo, tmp_path)
        procs.append(_spawn(topo, "relay", ["relay", str(tmp_path), topo.listen("relay")],
                            tmp_path))
        for me, other in (("a", "b"), ("b", "a")):
            procs.append(_spawn(topo, me, ["peer", str(tmp_path), topo.listen(me), me, other,
                                           str(ROUNDS)], tmp_path))
        wait_until(lambda: all((tmp_path / f"{n}.addr").exists() for n in "ab"), 60,
                   "both peers to reserve on the relay")
        (tmp_path / "go").write_text(f"{time.time() + 1.0}")
        wait_until(lambda: all((tmp_path / f"{n}.json").exists() for n in "ab"), 100,
                   "both peers to finish their dials")
        (tmp_path / "stop").write_text("")
        wait_until(lambda: (tmp_path / "relay.json").exists(), 30, "the relay's statistics")
        results = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab"}
        served = json.loads((tmp_path / "relay.json").read_text())
        print((tmp_path / "capture.txt").read_text()[-4000:] if cap is not None else "")
    finally:
        (tmp_path / "stop").write_text("")
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        if cap is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cap.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                cap.wait(timeout=5)
        netns.destroy(topo)
    assert netns.existing(tag) == []

    for name, r in results.items():
        rounds = r["rounds"]
        assert len(rounds) == ROUNDS, (name, r)
        bad = [x for x in [*rounds, r["settled"]]
               if not (x["link_same"] and x["link_open"] and x["held"])]
        assert not bad, (name, bad, r)
        # every dial of the burst got a circuit (a duplicate of the connection open);
        # later ones may be refused at the relay's circuits_per_peer (4), nothing else
        assert all(x["error"] is None for x in rounds[:3]), (name, r)
        assert all(x["error"] is None or "RESOURCE_LIMIT_EXCEEDED" in x["error"]
                   for x in rounds), (name, r)
        assert max(x["to_other"] for x in rounds) >= 4, (name, r)  # duplicates were open
        assert r["relay_error"] is None and r["restarts"] == 0, (name, r)
    # the relay still holds both slots, and never refused the peers for their circuits
    assert served["reservations"].keys() >= {results[n]["peer_id"] for n in "ab"}, served
