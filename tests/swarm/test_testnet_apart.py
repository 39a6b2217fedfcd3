"""Two testnets on one machine stay apart (real processes on loopback).

Seen: every `node testnet up` with the default manifest had one run-id and advertised on
loopback mDNS, so testnets of two directories merged: their nodes caught up with and
averaged with strangers. Here each testnet's nodes hear the other's on mDNS (the
machine's loopback is shared) and still list only their own testnet as the run, and a
joiner given only a run-id (no bootstrap: mDNS finds the peers) joins that run alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testnet import launcher
from tests.conftest import REPO, answer, nodes, peers, status, wait_until

pytestmark = pytest.mark.slow  # starts two testnets


def test_two_testnets_on_one_machine_stay_apart(testnet_factory):
    args = ["--no-train", "--mdns"]  # (the tests' config file turns mDNS off)
    a = testnet_factory(2, name="a", extra_node_args=args, timeout=120)
    b = testnet_factory(2, name="b", extra_node_args=args, timeout=120)
    assert a.run_id != b.run_id
    ids = {net.dir: {answer(p)["peer_id"] for p in nodes(net)} for net in (a, b)}
    for net, other in ((a, b), (b, a)):
        for p in nodes(net):
            mine = ids[net.dir] - {answer(p)["peer_id"]}
            wait_until(lambda p=p, o=other: ids[o.dir] <= set(
                (status(p).get("mdns") or {}).get("other_runs", [])), 60,
                f"{p.name} of {net.dir} to hear the other testnet on mDNS")
            wait_until(lambda p=p, m=mine: {e["peer_id"] for e in peers(p)} >= m, 60,
                       f"{p.name} to list its own testnet")
            assert not {e["peer_id"] for e in peers(p)} & ids[other.dir]
            assert answer(p)["run"] == net.run_id

    # The route by which testnets merged: a joiner that finds both on mDNS.
    joiner = launcher.Proc("joiner", str(Path(a.dir).parent / "joiner"), 0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "join", a.run_id, "--no-train", "--mdns", "--device",
         "cpu", "--no-metrics", "--listen", launcher.LOOPBACK, "--state-dir", joiner.state_dir],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: status(joiner).get("phase") == "running" or proc.poll() is not None,
                   120, "the run-id-only joiner to run")
        assert proc.poll() is None, f"the joiner exited {proc.returncode}"
        wait_until(lambda: {e["peer_id"] for e in peers(joiner)} >= ids[a.dir], 60,
                   "the joiner to list the testnet of its run")
        assert not {e["peer_id"] for e in peers(joiner)} & ids[b.dir]
        assert answer(joiner)["run"] == a.run_id
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
