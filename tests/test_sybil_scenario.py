"""Gossip learning and SybilWall in a real swarm: honest nodes, one attacker with several
identities (real processes on loopback), and hostile history gossip from a raw host."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.status.control import query_control
from testnet import launcher
from tests.conftest import run_cli, wait_until

SYBIL_MANIFEST = launcher.scenario_manifest_path("sybil")
SAMPLES = 3  # aggregations in which both sybils were one honest node's neighbours


def status(p: launcher.Proc) -> dict:
    try:
        return query_control(Path(p.state_dir))
    except Exception:
        return {}


def training(p: launcher.Proc) -> dict:
    return status(p).get("training") or {}


def honest(net: launcher.Testnet) -> list[launcher.Proc]:
    return [p for p in net.procs if p.name.startswith("node")]


def sybil_share(t: dict, sybil_ids: set[str]) -> float | None:
    weights = (t.get("aggregation") or {}).get("weights") or {}
    return sum(w for peer, w in weights.items() if peer in sybil_ids) if weights else None


def test_gossip_learning_with_the_mean_trains_every_node(testnet_factory):
    net = testnet_factory(3, manifest=SYBIL_MANIFEST, aggregator="mean")
    for p in honest(net):
        wait_until(lambda p=p: (t := training(p)).get("rounds_averaged", 0) >= 3
                   and (t.get("val_metrics") or {}).get("accuracy", 0) > 0.5,
                   120, f"{p.name} to aggregate 3 rounds and pass 50% accuracy")
        t = training(p)
        weights = t["aggregation"]["weights"]
        assert "self" in weights and len(weights) >= 2  # its own model and a neighbour's
        assert abs(sum(weights.values()) - 1) < 0.01


def test_sybilwall_down_weights_sybils_and_gossips_signed_histories(testnet_factory):
    """3 honest nodes and one attacker with 2 identities sending one poisoned model.

    What is asserted is what this small, CPU-starved swarm shows reliably: the sybils learn
    the attack and the honest nodes do not; honest nodes gossip histories to each other;
    and when both sybils are an honest node's neighbours in the same round (one model, two
    identities: identical histories), they get far less than the 2/3 the plain mean gives
    them. Meeting one sybil, an honest node can compare it only with a stale gossiped
    history of the other, and in a swarm this small that decides nothing either way
    (measured: as often above the mean's share as below). The full comparison (attack
    rates per aggregator and number of sybils) is the in-process benchmark's job
    (`node bench robust`)."""
    net = testnet_factory(3, manifest=SYBIL_MANIFEST, sybils=2, attack="label-flip",
                          timeout=120)
    sybil_ids = {status(p)["peer_id"] for p in net.procs if p.name.startswith("sybil")}
    nodes = honest(net)
    seen: dict[tuple[str, int], float] = {}  # (node, round) -> sybil share, both sybils met

    def both_sybils_met() -> bool:
        for p in nodes:
            t = training(p)
            agg = t.get("aggregation") or {}
            if sybil_ids <= set(agg.get("weights") or {}):
                seen[(p.name, agg["round"])] = sybil_share(t, sybil_ids) or 0.0
        return len(seen) >= SAMPLES

    wait_until(both_sybils_met, 240, f"{SAMPLES} aggregations with both sybils as neighbours",
               interval=0.05)
    print("sybil share when both sybils were neighbours (the mean's: 0.667):", seen)
    assert all(share < 1 / 3 for share in seen.values()), seen
    wait_until(lambda: sum((status(p).get("history_gossip") or {}).get("accepted", 0)
                           for p in nodes) > 0, 60, "an honest node to accept a gossiped history")
    flip_sybil = min((training(p).get("val_metrics") or {}).get("label_flip", 0)
                     for p in net.procs if p.name.startswith("sybil"))
    flip_honest = max((training(p).get("val_metrics") or {}).get("label_flip", 1) for p in nodes)
    assert flip_sybil > 0.2 and flip_honest < flip_sybil / 2, (flip_sybil, flip_honest)


def test_attack_flag_is_checked(tmp_path):
    r = run_cli("join", "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW", "--attack", "nuke",
                "--state-dir", str(tmp_path))
    assert r.returncode == 2 and "label-flip or backdoor" in r.stderr
    r = run_cli("testnet", "up", "--scenario", "chaos", "--dir", str(tmp_path))
    assert r.returncode == 2 and "known scenarios: sybil" in r.stderr


def test_aggregator_override_is_validated(tmp_path):
    with pytest.raises(launcher.TestnetError, match="--aggregator nonsense"):
        launcher.up(tmp_path / "tn", 1, manifest=SYBIL_MANIFEST, aggregator="nonsense")
