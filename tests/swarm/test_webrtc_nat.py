"""WebRTC between two NATed peers in network namespaces: each behind its own home-router
NAT (port-preserving masquerade that drops unsolicited packets), a public peer on the WAN
that relays and answers STUN. The two reach each other first through the relay, then over
a WebRTC data channel whose ICE pair comes from the run's STUN; an averaging round
exchanges a tensor over it and a bulk payload measures its rate
(testnet/bench/webrtc_pair.py does the peers' side). Two symmetric NATs get no ICE pair:
the relay stays their path, with the reason. Needs root and nftables; skipped otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testnet import nat, netns
from tests.conftest import REPO, answer, run_cli, status, wait_until


def _run_pair(tmp_path: Path, kind: str, mb: int, ice_timeout: float,
              rate: str | None = None, rtt_ms: float | None = None) -> dict[str, dict]:
    """Run the three peers (also the measurement: /tmp scripts call it with a rate)."""
    tag = netns.tag_for(str(tmp_path))
    topo = nat.create(tag, ["pub", "a", "b"], {"a": kind, "b": kind}, workdir=str(tmp_path),
                      rate=rate, rtt_ms=rtt_ms)
    procs: list[subprocess.Popen] = []
    try:
        def peer(name: str, *extra: str) -> None:
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
            procs.append(subprocess.Popen(
                [*topo.exec_prefix(name), sys.executable, "-m", "testnet.bench.webrtc_pair",
                 "--listen", f"/ip4/{topo.ip(name)}/tcp/4001", "--dir", str(tmp_path),
                 "--ice-timeout", str(ice_timeout), *extra],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT))

        peer("pub", "--role", "public")
        peer("a", "--role", "private", "--name", "a", "--other", "b", "--mb", str(mb))
        peer("b", "--role", "private", "--name", "b", "--other", "a", "--mb", str(mb))
        results = {}
        for name in ("a", "b"):
            path = tmp_path / f"{name}.json"
            wait_until(lambda path=path: path.exists() or any(
                p.poll() not in (None, 0) for p in procs), 240, f"{name}'s result")
            assert path.exists(), (tmp_path / f"{name}.log").read_text()[-3000:]
            results[name] = json.loads(path.read_text())
        return results
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        netns.destroy(topo)
        assert netns.existing(tag) == []


@pytest.mark.slow  # three peer processes in namespaces behind NAT gateways
def test_two_home_nat_peers_open_a_data_channel_through_the_runs_stun_and_average(
    nat_available, tmp_path
):
    results = _run_pair(tmp_path, "home", mb=16, ice_timeout=20)
    for r in results.values():
        assert r["path"] == "webrtc", r
        assert r["libp2p_path"].startswith("relayed via"), r  # the relay is still there
        assert r["exchange_ok"] and set(r["exchange_bytes"]) == {"webrtc"}, r
        session = next(iter(r["webrtc"]["sessions"].values()))
        # srflx: the address the public peer's STUN told each side (its gateway's WAN side)
        assert "srflx" in (session["pair"] or ""), session
    rates = [r["mb_per_s"] for r in results.values() if "mb_per_s" in r]  # the offerer's
    assert len(rates) == 1 and rates[0] > 0, results
    print(f"webrtc through two home NATs: {rates[0]} MB/s")


@pytest.mark.slow
def test_two_symmetric_nat_peers_find_no_ice_pair_and_keep_the_relay(nat_available, tmp_path):
    results = _run_pair(tmp_path, "symmetric", mb=0, ice_timeout=10)
    for r in results.values():
        assert r["path"].startswith("relayed via"), r
    offering = [r for r in results.values() if r["webrtc"]["offers"]]
    # ICE gives up (aiortc: "connection failed") or our deadline does, whichever is first
    error = offering[0]["error"] if offering else ""
    assert "no ICE pair within 10 s" in error or "connection failed" in error, results


@pytest.mark.slow  # a bootstrap, two home-NAT nodes and a public one: node processes
def test_two_home_nat_nodes_average_over_webrtc_and_status_shows_the_path(
    nat_available, testnet_factory
):
    net = testnet_factory(3, timeout=180, nat={"node1": "home", "node2": "home"},
                          extra_node_args=["--no-punch"],
                          neighbours={"node1": ["node2"]})
    boot, n1, n2, n3 = net.procs
    ids = {p.name: answer(p)["peer_id"] for p in net.procs}
    for p, other in ((n1, n2), (n2, n1)):
        wait_until(lambda p=p, other=other: (status(p).get("webrtc") or {}).get("paths", {})
                   .get(ids[other.name]) == "webrtc", 240, f"{p.name}'s webrtc path")
    for p, other in ((n1, n2), (n2, n1)):
        def over_webrtc(p=p, other=other) -> int:
            partner = ((status(p).get("averaging") or {}).get("partners") or {}).get(
                ids[other.name]) or {}
            return (partner.get("bytes_received") or {}).get("webrtc", 0)
        wait_until(over_webrtc, 300, f"{p.name} to average with {other.name} over webrtc")
    st = answer(n1)
    session = st["webrtc"]["sessions"][ids["node2"]]
    assert session["state"] == "connected" and "srflx" in session["pair"], session
    # the STUN server was one of the public nodes, which answered
    served = sum((answer(p)["webrtc"]["stun"]["answered"]) for p in (boot, n3))
    assert served >= 1
    shown = run_cli("status", "--state-dir", str(n1.state_dir))
    row = next(line for line in shown.stdout.splitlines() if ids["node2"] in line)
    assert "webrtc" in row, shown.stdout + shown.stderr
