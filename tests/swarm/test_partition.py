"""Partition and heal with real node processes in network namespaces (testnet/netns.py).

Both halves keep training while split; after the heal the run documents converge and a DHT
lookup from one half finds a provider record published by the other half during the split.
Needs root and iproute2; skipped (with the reason) otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testnet import launcher, netns
from testnet.observe import holds, union
from tests.conftest import REPO, answer, cli, members, nodes, peers, status, wait_until


def stamps(p: launcher.Proc) -> dict[str, list]:
    return status(p, "rundoc")


def step(p: launcher.Proc) -> int:
    return (status(p).get("training") or {}).get("step", 0)


def live_peers(p: launcher.Proc) -> set[str]:
    return {q["peer_id"] for q in peers(p)}






@pytest.fixture
def namespaces_available() -> None:
    reason = netns.available()
    if reason:
        pytest.skip(reason)


@pytest.mark.slow  # a namespaced testnet of 4 nodes
def test_split_halves_keep_training_and_converge_after_heal(
    namespaces_available, testnet_factory, tmp_path
):
    net = testnet_factory(4, manifest=launcher.scenario_manifest_path("partition"), netns=True,
                          timeout=180)
    tag = net.netns["tag"]
    trainers = nodes(net)
    ids = {p.name: answer(p)["peer_id"] for p in net.procs}
    for p in trainers:
        wait_until(
            lambda p=p: len(members(p)) == 3 and step(p) > 0,
            240,
            f"{p.name} to train and list 3 members",
        )

    r = cli("testnet", "partition", "--dir", net.dir)
    assert r.returncode == 0, r.stderr
    assert "bootstrap node1 node2  |  node3 node4" in r.stderr
    split_ms = time.time_ns() // 1_000_000
    a, b = trainers[:2], trainers[2:]
    at_split = {p.name: step(p) for p in trainers}
    for side, other in ((a, b), (b, a)):
        far = {ids[q.name] for q in other}
        for p in side:
            wait_until(
                lambda p=p, far=far: live_peers(p) and not live_peers(p) & far,
                60,
                f"{p.name} to lose the other half",
            )
    # Both halves keep training: two more outer rounds (H = 20) on every node.
    for p in trainers:
        wait_until(lambda p=p: step(p) >= at_split[p.name] + 40, 240, f"{p.name} to train on")

    def new_checkpoint_in_b() -> str | None:
        for p in b:
            cid = (status(p).get("training") or {}).get("last_checkpoint")
            stamp = stamps(p).get(f"peer/{ids[p.name]}/ckpt/{cid}")
            if cid and stamp and stamp[0] > split_ms:
                return cid, f"peer/{ids[p.name]}/ckpt/{cid}"
        return None

    cid_b, key_b = wait_until(new_checkpoint_in_b, 240, "half B to checkpoint during the split")
    assert key_b not in answer(a[0], "rundoc")  # the split is real for the run document

    snapshot = union([answer(p, "rundoc") for p in trainers])
    r = cli("testnet", "heal", "--dir", net.dir)
    assert r.returncode == 0, r.stderr
    healed = time.monotonic()
    wait_until(
        lambda: all(holds(stamps(p), snapshot) for p in trainers),
        120,
        "every run document to hold what both halves wrote",
    )
    converged_s = time.monotonic() - healed
    for p in trainers:
        others = {ids[q.name] for q in trainers if q is not p}
        wait_until(lambda p=p, o=others: live_peers(p) == o, 60, f"{p.name} to see all 3 peers")
    print(f"run documents converged {converged_s:.1f} s after the heal")

    # The DHT is whole again: entering it through node1 (half A) finds half B's provider
    # record of a checkpoint published during the split, and the pull gets it from B.
    node1 = a[0]
    addr = json.loads((Path(node1.state_dir) / "addrs.json").read_text())["addrs"][0]
    topo = launcher.topology(net)
    assert topo is not None
    probe = subprocess.run(
        [
            *topo.exec_prefix("node1"),
            sys.executable,
            "-m",
            "cli",
            "ckpt",
            "pull",
            cid_b,
            "--bootstrap",
            addr,
            "--state-dir",
            str(tmp_path / "probe"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )
    assert probe.returncode == 0, probe.stderr
    providers = set(json.loads(probe.stdout)["providers"])
    assert providers and providers <= {ids[q.name] for q in b}

    launcher.down(Path(net.dir))
    assert netns.existing(tag) == []


def test_without_root_the_reason_is_given(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "root" in (netns.available() or "")


def test_partition_needs_a_namespaced_testnet(tmp_path):
    net = launcher.Testnet(str(tmp_path), "run", "", [], True, 0)
    with pytest.raises(launcher.TestnetError, match="--scenario partition"):
        launcher.partition(net)
