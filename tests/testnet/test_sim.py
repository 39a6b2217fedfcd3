"""The swarm simulator (testnet/sim/): deterministic, its counts match hand formulas, churn
stays bounded, and bad scenario files are refused with the key named."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testnet.sim import gossip
from testnet.sim.experiments import checkpoint_burst
from testnet.sim.scenario import Scenario, ScenarioError, load, parse
from testnet.sim.swarm import Swarm, path_kind


def small(**changes: object) -> Scenario:
    base = Scenario(peers=10, rounds=6, seed=3).with_(training__step_s=0.05,
                                                       training__model_mb=1.0, gossip__floods=3)
    return base.with_(**changes)


def test_same_seed_same_numbers_other_seed_others() -> None:
    sc = small(peers=60, rounds=12, churn__per_hour=40.0)  # a leave every few seconds
    a, b = Swarm(sc).run(), Swarm(sc).run()
    assert a.leaves > 0 and a.joins > 0
    assert a.digest() == b.digest()
    assert a.traffic == b.traffic and a.write_t99_s == b.write_t99_s
    c = Swarm(sc.with_(seed=4)).run()
    assert c.digest() != a.digest()


def test_flood_copies_by_hand() -> None:
    # a square 0-1-2-3-0 with a chord 0-2; origin 0, equal latencies: 0 sends to 1, 2, 3;
    # 1, 2, 3 forward to every mesh peer but their parent (0): 1 -> 2, 2 -> 1, 2 -> 3, 3 -> 2
    adj = [np.array(x) for x in ([1, 2, 3], [0, 2], [0, 1, 3], [0, 2])]
    f = gossip.flood(adj, 0, np.full(4, 0.01), np.full(4, 1e9), 100, idontwant_min=10**9)
    assert f.copies.tolist() == [0, 2, 3, 2]
    assert f.sent.tolist() == [3, 1, 2, 1]
    # the whole flood costs sum(deg) - (n - 1) transmissions on a connected mesh
    assert f.transmissions == 10 - 3
    # with IDONTWANT on, 2's IDONTWANT reaches 1 (0.02 + 0.02) after 1 forwards (at 0.02)
    g = gossip.flood(adj, 0, np.full(4, 0.01), np.full(4, 1e9), 100, idontwant_min=0)
    assert g.transmissions <= f.transmissions


def test_heartbeat_count_at_ten_peers_is_the_formula() -> None:
    """N peers beating every heartbeat_s: each receives N / heartbeat_s x copies per
    message, and a message costs 2E - (N - 1) transmissions over the mesh's E links."""
    sc = small(membership__heartbeat_s=0.5)
    swarm = Swarm(sc)
    res = swarm.run()
    adj = swarm.adj  # the mesh the run traced
    edges = sum(len(a) for a in adj) // 2
    copies = (2 * edges - 9) / 10  # heartbeats are < 1 KiB: no IDONTWANT
    assert res.flood is not None and res.flood.copies_mean == pytest.approx(copies)
    assert res.traffic is not None
    assert res.traffic.msgs["heartbeats"] == pytest.approx(10 / 0.5 * copies)
    assert res.traffic.bytes["heartbeats"] == pytest.approx(
        res.traffic.msgs["heartbeats"] * swarm.sizes.heartbeat)


def test_policy_is_pluggable() -> None:
    """A rate that falls with N (what the real node will use) plugs in as a function."""
    sc = small(peers=40, rounds=2)
    today = Swarm(sc).run().traffic
    slower = Swarm(sc, policy=lambda n, hb: hb * n / 10).run().traffic
    assert today is not None and slower is not None
    assert slower.msgs["heartbeats"] == pytest.approx(today.msgs["heartbeats"] / 4)
    named = parse('schema = 1\n[membership]\npolicy = '
                  '"testnet.sim.scenario:constant_interval"\n')
    assert named.interval_policy()(1000, 1.0) == 1.0


def test_noloco_pairs_everyone_without_churn_and_diloco_agrees() -> None:
    res = Swarm(small()).run()
    assert [r["averaged"] for r in res.rounds] == [10] * 6
    assert res.rounds[-1]["loss"] < res.rounds[0]["loss"]
    d = Swarm(small(training__algorithm="diloco")).run()
    assert all(r["averaged"] == 10 for r in d.rounds)
    assert d.rounds[-1]["spread"] < 1e-9  # one all-reduce per round: identical φ


def test_churn_stays_bounded() -> None:
    sc = small(peers=200, rounds=30, churn__per_hour=20.0)
    res = Swarm(sc).run()
    expected = 200 * 20.0 / 3600 * res.virtual_s
    assert abs(res.leaves - expected) < 6 * math.sqrt(expected) + 5
    for r in res.rounds:
        assert r["averaged"] + r["local"] == r["training"]
        assert 100 <= r["n"] <= 300
    assert res.averaged_share < 1.0  # crashes cost some rounds


def test_checkpoint_burst_newest_holder_serves_everyone() -> None:
    b = checkpoint_burst(1000, 0.1, "newest", 10.0, (100.0, 100.0), seed=0)
    assert b.joiners == 100 and b.busiest_pulls == 100
    assert b.busiest_gb == pytest.approx(100 * 10e6 / 1e9)
    # 100 pulls share one 100 Mbit/s uplink: 1 GB / 12.5 MB/s
    assert b.t99_s == pytest.approx(1e9 / 12.5e6)
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        checkpoint_burst(10, 0.1, "nearest", 1.0, (1.0, 1.0), seed=0)


def test_path_kinds_follow_the_reach_matrix() -> None:
    assert path_kind("symmetric", "symmetric") == "relayed"
    assert path_kind("home", "symmetric") == "relayed"
    assert path_kind("home", "home") == "punched"
    assert path_kind("public", "symmetric") == "direct"
    assert path_kind("fullcone", "symmetric") == "direct"


@pytest.mark.parametrize(("text", "message"), [
    ("peers = 10\n", "schema: expected 1"),
    ("schema = 1\npeerz = 10\n", "peerz: unknown key"),
    ("schema = 1\npeers = 'ten'\n", "peers: expected int"),
    ("schema = 1\npeers = 1\n", "peers: 1 is out of range"),
    ("schema = 1\n[training]\nalgorithm = 'adam'\n", "training.algorithm"),
    ("schema = 1\n[gossip]\ndegre = 6\n", "gossip.degre: unknown key; known: degree"),
    ("schema = 1\n[network]\nlatency_ms = [5]\n", "network.latency_ms: expected [low, high]"),
    ("schema = 1\n[network.nat]\ncgnat = 1.0\n", "unknown NAT kind 'cgnat'"),
    ("schema = 1\n[membership]\npolicy = 'nosuch.module:f'\n", "membership.policy"),
    ("schema = 1\n[churn]\ncrash_share = 2.0\n", "churn.crash_share: 2.0 is out of range"),
    ("schema = 1\ntraining = 3\n", "[training]: expected a table"),
    ("schema = 1\n[training\n", "not valid TOML"),
])
def test_scenario_errors_name_the_key(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match="scenario x.toml: .*" + _re(message)):
        parse(text, "x.toml")


def test_scenario_file_missing_and_default_loads(tmp_path) -> None:
    with pytest.raises(ScenarioError, match="cannot read"):
        load(tmp_path / "nope.toml")
    from testnet.sim.bench import DEFAULT_SCENARIO

    assert load(DEFAULT_SCENARIO).membership.heartbeat_s == 1.0


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_sybilwall_gives_identical_sybils_less_than_the_mean_does() -> None:
    from testnet.sim.experiments import sybil_attack

    mean = sybil_attack(60, 0.3, "mean", rounds=4, seed=1)
    wall = sybil_attack(60, 0.3, "sybilwall", rounds=4, seed=1)
    assert mean.sybils == wall.sybils == 18
    assert 0.0 < mean.sybil_weight < 1.0 and mean.success > 0.0
    assert wall.sybil_weight < mean.sybil_weight / 2
    assert wall.success < mean.success
