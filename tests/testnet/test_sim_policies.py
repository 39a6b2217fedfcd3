"""The simulator runs the node's issue-30 policies through the node's own functions."""

from __future__ import annotations

import pytest

import node.checkpoints.holders as holders_mod
import node.membership.redial as redial
import node.run.providers as providers_mod
import protocols.heartbeat as heartbeat
import protocols.rundoc as rundoc
from node.run.rundoc_sync import ANNOUNCE_TARGET_PER_S
from testnet.sim import document, experiments, policies
from testnet.sim.bench import DEFAULT_SCENARIO, NODE_SCENARIO
from testnet.sim.document import document_under_churn
from testnet.sim.experiments import checkpoint_burst
from testnet.sim.scenario import Scenario, ScenarioError, load, parse
from testnet.sim.swarm import Swarm


def node_small(**changes: object) -> Scenario:
    """node.toml's policies on a small, fast swarm."""
    base = load(NODE_SCENARIO).with_(peers=10, rounds=6, seed=3, training__step_s=0.05,
                                     training__model_mb=1.0, gossip__floods=3)
    return base.with_(**changes)


def test_the_adapters_call_the_node_functions_not_copies() -> None:
    assert policies.heartbeat_interval_s is heartbeat.heartbeat_interval_s
    assert policies.plan_connections is redial.plan_connections
    assert document.compactable is rundoc.compactable
    assert experiments.choose_holders is holders_mod.choose_holders
    assert experiments.UploadSlots is holders_mod.UploadSlots
    sc = load(NODE_SCENARIO)
    assert sc.interval_policy() is policies.heartbeat
    assert sc.announce_policy() is policies.announce


def test_above_the_target_the_interval_stretches_and_inbound_stays_at_it() -> None:
    """200 peers, 4x the heartbeat target: every node beats every 4 s, so each receives
    50 unique heartbeats a second (the target), a quarter of the fixed rate's traffic;
    announces stretch to 20 s (10/s, the run document's target)."""
    n = 200
    before = Swarm(node_small(peers=n, membership__policy="constant",
                              membership__announce_policy="constant")).run()
    res = Swarm(node_small(peers=n)).run()
    assert res.heartbeat_interval_s == heartbeat.heartbeat_interval_s(n, 1.0) == 4.0
    assert n / res.heartbeat_interval_s <= heartbeat.TARGET_INBOUND_PER_S
    assert res.announce_interval_s == 20.0
    assert n / res.announce_interval_s <= ANNOUNCE_TARGET_PER_S
    assert res.traffic is not None and before.traffic is not None and res.flood is not None
    assert res.traffic.msgs["heartbeats"] == pytest.approx(
        heartbeat.TARGET_INBOUND_PER_S * res.flood.copies_mean)
    assert res.traffic.msgs["heartbeats"] == pytest.approx(
        before.traffic.msgs["heartbeats"] / 4)
    assert res.traffic.msgs["rundoc gossip"] == pytest.approx(
        before.traffic.msgs["rundoc gossip"] / 10)
    # below the target nothing changes
    small = Swarm(node_small(peers=20)).run()
    assert small.heartbeat_interval_s == 1.0 and small.announce_interval_s == 2.0


def test_compaction_bounds_the_document_under_churn() -> None:
    """Ten hours of 100%/h churn among 50 peers: without compaction the document keeps
    every peer ever seen (~550 x 6 entries); with the node's rule it holds the live peers
    and those gone within about a horizon, and never drops a live peer's entries."""
    per = 6
    kept = document_under_churn(50, 1.0, 10.0, per, 0.0, seed=5)
    horizon = 1800.0
    bounded = document_under_churn(50, 1.0, 10.0, per, horizon, seed=5)
    assert kept.joins == bounded.joins > 300
    assert kept.entries == per * (50 + kept.joins)
    assert bounded.entries >= per * 50  # every live peer's keys are kept
    # live + departures within 9/8 of a horizon (Poisson: 3x its mean as a margin)
    assert bounded.peak <= per * (50 + 3 * 50 * 1.0 * horizon / 3600 * 9 / 8)
    assert bounded.peak < kept.entries / 4


def test_swarm_compacts_with_the_node_horizon_and_stays_deterministic() -> None:
    sc = node_small(peers=30, rounds=60, churn__per_hour=40.0, membership__gc_horizon_s=20.0)
    a, b = Swarm(sc).run(), Swarm(sc).run()
    assert a.leaves > 10
    # the horizon is RunDocSync's: never under 10 announce intervals (3 s at 30 peers)
    assert a.announce_interval_s == 3.0 and a.gc_horizon_s == 30.0
    assert a.doc_compacted > 0
    assert a.doc_entries < 6 * (30 + a.joins)
    assert (a.digest(), a.doc_entries, a.doc_peak, a.traffic) == \
        (b.digest(), b.doc_entries, b.doc_peak, b.traffic)
    off = Swarm(sc.with_(membership__gc_horizon_s=0.0)).run()
    assert off.doc_compacted == 0 and off.doc_entries > a.doc_entries


def test_holders_spread_a_join_burst() -> None:
    """10% of 1,000 peers join at once: the writer alone serves all 100 pulls (10 GB);
    with every finished joiner serving too, no holder serves more than MAX_UPLOADS at
    once and the busiest serves a small multiple of the checkpoint."""
    newest = checkpoint_burst(1000, 0.1, "newest", 100.0, (20.0, 1000.0), 1)
    spread = checkpoint_burst(1000, 0.1, "holders", 100.0, (20.0, 1000.0), 1)
    assert newest.busiest_pulls == 100 and newest.busiest_gb == pytest.approx(10.0)
    assert spread.busiest_pulls <= holders_mod.MAX_UPLOADS
    assert spread.busiest_gb < newest.busiest_gb / 5
    assert spread.t99_s < newest.t99_s
    assert spread == checkpoint_burst(1000, 0.1, "holders", 100.0, (20.0, 1000.0), 1)


def test_connection_bound_from_plan_connections() -> None:
    c = policies.connections(500, want=8, max_peers=32, seed=1)
    assert 8 <= c <= 32
    sc = node_small(peers=100)
    assert Swarm(sc).run().connections == pytest.approx(c, rel=0.5)


def test_the_provider_sample_bounds_the_busiest_dht_peer() -> None:
    """Every member re-providing the run key puts (N - 1) / reprovide_s ADD_PROVIDER a
    second on the key's closest peers; the node's rendezvous sample (node/run/providers.py)
    puts its 20 plus the joiners there, whatever N."""
    assert policies.provider_sample is providers_mod.provider_sample
    assert load(NODE_SCENARIO).membership.providers == providers_mod.PROVIDERS
    assert policies.providers(10_000, 20) == 20 and policies.providers(5, 20) == 5
    sc = node_small(peers=300, churn__per_hour=0.1)
    every = Swarm(sc.with_(membership__providers=0)).run().traffic
    sample = Swarm(sc).run().traffic
    assert every is not None and sample is not None
    assert every.msgs_max["dht"] - every.msgs["dht"] == pytest.approx(299 / 30)
    joins_per_s = 0.1 * 300 / 3600
    assert sample.msgs_max["dht"] - sample.msgs["dht"] == pytest.approx(
        (20 + joins_per_s * 30 - 1) / 30)
    assert sample.msgs["dht"] < every.msgs["dht"] / 10


def test_partners_from_the_whole_view_are_mostly_dialed_on_demand() -> None:
    """Pairing draws from the whole live view while a node keeps ~10 connections: at 300
    peers ~97% of partners are dialed first, which costs each round its handshakes (a
    few messages a round, not a rate that grows with N)."""
    res = Swarm(node_small(peers=300)).run()
    assert res.partner_dial_share == pytest.approx(1 - res.connections / 299)
    assert res.partner_dial_share > 0.9
    assert res.traffic is not None and 0 < res.traffic.msgs["partner dials"] < 2
    assert Swarm(node_small(peers=2)).run().partner_dial_share == 0.0


def test_two_entries_a_peer_keep_10000_peers_under_the_document_cap() -> None:
    """The node's announce writes 2 entries (info, last_seen; a trainer's checkpoint makes
    3): at 10,000 peers with the stretched horizon (10,000 s) and 10%/h churn the document
    stays under its cap (6 a peer passed it near 9,000 peers). Four hours of churn: past
    the horizon, so departures leave as fast as they come."""
    per = Swarm(load(NODE_SCENARIO)).per_peer
    assert per == 3 and Swarm(load(DEFAULT_SCENARIO)).per_peer == 6
    d = document_under_churn(10_000, 0.1, 4.0, per, policies.gc_horizon_s(
        10_000, 2.0, 3600.0), seed=1)
    assert d.peak < d.cap and d.peak <= per * 10_000 * (1 + 0.1 * 10_000 / 3600 * 1.5)


@pytest.mark.parametrize(("text", "message"), [
    ("schema = 1\n[membership]\nmax_peers = 4\n", "membership.max_peers: 4 is under"),
    ("schema = 1\n[checkpoint]\nprovision = \"all\"\n", "checkpoint.provision: expected one"),
    ("schema = 1\n[membership]\nannounce_policy = \"nope\"\n", "membership.announce_policy"),
    ("schema = 1\n[membership]\nannounce_shape = \"one\"\n", "membership.announce_shape"),
])
def test_new_keys_are_checked(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse(text, "x.toml")
