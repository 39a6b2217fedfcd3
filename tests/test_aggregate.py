"""The aggregators (node/aggregate) on real tensors: the properties the specs promise."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.aggregate import (
    AGGREGATORS,
    HistoryEntry,
    HistoryTable,
    Incoming,
    make_aggregator,
    similarity_weights,
)


def mlp(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A 64-128-10 MLP's tensors with Xavier-normal weights."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (fan_in, fan_out) in {"l1": (64, 128), "l2": (128, 10)}.items():
        std = (2 / (fan_in + fan_out)) ** 0.5 * scale
        out[f"{name}.weight"] = torch.randn(fan_out, fan_in, generator=g) * std
        out[f"{name}.bias"] = torch.randn(fan_out, generator=g) * 0.01
    return out


def close(a: dict, b: dict, atol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)


@pytest.mark.parametrize("name", AGGREGATORS)
def test_identical_models_stay_identical(name):
    own = mlp(1)
    agg = make_aggregator(name, self_id="me")
    result = agg.aggregate(1, own, [Incoming(f"p{i}", mlp(1)) for i in range(4)])
    assert close(result.state, own, atol=1e-5)
    assert not result.rejected


@pytest.mark.parametrize("name", AGGREGATORS)
def test_nan_and_wrong_shape_are_rejected_with_a_reason(name):
    own, good = mlp(1), mlp(2)
    nan = mlp(3)
    nan["l1.weight"][0, 0] = float("nan")
    shaped = mlp(4)
    shaped["l2.bias"] = torch.zeros(11)
    missing = {k: v for k, v in mlp(5).items() if k != "l2.bias"}
    agg = make_aggregator(name, self_id="me")
    result = agg.aggregate(1, own, [Incoming("good", good), Incoming("nan", nan),
                                    Incoming("shaped", shaped), Incoming("missing", missing)])
    assert set(result.rejected) == {"nan", "shaped", "missing"}
    assert "NaN" in result.rejected["nan"] and "shape" in result.rejected["shaped"]
    assert "names differ" in result.rejected["missing"]
    assert all(torch.isfinite(t).all() for t in result.state.values())
    assert {"nan", "shaped", "missing"}.isdisjoint(result.weights)


@pytest.mark.parametrize("name", AGGREGATORS)
def test_nothing_received_keeps_our_model(name):
    own = mlp(1)
    result = make_aggregator(name, self_id="me").aggregate(1, own, [])
    assert close(result.state, own)


def test_unknown_aggregator_is_named():
    with pytest.raises(ValueError, match=r"unknown aggregator 'avg'.*sybilwall"):
        make_aggregator("avg", self_id="me")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=6))
def test_mean_is_the_average_of_everyone(seeds):
    own, others = mlp(99), [mlp(s) for s in seeds]
    result = make_aggregator("mean", self_id="me").aggregate(
        1, own, [Incoming(f"p{i}", m) for i, m in enumerate(others)])
    expected = {k: torch.stack([own[k], *(m[k] for m in others)]).mean(0) for k in own}
    assert close(result.state, expected, atol=1e-5)
    assert abs(sum(result.weights.values()) - 1) < 1e-9


def test_variance_correction_restores_what_the_plain_mean_loses():
    """Averaging independent Xavier inits divides the variance by ~K; vc keeps it."""
    own, others = mlp(0), [mlp(s) for s in range(1, 8)]
    incoming = [Incoming(f"p{i}", m) for i, m in enumerate(others)]
    mean = make_aggregator("mean", self_id="me").aggregate(1, own, incoming).state
    vc = make_aggregator("vc", self_id="me").aggregate(1, own, incoming).state
    target = sum(float(m["l1.weight"].var()) for m in others) / len(others)
    assert float(mean["l1.weight"].var()) < 0.2 * target  # ~1/8 of it
    assert abs(float(vc["l1.weight"].var()) - target) < 0.05 * target
    # The mean of each tensor is kept.
    half = 0.5 * own["l1.weight"] + 0.5 * torch.stack([m["l1.weight"] for m in others]).mean(0)
    assert abs(float(vc["l1.weight"].mean()) - float(half.mean())) < 1e-6


def test_median_and_krum_ignore_one_wild_model():
    own = mlp(0)
    honest = [Incoming(f"p{i}", {k: v + 0.001 * i for k, v in own.items()}) for i in range(1, 5)]
    wild = Incoming("wild", {k: v + 100.0 for k, v in own.items()})
    for name in ("median", "krum"):
        state = make_aggregator(name, self_id="me").aggregate(1, own, [*honest, wild]).state
        assert float((state["l1.weight"] - own["l1.weight"]).abs().max()) < 0.01, name
    krum = make_aggregator("krum", self_id="me").aggregate(1, own, [*honest, wild])
    assert krum.weights["wild"] == 0


def test_similarity_weights_zero_identical_sybils_and_keep_diverse_honest_peers():
    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(500, generator=g) for _ in range(6)]
    sybil = torch.randn(500, generator=g)
    weights = similarity_weights([*honest, sybil, sybil.clone(), sybil.clone(), sybil.clone()])
    assert all(w > 0.9 for w in weights[:6]), weights
    assert all(w < 0.01 for w in weights[6:]), weights


def run_rounds(agg, rounds: int, honest: int, sybils: int, seed: int = 0):
    """Honest peers with independent updates, sybils all sending one shared update."""
    g = torch.Generator().manual_seed(seed)
    base = mlp(0)
    peers = {f"h{i}": {k: v.clone() for k, v in base.items()} for i in range(honest)}
    sybil = {k: v.clone() for k, v in base.items()}
    result = None
    for r in range(1, rounds + 1):
        for state in peers.values():
            for k in state:
                state[k] += 0.01 * torch.randn(state[k].shape, generator=g)
        for k in sybil:
            sybil[k] += 0.01 * torch.randn(sybil[k].shape, generator=g)
        incoming = [Incoming(p, {k: v.clone() for k, v in s.items()}) for p, s in peers.items()]
        incoming += [Incoming(f"s{i}", {k: v.clone() for k, v in sybil.items()})
                     for i in range(sybils)]
        result = agg.aggregate(r, base, incoming)
    return result


def test_sybilwall_weights_identical_sybils_near_zero_and_honest_near_one():
    agg = make_aggregator("sybilwall", self_id="me", reference=mlp(0))
    result = run_rounds(agg, rounds=3, honest=6, sybils=4)
    sybil_share = sum(w for p, w in result.weights.items() if p.startswith("s") and p != "self")
    honest_w = [w for p, w in result.weights.items() if p.startswith("h")]
    assert sybil_share < 0.01
    assert min(honest_w) > 0.8 * result.weights["self"]  # honest ones weigh about like us
    assert abs(sum(result.weights.values()) - 1) < 1e-9


def test_sybilwall_uses_gossiped_histories_to_catch_a_lone_sybil_neighbour():
    """One sybil among our neighbours looks unique; the same history gossiped from afar
    reveals it. FoolsGold, without gossip, cannot tell."""
    g = torch.Generator().manual_seed(1)
    own = mlp(0)
    ref = mlp(0)
    honest = [Incoming(f"h{i}", {k: v + 0.05 * torch.randn(v.shape, generator=g)
                                 for k, v in own.items()}) for i in range(3)]
    sybil_state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in own.items()}
    sybil_vec = torch.cat([(sybil_state[k] - ref[k]).reshape(-1) for k in own])
    wall = make_aggregator("sybilwall", self_id="me", reference=ref)
    fools = make_aggregator("foolsgold", self_id="me", reference=ref)
    for i in range(3):  # three other identities of the same attacker, heard of by gossip
        assert wall.history.offer(f"h{i}", HistoryEntry(f"far{i}", 1, 2, sybil_vec)) is None
    incoming = [*honest, Incoming("s0", sybil_state)]
    assert wall.aggregate(1, own, incoming).weights["s0"] < 0.01
    assert fools.aggregate(1, own, incoming).weights["s0"] > 0.1


def test_sybilwall_renormalises_over_the_models_it_aggregates_only():
    """The reference code's bug (spec §3g): with gossiped histories present, our own model
    took the first distant peer's score and the weights summed to less than 1."""
    g = torch.Generator().manual_seed(2)
    own, ref = mlp(0), mlp(0)
    wall = make_aggregator("sybilwall", self_id="me", reference=ref)
    for i in range(5):  # distant peers with their own histories
        far = torch.randn(sum(v.numel() for v in own.values()), generator=g)
        assert wall.history.offer(f"h{i}", HistoryEntry(f"far{i}", 1, 2, far)) is None
    incoming = [Incoming(f"h{i}", {k: v + 0.05 * torch.randn(v.shape, generator=g)
                                   for k, v in own.items()}) for i in range(2)]
    result = wall.aggregate(1, own, incoming)
    assert set(result.weights) == {"self", "h0", "h1"}
    assert abs(sum(result.weights.values()) - 1) < 1e-9
    assert result.weights["self"] >= max(result.weights["h0"], result.weights["h1"])
    expected = {k: sum(result.weights[p] * s[k] for p, s in
                       [("self", own), *((i.peer, i.state) for i in incoming)]) for k in own}
    assert close(result.state, expected, atol=1e-5)


# -- the history table ------------------------------------------------------------------


def entry(peer: str, round: int = 1, distance: int = 1, n: int = 8) -> HistoryEntry:
    return HistoryEntry(peer, round, distance, torch.ones(n) * round)


def test_direct_entries_are_never_overwritten_by_gossip():
    t = HistoryTable("me")
    t.observe_direct("a", 1, torch.zeros(8))
    assert "direct neighbour" in t.offer("b", entry("a", round=5))
    assert t.entries["a"].distance == 1 and float(t.entries["a"].vector.sum()) == 0


def test_gossiped_entries_are_replaced_only_by_newer_rounds():
    t = HistoryTable("me")
    assert t.offer("b", entry("a", round=3)) is None
    assert t.entries["a"].distance == 2 and t.entries["a"].received_from == "b"
    assert "not newer" in t.offer("c", entry("a", round=3))
    assert t.offer("c", entry("a", round=4, distance=3)) is None
    assert t.entries["a"].distance == 4


def test_table_refuses_self_sender_absurd_and_malformed_entries():
    t = HistoryTable("me")
    t.observe_direct("a", 1, torch.zeros(8))
    assert "ourselves" in t.offer("b", entry("me"))
    assert "sender itself" in t.offer("b", entry("b"))
    assert "absurd distance" in t.offer("b", entry("x", distance=50))
    assert "absurd distance" in t.offer("b", entry("x", distance=0))
    assert "expected 8" in t.offer("b", entry("x", n=9))
    bad = entry("x")
    bad.vector[0] = float("inf")
    assert "NaN" in t.offer("b", bad)
    assert set(t.entries) == {"a"}


def test_a_flooding_sender_is_cut_and_the_table_is_bounded():
    t = HistoryTable("me", max_peers=10, max_per_sender_per_round=4)
    results = [t.offer("flooder", entry(f"x{i}")) for i in range(20)]
    assert results[:4] == [None] * 4 and all("flood" in r for r in results[4:])
    t.begin_round(2)
    for sender in range(10):
        for i in range(4):
            t.offer(f"s{sender}", entry(f"y{sender}-{i}", round=2))
    assert len(t.entries) == 10


def test_sampling_prefers_nearby_peers_and_skips_the_neighbours_own():
    t = HistoryTable("me")
    t.observe_direct("near", 1, torch.zeros(8))
    assert t.offer("near", entry("far", distance=4)) is None  # stored at 5, from "near"
    assert t.offer("other", entry("mid", distance=1)) is None  # stored at 2
    rng = random.Random(0)
    picks = [t.sample_for("q", rng).peer for _ in range(3000)]
    assert picks.count("near") > picks.count("mid") > picks.count("far") > 0
    assert all(t.sample_for("near", rng).peer != "far" for _ in range(200))
    assert t.sample_for("near", rng).peer == "mid"
