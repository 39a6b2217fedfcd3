"""The aggregators (node/ml/aggregate) on real tensors: the properties the specs promise."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.ml.aggregate import (
    AGGREGATORS,
    HistoryEntry,
    HistoryTable,
    Incoming,
    make_aggregator,
    similarity_weights,
    validate_incoming,
)
from node.ml.aggregate.base import flat
from node.ml.aggregate.similarity import cosine_matrix

State = dict[str, torch.Tensor]


def mlp(seed: int, scale: float = 1.0) -> State:
    """A 64-128-10 MLP's tensors with Xavier-normal weights."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (fan_in, fan_out) in {"l1": (64, 128), "l2": (128, 10)}.items():
        std = (2 / (fan_in + fan_out)) ** 0.5 * scale
        out[f"{name}.weight"] = torch.randn(fan_out, fan_in, generator=g) * std
        out[f"{name}.bias"] = torch.randn(fan_out, generator=g) * 0.01
    return out


def nudged(state: State, g: torch.Generator, sd: float = 0.05) -> State:
    return {k: v + sd * torch.randn(v.shape, generator=g) for k, v in state.items()}


def close(a: State, b: State, atol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)


def finite(state: State) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def numel(state: State) -> int:
    return sum(t.numel() for t in state.values())


# -- every aggregator --------------------------------------------------------------------


@pytest.mark.parametrize("name", AGGREGATORS)
def test_identical_models_stay_identical(name):
    own = mlp(1)
    agg = make_aggregator(name, self_id="me")
    result = agg.aggregate(1, own, [Incoming(f"p{i}", mlp(1)) for i in range(4)])
    assert close(result.state, own, atol=1e-6)
    assert not result.rejected


@pytest.mark.parametrize("name", AGGREGATORS)
def test_bad_models_are_rejected_with_a_reason_and_never_aggregated(name):
    own, good = mlp(1), mlp(2)
    nan = mlp(3)
    nan["l1.weight"][0, 0] = float("nan")
    inf = mlp(3)
    inf["l2.bias"][1] = float("-inf")
    shaped = mlp(4)
    shaped["l2.bias"] = torch.zeros(11)
    typed = {k: v.double() for k, v in mlp(4).items()}
    missing = {k: v for k, v in mlp(5).items() if k != "l2.bias"}
    extra = {**mlp(6), "l3.weight": torch.zeros(2)}
    bad = {
        "nan": nan,
        "inf": inf,
        "shaped": shaped,
        "typed": typed,
        "missing": missing,
        "extra": extra,
        "me": mlp(7),
    }
    agg = make_aggregator(name, self_id="me")
    incoming = [Incoming("good", good), *(Incoming(p, s) for p, s in bad.items())]
    result = agg.aggregate(1, own, incoming)
    assert set(result.rejected) == set(bad)
    assert "NaN" in result.rejected["nan"] and "NaN or Inf" in result.rejected["inf"]
    assert "shape (11,)" in result.rejected["shaped"]
    assert "dtype torch.float64" in result.rejected["typed"]
    assert "l2.bias" in result.rejected["missing"] and "l3.weight" in result.rejected["extra"]
    assert "our own name" in result.rejected["me"]
    assert finite(result.state)
    assert set(bad).isdisjoint(result.weights)
    # The result is what the aggregator makes of `own` and `good` alone.
    alone = make_aggregator(name, self_id="me").aggregate(1, own, [Incoming("good", good)])
    assert close(result.state, alone.state, atol=1e-6)


@pytest.mark.parametrize("name", AGGREGATORS)
def test_nothing_accepted_keeps_our_model(name):
    own = mlp(1)
    nan = mlp(2)
    nan["l1.bias"][0] = float("nan")
    for incoming in ([], [Incoming("nan", nan)]):
        result = make_aggregator(name, self_id="me").aggregate(1, own, incoming)
        assert close(result.state, own, atol=0)
        assert result.weights == {"self": 1.0}
        assert result.state["l1.weight"] is not own["l1.weight"]  # a copy, not an alias


@pytest.mark.parametrize("name", AGGREGATORS)
def test_dtypes_and_counters_survive(name):
    """fp64 stays fp64 (no detour through fp32), bf16 stays bf16, an integer counter
    stays ours."""
    g = torch.Generator().manual_seed(0)

    def model(shift: float) -> State:
        return {
            "w": torch.randn(32, 16, generator=g, dtype=torch.float64) + shift,
            "h": torch.randn(16, generator=g).to(torch.bfloat16),
            "steps": torch.tensor(7 if shift == 0 else 9),
        }

    own = model(0.0)
    result = make_aggregator(name, self_id="me").aggregate(1, own, [Incoming("p", model(1e-12))])
    assert {k: v.dtype for k, v in result.state.items()} == {k: v.dtype for k, v in own.items()}
    assert int(result.state["steps"]) == 7
    assert finite(result.state)


def test_make_aggregator_names_unknown_aggregators_and_parameters():
    assert AGGREGATORS == ("mean", "vc", "median", "krum", "foolsgold", "sybilwall")
    with pytest.raises(ValueError, match=r"unknown aggregator 'avg'.*sybilwall"):
        make_aggregator("avg", self_id="me")
    with pytest.raises(ValueError, match=r"aggregator 'mean'.*'c'.*parameters: none"):
        make_aggregator("mean", self_id="me", c=0.3)
    with pytest.raises(ValueError, match=r"'vc'.*'m'"):
        make_aggregator("vc", self_id="me", m=2)
    with pytest.raises(ValueError, match="c must be"):
        make_aggregator("vc", self_id="me", c=1.0)
    with pytest.raises(ValueError, match=r"m \(models selected\) must be >= 1"):
        make_aggregator("krum", self_id="me", m=0)
    agg = make_aggregator("sybilwall", self_id="me", max_peers=3, lam=0.5)
    assert agg.history.max_peers == 3 and agg.history.lam == 0.5


def test_validate_incoming_refuses_a_second_model_from_one_peer():
    own = mlp(1)
    accepted, rejected = validate_incoming(own, [Incoming("p", mlp(2)), Incoming("p", mlp(3))])
    assert [i.peer for i in accepted] == ["p"] and "second model" in rejected["p"]


# -- mean -----------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=0, max_size=6))
def test_mean_is_the_average_of_everyone(seeds):
    own, others = mlp(99), [mlp(s) for s in seeds]
    result = make_aggregator("mean", self_id="me").aggregate(
        1, own, [Incoming(f"p{i}", m) for i, m in enumerate(others)]
    )
    expected = {k: torch.stack([own[k], *(m[k] for m in others)]).mean(0) for k in own}
    assert close(result.state, expected, atol=1e-6)
    assert math.isclose(math.fsum(result.weights.values()), 1.0)
    assert set(result.weights) == {"self", *(f"p{i}" for i in range(len(seeds)))}


# -- variance correction (spec §2) ------------------------------------------------------


def test_vc_is_a_no_op_on_identical_models():
    own = mlp(3)
    for target in ("others", "self", "conservative"):
        agg = make_aggregator("vc", self_id="me", target=target)
        result = agg.aggregate(1, own, [Incoming(f"p{i}", mlp(3)) for i in range(5)])
        assert close(result.state, own, atol=1e-6), target
        assert result.weights == {"self": 0.5, **{f"p{i}": 0.1 for i in range(5)}}


def test_vc_restores_the_variance_the_plain_mean_loses():
    """Averaging K + 1 independent Xavier inits divides the variance by ~K + 1; vc keeps
    the received models' variance and each tensor's mean."""
    k = 7
    own, others = mlp(0), [mlp(s) for s in range(1, k + 1)]
    incoming = [Incoming(f"p{i}", m) for i, m in enumerate(others)]
    mean = make_aggregator("mean", self_id="me").aggregate(1, own, incoming).state
    vc = make_aggregator("vc", self_id="me").aggregate(1, own, incoming).state
    for name in ("l1.weight", "l2.weight"):
        target = sum(float(m[name].var(unbiased=False)) for m in others) / k
        ratio = float(mean[name].var(unbiased=False)) / target
        assert 0.7 / (k + 1) < ratio < 1.3 / (k + 1), (name, ratio)
        # Near, not equal: ε = 1e-4 against a variance of ~0.01 leaves it ~2% short.
        assert float(vc[name].var(unbiased=False)) == pytest.approx(target, rel=0.05)
        half = 0.5 * own[name] + 0.5 * torch.stack([m[name] for m in others]).mean(0)
        assert float(vc[name].mean()) == pytest.approx(float(half.mean()), abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 10_000), min_size=1, max_size=5),
    c=st.sampled_from([0.0, 0.25, 0.5, 0.9]),
    target=st.sampled_from(["others", "self", "conservative"]),
    scale=st.floats(0.01, 10.0),
)
def test_vc_rescales_each_tensor_to_its_target_around_its_mean(seeds, c, target, scale):
    """Exactly spec §2(c): w' = (w̄ − μ)·sqrt((v* + ε)/(Var w̄ + ε)) + μ."""
    own, others = mlp(10_001, scale), [mlp(s, scale) for s in seeds]
    result = make_aggregator("vc", self_id="me", c=c, target=target).aggregate(
        1, own, [Incoming(f"p{i}", m) for i, m in enumerate(others)]
    )
    for name in own:
        avg = c * own[name].double() + (1 - c) * torch.stack(
            [m[name] for m in others]
        ).double().mean(0)
        v_others = sum(float(m[name].double().var(unbiased=False)) for m in others) / len(others)
        v_self = float(own[name].double().var(unbiased=False))
        v_star = {
            "others": v_others,
            "self": v_self,
            "conservative": c * v_self + (1 - c) * v_others,
        }[target]
        out = result.state[name].double()
        assert float(out.mean()) == pytest.approx(float(avg.mean()), abs=1e-5 * scale)
        want = (
            (v_star + 1e-4)
            / (float(avg.var(unbiased=False)) + 1e-4)
            * float(avg.var(unbiased=False))
        )
        assert float(out.var(unbiased=False)) == pytest.approx(want, rel=1e-3)


def test_vc_with_c_zero_and_one_received_model_returns_that_model():
    own, theirs = mlp(1), mlp(2)
    result = make_aggregator("vc", self_id="me", c=0.0).aggregate(1, own, [Incoming("p", theirs)])
    assert close(result.state, theirs, atol=1e-6)


def test_vc_leaves_norm_statistics_scalars_and_counters_alone():
    g = torch.Generator().manual_seed(0)

    def model() -> State:
        return {
            "conv.weight": torch.randn(8, 4, generator=g),
            "bn.running_mean": torch.randn(8, generator=g),
            "bn.running_var": torch.rand(8, generator=g) + 0.5,
            "bn.num_batches_tracked": torch.tensor(int(torch.randint(0, 100, (1,), generator=g))),
            "logit_scale": torch.randn((), generator=g),
            "one": torch.randn(1, generator=g),
        }

    own, others = model(), [model() for _ in range(3)]
    result = make_aggregator("vc", self_id="me").aggregate(
        1, own, [Incoming(f"p{i}", m) for i, m in enumerate(others)]
    )
    for name in ("bn.running_mean", "bn.running_var", "logit_scale", "one"):
        plain = 0.5 * own[name] + 0.5 * torch.stack([m[name] for m in others]).mean(0)
        assert torch.allclose(result.state[name], plain, atol=1e-6), name
    assert torch.equal(result.state["bn.num_batches_tracked"], own["bn.num_batches_tracked"])
    plain = 0.5 * own["conv.weight"] + 0.5 * torch.stack([m["conv.weight"] for m in others]).mean(0)
    assert not torch.allclose(result.state["conv.weight"], plain, atol=1e-3)  # rescaled


# -- median and Krum --------------------------------------------------------------------


def test_median_and_krum_ignore_one_wild_model():
    own = mlp(0)
    honest = [Incoming(f"p{i}", {k: v + 0.001 * i for k, v in own.items()}) for i in range(1, 5)]
    wild = Incoming("wild", {k: v + 100.0 for k, v in own.items()})
    for name in ("median", "krum"):
        result = make_aggregator(name, self_id="me").aggregate(1, own, [*honest, wild])
        assert float((result.state["l1.weight"] - own["l1.weight"]).abs().max()) < 0.01, name
    krum = make_aggregator("krum", self_id="me").aggregate(1, own, [*honest, wild])
    assert krum.weights["wild"] == 0 and math.isclose(math.fsum(krum.weights.values()), 1.0)
    multi = make_aggregator("krum", self_id="me", m=3).aggregate(1, own, [*honest, wild])
    assert multi.weights["wild"] == 0
    assert sorted(multi.weights.values()) == pytest.approx([0, 0, 0, 1 / 3, 1 / 3, 1 / 3])


def test_krum_picks_the_most_central_model():
    """On a line at 0, 1, 2, 3, 10 with f = 1 (two nearest counted), 1 and 2 tie on 2;
    Krum takes the lower name of the tie, deterministically."""
    own = {"w": torch.tensor([0.0, 0.0])}
    incoming = [
        Incoming(p, {"w": torch.tensor([x, 0.0])})
        for p, x in (("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 10.0))
    ]
    krum = make_aggregator("krum", self_id="me", f=1)
    assert krum.scores([own, *(i.state for i in incoming)]) == [5.0, 2.0, 2.0, 5.0, 113.0]
    result = krum.aggregate(1, own, incoming)
    assert result.weights == {"self": 0.0, "a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0}
    assert torch.equal(result.state["w"], incoming[0].state["w"])


def test_median_is_coordinate_wise():
    own = {"w": torch.tensor([0.0, 5.0, 1.0])}
    incoming = [
        Incoming("a", {"w": torch.tensor([1.0, 3.0, -9.0])}),
        Incoming("b", {"w": torch.tensor([2.0, 4.0, 9.0])}),
    ]
    result = make_aggregator("median", self_id="me").aggregate(1, own, incoming)
    assert result.state["w"].tolist() == [1.0, 4.0, 1.0]


# -- similarity scoring, FoolsGold, SybilWall (spec §3) --------------------------------


def test_similarity_weights_zero_identical_sybils_and_keep_diverse_honest_peers():
    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(500, generator=g) for _ in range(6)]
    sybil = torch.randn(500, generator=g)
    weights = similarity_weights([*honest, sybil, sybil.clone(), sybil.clone(), sybil.clone()])
    assert all(w == 1.0 for w in weights[:6]), weights
    assert all(w == 0.0 for w in weights[6:]), weights


def test_similarity_weights_degenerate_inputs():
    assert similarity_weights([]) == []
    assert similarity_weights([torch.ones(10)]) == [1.0]  # nothing to compare with
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # rounding must not turn 1 − cos ≈ 1e-16 into full weight
        twin = torch.randn(10, generator=g)
        assert similarity_weights([twin, twin.clone()]) == [0.0, 0.0]  # nobody to trust
        assert similarity_weights([twin, 3 * twin, twin.clone()]) == [0.0, 0.0, 0.0]
    zero = torch.zeros(10)  # a peer that has not moved: no direction, no NaN
    weights = similarity_weights([zero, zero.clone(), torch.randn(10, generator=g)])
    assert all(math.isfinite(w) and 0 <= w <= 1 for w in weights)


def test_pardoning_forgives_an_honest_peer_that_resembles_a_sybil():
    """Two sybils (cos 0.99) and an honest peer at cos 0.6 to one of them, beside an honest
    peer unlike anyone. Unpardoned, the first honest peer's weight would be 1 − 0.6 = 0.4
    and its logit ln(0.4/0.6) + 0.5 ≈ 0.09; pardoning scales its similarities by
    0.6/0.99, so it keeps full weight, while the sybils (s_j = s_k) get nothing."""
    e1, e2, e3, e4 = torch.eye(4)
    sybil_a = e1
    sybil_b = 0.99 * e1 + math.sqrt(1 - 0.99**2) * e2
    resembling = 0.6 * e1 + 0.8 * e3
    weights = similarity_weights([sybil_a, sybil_b, resembling, e4])
    assert weights == [0.0, 0.0, 1.0, 1.0]


def test_scaling_by_the_neighbours_keeps_a_stale_distinct_history_from_muting_them():
    """Two honest neighbours at cos 0.5 (w = 0.5 each) and a distinct gossiped history
    (w = 1). Scaled by the max over everything (the spec), the neighbours get the logit of
    0.5: 0.5. Scaled by the neighbours' own max (SybilWall's departure) they get 1, and a
    sybil pair among them still gets 0."""
    e1, e2, e3, e4 = torch.eye(4)
    h0, h1, far = e1, 0.5 * e1 + math.sqrt(0.75) * e2, e3
    assert similarity_weights([h0, h1, far]) == pytest.approx([0.5, 0.5, 1.0])
    assert similarity_weights([h0, h1, far], scale_by=2) == [1.0, 1.0, 1.0]
    assert similarity_weights([e4, e4.clone(), h0, far], scale_by=3) == [0.0, 0.0, 1.0, 1.0]
    assert similarity_weights([e4, e4.clone(), far], scale_by=2) == [0.0, 0.0, 0.0]


def test_cosine_matrix_in_blocks_matches_the_direct_computation():
    g = torch.Generator().manual_seed(0)
    hs = [torch.randn(1001, generator=g) for _ in range(5)]
    direct = torch.nn.functional.cosine_similarity(
        torch.stack(hs).double()[:, None], torch.stack(hs).double()[None], dim=-1
    )
    for block in (7, 1000, 1 << 22):
        assert torch.allclose(cosine_matrix(hs, block=block), direct, atol=1e-12)


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
        incoming += [
            Incoming(f"s{i}", {k: v.clone() for k, v in sybil.items()}) for i in range(sybils)
        ]
        result = agg.aggregate(r, base, incoming)
    return result


@pytest.mark.parametrize("name", ["sybilwall", "foolsgold"])
def test_identical_sybils_weigh_near_zero_and_diverse_honest_peers_near_one(name):
    agg = make_aggregator(name, self_id="me", reference=mlp(0))
    result = run_rounds(agg, rounds=3, honest=6, sybils=4)
    assert set(result.weights) == {
        "self",
        *(f"h{i}" for i in range(6)),
        *(f"s{i}" for i in range(4)),
    }
    assert all(result.weights[f"s{i}"] < 1e-3 for i in range(4)), result.weights
    # Honest peers score ~1, as our own model does: about 1/7 each.
    assert all(result.weights[f"h{i}"] > 0.9 * result.weights["self"] for i in range(6))
    assert math.isclose(math.fsum(result.weights.values()), 1.0)
    assert all(agg.last_scores[f"s{i}"] < 1e-3 for i in range(4))


def test_sybilwall_uses_gossiped_histories_to_catch_a_lone_sybil_neighbour():
    """One sybil among our neighbours looks unique; the same history gossiped from afar
    reveals it. FoolsGold, without gossip, cannot tell."""
    g = torch.Generator().manual_seed(1)
    own = ref = mlp(0)
    honest = [Incoming(f"h{i}", nudged(own, g)) for i in range(3)]
    sybil_state = nudged(own, g)
    sybil_history = flat(sybil_state) - flat(ref)
    wall = make_aggregator("sybilwall", self_id="me", reference=ref)
    fools = make_aggregator("foolsgold", self_id="me", reference=ref)
    for i in range(3):  # three other identities of the same attacker, heard of by gossip
        assert wall.history.offer(f"h{i}", HistoryEntry(f"far{i}", 1, 2, sybil_history)) is None
        assert fools.history.offer(f"h{i}", HistoryEntry(f"far{i}", 1, 2, sybil_history)) is None
    incoming = [*honest, Incoming("s0", sybil_state)]
    assert wall.aggregate(1, own, incoming).weights["s0"] < 1e-3
    assert fools.aggregate(1, own, incoming).weights["s0"] > 0.15


def test_sybilwall_gives_no_weight_to_a_sybil_that_came_alone_this_round():
    """A round where only one sybil's model came (the twin's and the honest partner's
    exchanges failed): scaled by this round's neighbours alone, that sybil was its own
    maximum and got half our model (seen in the swarm test under load). The recent direct
    neighbours' entries join the scale, and the absent twin's history condemns it."""
    g = torch.Generator().manual_seed(4)
    own = ref = mlp(0)
    wall = make_aggregator("sybilwall", self_id="me", reference=ref)
    sybil = nudged(own, g)
    first = wall.aggregate(1, own, [Incoming("s1", sybil), Incoming("s2", sybil),
                                    Incoming("h", nudged(own, g))])
    assert first.weights["s1"] == first.weights["s2"] == 0.0 and first.weights["h"] > 0
    alone = wall.aggregate(2, own, [Incoming("s1", nudged(sybil, g, 0.01))])
    assert alone.weights == {"self": 1.0, "s1": 0.0}
    # long after, the entries are no longer recent: a lone model weighs like us again
    late = wall.aggregate(9, own, [Incoming("h", nudged(own, g))])
    assert late.weights == {"self": 0.5, "h": 0.5}


def test_sybilwall_remembers_neighbours_that_once_sent_one_model():
    """The swarm test under load: the twin's entry, rounds old, no longer resembles the
    sybil that came alone, while an honest neighbour that averages with its own partner
    every round looks like that partner's gossiped history; scored on today's histories,
    the sybil was the most unique model and got half of ours. Two models that arrived
    bit-identical in one round are one attacker for as long as both entries are held."""
    g = torch.Generator().manual_seed(5)
    own = ref = mlp(0)
    honest, sybil = nudged(own, g), nudged(own, g)

    def lone_sybil_round(twin: State) -> dict[str, float]:
        wall = make_aggregator("sybilwall", self_id="me", reference=ref)
        wall.aggregate(1, own, [Incoming("s1", sybil), Incoming("s2", twin),
                                Incoming("h", honest)])
        pair = flat(nudged(honest, g, 0.001)) - flat(ref)  # h's partner, heard by gossip
        assert wall.history.offer("h", HistoryEntry("p", 9, 1, pair)) is None
        moved = nudged(sybil, g, 0.05)  # the sybil trained on since its twin was seen
        return wall.aggregate(10, own, [Incoming("s1", moved), Incoming("h", honest)]).weights

    weights = lone_sybil_round(twin=sybil)
    assert weights["s1"] == 0.0 and weights["h"] == pytest.approx(0.5), weights
    # Only bit-identical models link: a twin off by a rounding is not remembered, and then
    # the lone sybil wins (what the memory prevents).
    almost = {k: v + 1e-7 * torch.randn(v.shape, generator=g) for k, v in sybil.items()}
    weights = lone_sybil_round(twin=almost)
    assert weights["s1"] == pytest.approx(0.5) and weights["h"] == 0.0, weights


def test_sybilwall_renormalises_over_the_models_it_aggregates_only():
    """The reference code's bug (spec §3g): it normalised over all N + M + 1 scores and
    zipped only N + 1 models with them, so our model took the first distant peer's score
    (here 0: two distant sybils) and the weights used summed to less than 1."""
    g = torch.Generator().manual_seed(2)
    own = ref = mlp(0)
    wall = make_aggregator("sybilwall", self_id="me", reference=ref)
    twin = torch.randn(numel(own), generator=g)
    for i, far in enumerate([twin, twin.clone(), torch.randn(numel(own), generator=g)]):
        assert wall.history.offer("h0", HistoryEntry(f"far{i}", 1, 2, far)) is None
    incoming = [Incoming(f"h{i}", nudged(own, g)) for i in range(2)]
    result = wall.aggregate(1, own, incoming)
    scores = wall.last_scores
    assert list(scores) == ["h0", "h1", "far0", "far1", "far2"]  # neighbours first
    assert scores["far0"] == scores["far1"] == 0.0 and scores["far2"] > 0
    assert set(result.weights) == {"self", "h0", "h1"}
    total = 1 + scores["h0"] + scores["h1"]
    assert result.weights["self"] == pytest.approx(1 / total)  # not far0's 0
    assert result.weights["h0"] == pytest.approx(scores["h0"] / total)
    assert math.isclose(math.fsum(result.weights.values()), 1.0)
    expected = {
        k: sum(
            result.weights[p] * s[k]
            for p, s in [("self", own), *((i.peer, i.state) for i in incoming)]
        )
        for k in own
    }
    assert close(result.state, expected, atol=1e-6)


def test_sybilwall_degenerate_rounds():
    g = torch.Generator().manual_seed(3)
    own = ref = mlp(0)
    # A single neighbour: nothing to compare it with, so it weighs like us.
    one = make_aggregator("sybilwall", self_id="me", reference=ref)
    assert one.aggregate(1, own, [Incoming("a", nudged(own, g))]).weights == {"self": 0.5, "a": 0.5}
    # Every neighbour a twin of another: all score 0 and we keep our own model.
    twins = make_aggregator("sybilwall", self_id="me", reference=ref)
    sybil = nudged(own, g)
    result = twins.aggregate(1, own, [Incoming("a", sybil), Incoming("b", sybil)])
    assert result.weights == {"self": 1.0, "a": 0.0, "b": 0.0}
    assert close(result.state, own, atol=0)
    # Neighbours that have not moved from the reference: zero histories, finite weights.
    still = make_aggregator("sybilwall", self_id="me", reference=ref)
    result = still.aggregate(1, own, [Incoming("a", mlp(0)), Incoming("b", mlp(0))])
    assert finite(result.state) and all(math.isfinite(w) for w in result.weights.values())
    # A reference of another model is a configuration error, said at once.
    wrong = make_aggregator("sybilwall", self_id="me", reference={"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="not the same model"):
        wrong.aggregate(1, own, [Incoming("a", mlp(1))])


def test_sybilwall_survives_a_gossiped_history_of_the_wrong_length():
    """Before any model is seen the length is unknown, so gossip is refused; after, only
    the model's length is accepted. A wrong-length entry can never reach the matrix."""
    own = mlp(0)
    wall = make_aggregator("sybilwall", self_id="me")  # no reference: length learnt
    assert "no history length" in wall.history.offer("b", HistoryEntry("x", 1, 1, torch.ones(3)))
    wall.aggregate(1, own, [Incoming("a", mlp(1)), Incoming("b", mlp(2))])
    assert "expected" in wall.history.offer("b", HistoryEntry("x", 2, 1, torch.ones(3)))
    result = wall.aggregate(2, own, [Incoming("a", mlp(1))])
    assert finite(result.state)


# -- the history table -------------------------------------------------------------------

N = 8


def entry(peer: str, round: int = 1, distance: int = 1, n: int = N) -> HistoryEntry:
    return HistoryEntry(peer, round, distance, torch.ones(n) * round)


def vec(*values: float) -> State:
    return {"w": torch.tensor(values)}


def test_direct_histories_are_the_accumulated_updates_from_the_reference():
    """H ← w − w0 at first sighting, then H ← H + (w_new − w_prev): the table's H is the
    running sum of the updates it saw."""
    t = HistoryTable("me", reference=vec(1.0, 1.0))
    t.observe_direct("a", 1, vec(2.0, 1.0))
    assert t.entries["a"].vector.tolist() == [1.0, 0.0]
    t.observe_direct("a", 2, vec(2.0, 4.0))  # update (0, 3)
    t.observe_direct("a", 3, vec(0.0, 4.0))  # update (−2, 0)
    assert t.entries["a"].vector.tolist() == [1.0 + 0 - 2, 0.0 + 3 + 0]
    assert (t.entries["a"].round, t.entries["a"].distance) == (3, 1)
    no_ref = HistoryTable("me")
    no_ref.observe_direct("a", 1, vec(2.0, 1.0))  # first sighting without w0: H ← w
    assert no_ref.entries["a"].vector.tolist() == [2.0, 1.0] and no_ref.numel == 2


def test_direct_entries_are_never_overwritten_by_gossip():
    t = HistoryTable("me", numel=N)
    t.observe_direct("a", 1, {"w": torch.zeros(N)})
    assert "direct neighbour" in t.offer("b", entry("a", round=5))
    assert t.entries["a"].distance == 1 and float(t.entries["a"].vector.abs().sum()) == 0
    # ...but a direct observation replaces a gossiped entry.
    assert t.offer("b", entry("c", round=9)) is None
    t.observe_direct("c", 2, {"w": torch.zeros(N)})
    assert t.entries["c"].distance == 1 and t.entries["c"].received_from is None


def test_gossiped_entries_are_stored_one_hop_further_and_replaced_only_by_newer_rounds():
    t = HistoryTable("me", numel=N)
    assert t.offer("b", entry("a", round=3)) is None
    assert t.entries["a"].distance == 2 and t.entries["a"].received_from == "b"
    assert "not newer" in t.offer("c", entry("a", round=3))
    assert t.offer("c", entry("a", round=4, distance=3)) is None
    assert t.entries["a"].distance == 4 and t.entries["a"].received_from == "c"


def test_table_refuses_self_sender_absurd_and_malformed_entries():
    t = HistoryTable("me", numel=N, max_distance=8)
    assert "ourselves" in t.offer("b", entry("me"))
    assert "sender itself" in t.offer("b", entry("b"))
    assert "absurd distance" in t.offer("b", entry("x", distance=50))
    assert "absurd distance" in t.offer("b", entry("x", distance=8))  # would be stored at 9
    assert t.offer("b", entry("y", distance=7)) is None  # stored at 8, the bound
    assert "absurd distance" in t.offer("c", entry("x", distance=0))
    assert "round" in t.offer("c", entry("x", round=-1))
    assert "expected 8" in t.offer("c", entry("x", n=9))
    bad = entry("x")
    bad.vector[0] = float("inf")
    assert "NaN" in t.offer("d", bad)
    assert set(t.entries) == {"y"}


def test_a_flooding_sender_is_cut_each_round():
    t = HistoryTable("me", numel=N, max_per_sender_per_round=4)
    results = [t.offer("flooder", entry(f"x{i}")) for i in range(20)]
    assert results[:4] == [None] * 4 and all("flood" in r for r in results[4:])
    assert t.offer("honest", entry("y")) is None  # others are not cut
    t.begin_round(2)
    assert t.offer("flooder", entry("x9", round=2)) is None  # a new round, a new budget


def test_the_table_is_bounded_and_evicts_the_oldest_gossip_first():
    t = HistoryTable("me", numel=N, max_peers=10, max_per_sender_per_round=4)
    t.observe_direct("direct", 1, {"w": torch.zeros(N)})
    for r in range(1, 6):
        t.begin_round(r)
        for sender in range(5):
            for i in range(4):
                t.offer(f"s{sender}", entry(f"p{r}-{sender}-{i}", round=r))
    assert len(t.entries) == 10
    assert "direct" in t.entries  # direct entries go last
    assert all(e.round == 5 for e in t.entries.values() if e.distance > 1)
    # An entry older than everything gossiped is refused, not stored and dropped.
    assert "newer" in t.offer("late", entry("old", round=1))
    full = HistoryTable("me", numel=N, max_peers=2)
    full.observe_direct("a", 1, {"w": torch.zeros(N)})
    full.observe_direct("b", 1, {"w": torch.zeros(N)})
    assert "full of direct" in full.offer("c", entry("x"))
    full.observe_direct("c", 2, {"w": torch.zeros(N)})  # a new neighbour displaces the oldest
    assert set(full.entries) == {"b", "c"}


def test_sampling_prefers_nearby_peers_as_the_spec_says():
    t = HistoryTable("me", numel=N)
    t.observe_direct("near", 1, {"w": torch.zeros(N)})  # d = 1
    assert t.offer("other", entry("mid", distance=1)) is None  # d = 2
    assert t.offer("other", entry("far", distance=4)) is None  # d = 5
    rng = random.Random(0)
    draws = 6000
    picks = [t.sample_for("q", rng).peer for _ in range(draws)]
    weights = {p: math.exp(-0.8 * (d - 1)) for p, d in (("near", 1), ("mid", 2), ("far", 5))}
    total = sum(weights.values())
    for peer, w in weights.items():
        p = w / total
        sd = math.sqrt(draws * p * (1 - p))
        assert abs(picks.count(peer) - draws * p) < 4 * sd, (peer, picks.count(peer), draws * p)
    # Deterministic given the rng's seed.
    again = random.Random(0)
    assert [t.sample_for("q", again).peer for _ in range(draws)] == picks


def test_sampling_skips_the_neighbour_and_what_it_told_us():
    t = HistoryTable("me", numel=N)
    t.observe_direct("near", 1, {"w": torch.zeros(N)})
    assert t.offer("near", entry("far", distance=4)) is None  # came from "near"
    assert t.offer("other", entry("mid", distance=1)) is None
    rng = random.Random(1)
    assert {t.sample_for("near", rng).peer for _ in range(1000)} == {"mid"}
    assert {t.sample_for("other", rng).peer for _ in range(1000)} == {"near", "far"}
    lonely = HistoryTable("me", numel=N)
    lonely.observe_direct("a", 1, {"w": torch.zeros(N)})
    assert lonely.sample_for("a", rng) is None


def test_rounds_are_bounded_a_future_round_is_refused_and_old_entries_expire():
    t = HistoryTable("me", numel=N, max_ahead=8, max_age=64)
    t.begin_round(10)
    assert "rounds past ours" in t.offer("s", entry("pinned", round=10**9))
    assert t.offer("s", entry("soon", round=18)) is None  # clock skew between peers is fine
    assert t.offer("s", entry("now", round=10)) is None
    t.observe_direct("direct", 10, {"w": torch.zeros(N)})
    t.begin_round(74)  # 10 is exactly max_age behind: kept
    assert {"soon", "now", "direct"} <= set(t.entries)
    t.begin_round(75)
    assert set(t.entries) == {"soon"}  # forgotten: gossiped and direct alike


def test_an_entry_taken_before_our_first_round_cannot_pin_itself():
    t = HistoryTable("me", numel=N)
    assert t.offer("s", entry("pinned", round=10**9)) is None  # we have no round yet
    t.begin_round(3)
    assert "pinned" not in t.entries
