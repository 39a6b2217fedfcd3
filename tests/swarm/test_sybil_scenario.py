"""Gossip learning and SybilWall in a real swarm: honest nodes, one attacker with several
identities (real processes on loopback), and hostile history gossip from a raw host.

What a swarm test must not do is wait for a random event: the run's neighbours are a
function of the round and the (random) peer ids, so "both sybils are one honest node's
neighbours" happened in about half the rounds and, on a loaded machine, not three times
in 240 s. Here the testnet fixes the topology instead (`launcher.up(neighbours=...)`, the
nodes' `--neighbour` flags): node1 meets both sybils and node2 every round, node2 and
node3 meet each other. Who meets whom at random is tested where it is deterministic:
node/ml/optim/pairing.py in tests/ml/test_optim.py; SybilWall's weights for identical and
gossiped histories in-process in tests/ml/test_aggregate.py.
"""

from __future__ import annotations

import statistics

import pytest

from testnet import launcher
from tests.conftest import answer, cli, status, training, wait_until

SYBIL_MANIFEST = launcher.scenario_manifest_path("sybil")
SAMPLES = 3  # node1's aggregations with both sybils as neighbours
TRAINED_STEP = 2000  # 10 rounds: honest models at 78-88% accuracy
FLIP_SAMPLES = 5  # evaluations per honest node whose label-flip rates are compared
# node1 is the honest node that meets the attacker; node3 hears of the sybils only by gossip.
TOPOLOGY = {"node1": ["sybil1", "sybil2", "node2"], "node2": ["node3"]}


def honest(net: launcher.Testnet) -> list[launcher.Proc]:
    return [p for p in net.procs if p.name.startswith("node")]


def by_name(net: launcher.Testnet, name: str) -> launcher.Proc:
    return next(p for p in net.procs if p.name == name)


def sybil_share(t: dict, sybil_ids: set[str]) -> float | None:
    weights = (t.get("aggregation") or {}).get("weights") or {}
    return sum(w for peer, w in weights.items() if peer in sybil_ids) if weights else None


@pytest.mark.slow
def test_gossip_learning_with_the_mean_trains_every_node(testnet_factory):
    # 3 nodes, k = 2: everyone is everyone's neighbour every round (n <= k + 1).
    net = testnet_factory(3, manifest=SYBIL_MANIFEST, aggregator="mean", timeout=180)
    for p in honest(net):
        t = wait_until(lambda p=p: (t := training(p)).get("rounds_averaged", 0) >= 3
                       and (t.get("val_metrics") or {}).get("accuracy", 0) > 0.5 and t,
                       300, f"{p.name} to aggregate 3 rounds and pass 50% accuracy")
        weights = t["aggregation"]["weights"]
        assert "self" in weights and len(weights) >= 2  # its own model and a neighbour's
        assert abs(sum(weights.values()) - 1) < 0.01


@pytest.mark.slow
def test_sybilwall_down_weights_sybils_and_gossips_signed_histories(testnet_factory):
    """3 honest nodes and one attacker with 2 identities sending one poisoned model.

    node1 meets both sybils every round (one model, two identities: identical histories):
    SybilWall gives them less than 1/3 of the weight (measured: 0.0), where the plain mean
    gives them 2/4 (node1, node2 and the two sybils). The sybils learn
    the attack and the honest nodes do not; node1 gossips signed histories on to node2,
    which accepts them. The full comparison (attack rates per aggregator and number of
    sybils) is the in-process benchmark's job (`node bench robust`)."""
    net = testnet_factory(3, manifest=SYBIL_MANIFEST, sybils=2, attack="label-flip",
                          neighbours=TOPOLOGY, timeout=180)
    sybils = [p for p in net.procs if p.name.startswith("sybil")]
    sybil_ids = {answer(p)["peer_id"] for p in sybils}
    node1 = by_name(net, "node1")
    seen: dict[int, float] = {}  # node1's round -> sybil share, both sybils met

    def both_sybils_met() -> bool:
        t = training(node1)
        agg = t.get("aggregation") or {}
        if sybil_ids <= set(agg.get("weights") or {}):
            seen[agg["round"]] = sybil_share(t, sybil_ids) or 0.0
        return len(seen) >= SAMPLES

    wait_until(both_sybils_met, 300, f"{SAMPLES} node1 aggregations with both sybils",
               interval=0.05)
    print("sybil share at node1 when both sybils were neighbours (the mean's: 0.5):", seen)
    assert all(share < 1 / 3 for share in seen.values()), seen
    wait_until(lambda: (status(by_name(net, "node2")).get("history_gossip") or {})
               .get("accepted", 0) > 0, 120, "node2 to accept a history gossiped by node1")

    def label_flip(p: launcher.Proc) -> float | None:
        return (training(p).get("val_metrics") or {}).get("label_flip")

    # Both after an evaluation (every 50 steps), not before: a node that has not evaluated
    # yet reports no rate at all.
    flip_sybil = wait_until(lambda: (f := min(label_flip(p) or 0 for p in sybils)) > 0.2 and f,
                            120, "both sybils to learn the label flip")
    # Each honest node's rate over several evaluations of a trained model (past step
    # TRAINED_STEP), the median of FLIP_SAMPLES: a single evaluation of a model trained on
    # a skewed class mix confuses the flipped class by chance now and then (0.30 at 78%
    # accuracy in a 4-node testnet, where the same node read 0.04 a minute later; 0.29 at
    # 68% in ci84), while its other evaluations and the other nodes read 0.01-0.08. Waiting
    # for every node to be past 85% accuracy at once instead was waiting for chance: the
    # nodes hover at 78-88% (CI beside a busy core, 2026-11-27: not in 180 s).
    samples: dict[str, list[dict]] = {p.name: [] for p in honest(net)}

    def sample() -> bool:
        for p in honest(net):
            t = training(p)
            m = t.get("val_metrics") or {}
            taken = samples[p.name]
            if (t.get("step") or 0) >= TRAINED_STEP and m.get("label_flip") is not None \
                    and (not taken or taken[-1] != m) and len(taken) < FLIP_SAMPLES:
                taken.append(m)
        return all(len(taken) >= FLIP_SAMPLES for taken in samples.values())

    wait_until(sample, 180, f"{FLIP_SAMPLES} evaluations of each honest node past step "
               f"{TRAINED_STEP}", interval=0.05)
    flips = {name: statistics.median(m["label_flip"] for m in taken)
             for name, taken in samples.items()}
    accuracy = {name: statistics.median(m["accuracy"] for m in taken)
                for name, taken in samples.items()}
    # No honest node learns the attack: node1, which meets the sybils, because SybilWall
    # weighs them 0 (in rounds where one of them came alone too: it remembers that they
    # once sent one model); node2 and node3 hear of them only through node1.
    print("label-flip rates (medians): sybils", flip_sybil, "honest", flips,
          "accuracy", accuracy)
    assert all(a > 0.6 for a in accuracy.values()), accuracy  # trained models, all of them
    assert max(flips.values()) < flip_sybil / 2, (flip_sybil, flips)


def test_attack_flag_is_checked(tmp_path):
    r = cli("join", "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW", "--attack", "nuke",
                "--state-dir", str(tmp_path))
    assert r.returncode == 2 and "label-flip or backdoor" in r.stderr
    r = cli("testnet", "up", "--scenario", "chaos", "--dir", str(tmp_path))
    assert r.returncode == 2 and "known scenarios: sybil" in r.stderr


def test_aggregator_override_is_validated(tmp_path):
    with pytest.raises(launcher.TestnetError, match="--aggregator nonsense"):
        launcher.up(tmp_path / "tn", 1, manifest=SYBIL_MANIFEST, aggregator="nonsense")


def test_fixed_neighbours_are_symmetric_and_name_real_processes(tmp_path):
    assert launcher.symmetric(TOPOLOGY) == {
        "node1": ["node2", "sybil1", "sybil2"], "node2": ["node1", "node3"],
        "node3": ["node2"], "sybil1": ["node1"], "sybil2": ["node1"]}
    with pytest.raises(launcher.TestnetError, match="node7"):
        launcher.up(tmp_path / "tn", 1, manifest=SYBIL_MANIFEST, neighbours={"node1": ["node7"]})
