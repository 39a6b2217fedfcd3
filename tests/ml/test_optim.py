"""node/ml/optim/: NoLoCo pairing, the NoLoCo and DiLoCo outer steps, and a replica simulation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.ml.optim import (
    DiLoCo,
    DiLoCoConfig,
    NoLoCo,
    NoLoCoConfig,
    group_of,
    noloco_groups,
    partner_of,
)
from node.ml.trainer import TaskConfig, TrainConfig, Trainer, build_task

peer_ids = st.lists(st.text(min_size=1, max_size=12), min_size=0, max_size=40, unique=True)

# ------------------------------------------------------------------------------------------------
# Pairing


@settings(max_examples=150, deadline=None)
@given(
    peers=peer_ids,
    round_=st.integers(min_value=0, max_value=2**40),
    group_size=st.integers(1, 5),
    data=st.data(),
)
def test_groups_partition_and_ignore_input_order(peers, round_, group_size, data):
    groups = noloco_groups(round_, peers, group_size)
    shuffled = data.draw(st.permutations(peers))
    assert noloco_groups(round_, shuffled, group_size) == groups
    assert noloco_groups(round_, list(peers), group_size) == groups  # and across calls

    members = [p for g in groups for p in g]
    assert sorted(members) == sorted(peers)  # every peer in exactly one group
    if peers:
        assert all(len(g) >= min(group_size, len(peers)) for g in groups)
        assert all(len(g) < 2 * group_size for g in groups) or len(groups) == 1
    if peers and len(peers) % group_size == 0:
        assert all(len(g) == group_size for g in groups)  # the reference's layout
    for g in groups:
        for me in g:
            assert group_of(me, round_, shuffled, group_size) == g
            partners = partner_of(me, round_, shuffled, group_size)
            assert me not in partners
            for other in partners:  # symmetric
                assert me in partner_of(other, round_, peers, group_size)


def test_pairs_change_across_rounds():
    peers = [f"peer-{i}" for i in range(16)]
    layouts = {tuple(map(tuple, noloco_groups(r, peers))) for r in range(20)}
    assert len(layouts) == 20
    partners = {partner_of("peer-3", r, peers)[0] for r in range(40)}
    assert len(partners) >= 8  # a random partner, not a fixed one


def test_pairing_edge_cases():
    assert noloco_groups(5, []) == []
    assert noloco_groups(5, ["solo"]) == [["solo"]]
    assert partner_of("solo", 5, ["solo"]) == []
    odd = noloco_groups(3, ["a", "b", "c", "d", "e"])
    assert sorted(len(g) for g in odd) == [2, 3]  # the leftover joins a group
    assert sorted(len(g) for g in noloco_groups(3, ["a", "b", "c"], group_size=4)) == [3]
    with pytest.raises(ValueError, match="unique"):
        noloco_groups(0, ["a", "a"])
    with pytest.raises(ValueError, match="not among"):
        partner_of("z", 0, ["a", "b"])
    with pytest.raises(ValueError, match="round"):
        noloco_groups(-1, ["a", "b"])
    with pytest.raises(ValueError, match="group_size"):
        noloco_groups(0, ["a", "b"], group_size=0)


def test_pairing_is_pinned():
    # Golden values: every peer, on every version, must compute these. If this fails the
    # grouping function changed, and peers on old and new versions would not find each other.
    peers = [f"p{i}" for i in range(8)]
    assert noloco_groups(1, peers) == [["p0", "p6"], ["p5", "p1"], ["p7", "p3"], ["p4", "p2"]]
    assert noloco_groups(0, ["a", "b", "c", "d", "e"]) == [["d", "b", "a"], ["c", "e"]]


# ------------------------------------------------------------------------------------------------
# Outer steps on random vectors


def _vectors(n: int, size: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


def test_diloco_nesterov_and_heavy_ball_match_torch_sgd():
    for nesterov in (True, False):
        phi0 = _vectors(1, seed=1)[0]
        outer = DiLoCo(phi0, DiLoCoConfig(outer_lr=0.7, momentum=0.9, nesterov=nesterov))
        reference = torch.nn.Parameter(phi0.clone())
        sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=nesterov)
        for r in range(5):
            thetas = [outer.phi + 0.1 * v for v in _vectors(3, seed=10 + r)]
            deltas = [outer.pseudo_gradient(t) for t in thetas]
            outer.outer_step(deltas)
            reference.grad = torch.stack(deltas).mean(0)
            sgd.step()
            torch.testing.assert_close(outer.phi, reference.detach(), rtol=1e-6, atol=1e-6)


def test_noloco_with_every_replica_equals_diloco_heavy_ball():
    k, mu, eta = 4, 0.5, 0.7
    phi0 = _vectors(1, seed=2)[0]
    nolocos = [NoLoCo(phi0, NoLoCoConfig(outer_lr=eta, momentum=mu)) for _ in range(k)]
    dilocos = [
        DiLoCo(phi0, DiLoCoConfig(outer_lr=eta, momentum=mu, nesterov=False)) for _ in range(k)
    ]
    for r in range(6):
        steps = _vectors(k, seed=100 + r)
        thetas = [nolocos[i].phi + 0.05 * steps[i] for i in range(k)]
        new_phis = [
            nolocos[i].outer_step(thetas[i], [thetas[j] for j in range(k) if j != i]).clone()
            for i in range(k)
        ]
        deltas = [dilocos[i].pseudo_gradient(thetas[i]) for i in range(k)]
        for d in dilocos:
            d.outer_step(deltas)
        for i in range(k):
            torch.testing.assert_close(new_phis[i], dilocos[i].phi, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(nolocos[i].m, -eta * dilocos[i].m, rtol=1e-5, atol=1e-6)


def test_noloco_update_rule_and_local_step():
    phi0, theta, other = _vectors(3, seed=3)
    outer = NoLoCo(phi0, NoLoCoConfig(outer_lr=0.7, momentum=0.5))
    new = outer.outer_step(theta, [other]).clone()
    m1 = 0.7 * ((theta + other) / 2 - phi0)
    torch.testing.assert_close(new, phi0 + m1)
    # No partner this round: G = {self}.
    theta2 = new + 0.1
    outer.outer_step(theta2)
    m2 = 0.5 * m1 + 0.7 * (theta2 - new)
    torch.testing.assert_close(outer.m, m2)
    torch.testing.assert_close(outer.phi, new + m2)


def test_outer_optimizers_refuse_bad_vectors():
    phi0 = torch.zeros(10)
    noloco, diloco = NoLoCo(phi0), DiLoCo(phi0)
    for outer, step in ((noloco, noloco.outer_step), (diloco, lambda t: diloco.outer_step([t]))):
        with pytest.raises(ValueError, match="expected 10"):
            step(torch.zeros(11))
        with pytest.raises(ValueError, match="NaN"):
            step(torch.full((10,), float("nan")))
        with pytest.raises(ValueError, match="flat"):
            step(torch.zeros(2, 5))
        assert torch.equal(outer.phi, phi0)  # nothing applied
    with pytest.raises(ValueError, match="empty"):
        DiLoCo(phi0).outer_step([])


def test_outer_state_round_trip_and_fp32():
    phi0 = torch.randn(50, dtype=torch.bfloat16)
    for cls in (NoLoCo, DiLoCo):
        a = cls(phi0)
        assert a.phi.dtype == torch.float32 and a.m.dtype == torch.float32
        theta = torch.randn(50)
        a.outer_step(theta) if cls is NoLoCo else a.outer_step([a.pseudo_gradient(theta)])
        b = cls(torch.zeros(50))
        b.load_state_dict(a.state_dict())
        assert torch.equal(a.phi, b.phi) and torch.equal(a.m, b.m) and b.rounds == 1


# ------------------------------------------------------------------------------------------------
# In-process replicas of a real (tiny) model


@pytest.fixture(scope="module")
def digits_task():
    return build_task(TaskConfig(name="digits-mlp"))


def _replicas(task, k: int, seed: int = 7) -> list[Trainer]:
    config = dict(batch_size=32, lr=2e-3, warmup_steps=5, max_steps=200, eval_every=0, seed=seed)
    return [Trainer(task, TrainConfig(**config, replica=r)) for r in range(k)]


def _spread(vectors: list[torch.Tensor]) -> float:
    """sqrt(mean((θ − mean_r θ)²)): the reference's eval_weight_variance, square-rooted."""
    stacked = torch.stack(vectors)
    return float((stacked - stacked.mean(0)).pow(2).mean().sqrt())


def test_noloco_all_replicas_equals_diloco_heavy_ball_on_trainers(digits_task):
    k, rounds, inner = 4, 3, 5
    runs = {}
    for algorithm in ("noloco", "diloco"):
        trainers = _replicas(digits_task, k)
        start = trainers[0].parameters_vector()
        if algorithm == "noloco":
            outers = [NoLoCo(start, NoLoCoConfig(0.7, 0.5)) for _ in range(k)]
        else:
            outers = [DiLoCo(start, DiLoCoConfig(0.7, 0.5, nesterov=False)) for _ in range(k)]
        for _ in range(rounds):
            for t in trainers:
                for _ in range(inner):
                    t.step()
            thetas = [t.parameters_vector() for t in trainers]
            if algorithm == "noloco":
                for i, (t, o) in enumerate(zip(trainers, outers, strict=True)):
                    t.set_parameters_vector(o.outer_step(thetas[i], thetas[:i] + thetas[i + 1 :]))
            else:
                deltas = [o.pseudo_gradient(th) for o, th in zip(outers, thetas, strict=True)]
                for t, o in zip(trainers, outers, strict=True):
                    t.set_parameters_vector(o.outer_step(deltas))
        runs[algorithm] = [t.parameters_vector() for t in trainers]
    for a, b in zip(runs["noloco"], runs["diloco"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_noloco_keeps_replica_spread_bounded(digits_task):
    k, rounds, inner = 4, 6, 10
    spreads: dict[str, list[float]] = {}
    for algorithm in ("noloco", "none"):
        trainers = _replicas(digits_task, k)
        start = trainers[0].parameters_vector()
        assert all(torch.equal(t.parameters_vector(), start) for t in trainers)  # same init
        outers = [NoLoCo(start) for _ in range(k)]
        names = [f"replica-{i}" for i in range(k)]
        spreads[algorithm] = []
        for r in range(rounds):
            for t in trainers:
                for _ in range(inner):
                    t.step()
            thetas = [t.parameters_vector() for t in trainers]
            if algorithm == "noloco":
                for i, t in enumerate(trainers):
                    group = partner_of(names[i], r, names)
                    others = [thetas[names.index(p)] for p in group]
                    t.set_parameters_vector(outers[i].outer_step(thetas[i], others))
                spreads[algorithm].append(_spread([t.parameters_vector() for t in trainers]))
            else:
                spreads[algorithm].append(_spread(thetas))
    none, noloco = spreads["none"], spreads["noloco"]
    # Measured (torch 2.13 CPU): none grows 0.0034 -> 0.0098; noloco stays in 0.001-0.003.
    assert none[-1] > 2 * none[0]  # left alone, replicas drift apart
    assert max(noloco) < 0.5 * none[-1]  # pairwise averaging keeps them together


@pytest.mark.parametrize(("n", "k"), [(7, 3), (20, 4), (20, 1), (5, 2), (3, 3), (50, 5)])
def test_gossip_neighbours_are_symmetric_about_k_and_agreed_by_everyone(n, k):
    from node.ml.optim import neighbours_of

    peers = [f"peer-{i:02d}" for i in range(n)]
    for r in (0, 1, 17):
        graph = {p: neighbours_of(p, r, list(reversed(peers)), k) for p in peers}
        for p, ns in graph.items():
            assert p not in ns
            assert all(p in graph[q] for q in ns)  # both ends agree on every edge
            assert 1 <= len(ns) <= (n - 1 if n <= k + 1 else k + (k % 2))
        mean = sum(map(len, graph.values())) / n
        assert mean >= min(n - 1, k) * 0.75
    met = {q for r in range(10) for q in neighbours_of("peer-00", r, peers, k)}
    assert len(met) > k or n <= k + 1  # the graph changes from round to round


def test_a_fixed_topology_replaces_pairing_and_random_neighbours():
    """NodeConfig.neighbours (`node join --neighbour`, testnets): the same live peers every
    round, whatever the run's pairing would draw; a listed peer that is gone is skipped."""
    from types import SimpleNamespace

    from node.averaging.service import Averager

    live = ["a", "b", "c", "d", "e"]
    substrate = SimpleNamespace(set_handler=lambda *args: None, listen=[])
    for k in (None, 2):
        avg = Averager(substrate, "run", "a", lambda: live, codecs=["fp32"], neighbours=k,
                       fixed_neighbours=["c", "e", "gone", "a"])
        assert all(avg.group(r) == ["c", "e"] for r in range(20))
        drawn = Averager(substrate, "run", "a", lambda: live, codecs=["fp32"], neighbours=k)
        assert len({tuple(drawn.group(r)) for r in range(20)}) > 1  # the run's draw varies


def test_an_exchange_deadline_grows_with_the_partner_s_round_trip_time():
    """A far partner (a relay, another continent) spends several round trips before the
    first vector byte: its deadline holds them, over the transfer and the boundary skew."""
    from types import SimpleNamespace

    from node.averaging.service import HANDSHAKE_RTTS, Averager
    from node.transport.transports import Transports

    substrate = SimpleNamespace(set_handler=lambda *args: None, listen=[])
    rtt = {"near": 0.001, "far": 0.5}
    door = Transports(substrate)  # type: ignore[arg-type]
    door.attach(kinds=SimpleNamespace(paths=dict, rtt_ms={k: v * 1000 for k, v in rtt.items()}))
    avg = Averager(substrate, "run", "a", lambda: ["near", "far"], codecs=["fp32"],
                   step_time=lambda: 0.2, inner_steps=50, transports=door)
    numel = 10_000_000  # 80 MB both ways at the 50 MB/s prior: 1.6 s, x4
    near, far, unmeasured = (avg.deadline(p, numel) for p in ("near", "far", "new"))
    assert far - near == pytest.approx(HANDSHAKE_RTTS * (0.5 - 0.001))
    # no RTT yet: none added; a partner never measured gets at least our own exchanges'
    # expected seconds (the prior's, before the first)
    assert unmeasured == pytest.approx(4 * max(1.6, avg.expected_exchange_s(numel))
                                       + 0.5 * 50 * 0.2)
