"""The one-process harness behind `node bench robust` (specs/algorithms.md §5, "one CPU
harness"): N peers simulated in one process, exchanging models over a fixed graph and
combining them with the same aggregators the nodes run (node/ml/aggregate). No network, no
trainer thread: models are small dicts of tensors trained with plain SGD, so a full sweep
of aggregators x attacks x sybil counts fits in a few minutes of one core.

Two experiments:

- `run_sybil`: honest peers on a random regular graph plus one attacker whose K sybil
  identities all send the attacker's one poisoned model (spec §3, "small-scale
  reproduction"); SybilWall's history tables gossip one entry per neighbour per round.
- `run_vc`: gossip learning from independent initialisations, plain mean vs variance
  correction, against a shared-initialisation run (spec §2, "small-scale reproduction").

Everything is drawn from seeded generators: one seed gives one result, bit for bit.
"""

from __future__ import annotations

import copy
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import torch
import torch.nn.functional as F

from node.ml.aggregate import HistoryTable, Incoming, make_aggregator
from node.ml.trainer.tasks import BACKDOOR_TARGET, DigitsData, add_trigger, load_digits

State = dict[str, torch.Tensor]
Progress = Callable[[str], None]

N_FEATURES, N_CLASSES = 64, 10


# ------------------------------------------------------------------------------------------
# Models: functional, so that a peer's model is just its state dict


@dataclass(frozen=True, slots=True)
class MLPShape:
    """Layer widths, input to output; (64, 10) is logistic regression."""

    widths: tuple[int, ...] = (N_FEATURES, N_CLASSES)

    def layers(self) -> list[tuple[str, int, int]]:
        """(name, fan_in, fan_out) of each linear layer."""
        return [(f"fc{i + 1}", a, b) for i, (a, b) in enumerate(pairwise(self.widths))]

    def init(self, generator: torch.Generator) -> State:
        """Xavier-uniform weights (variance 2 / (fan_in + fan_out)), zero biases."""
        state: State = {}
        for name, fan_in, fan_out in self.layers():
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            w = torch.rand(fan_out, fan_in, generator=generator) * (2 * bound) - bound
            state[f"{name}.weight"] = w
            state[f"{name}.bias"] = torch.zeros(fan_out)
        return state

    def forward(self, state: State, x: torch.Tensor) -> torch.Tensor:
        names = [name for name, _, _ in self.layers()]
        for i, name in enumerate(names):
            x = F.linear(x, state[f"{name}.weight"], state[f"{name}.bias"])
            if i < len(names) - 1:
                x = F.relu(x)
        return x


def sgd_epoch(
    shape: MLPShape,
    state: State,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    lr: float,
    batch: int,
    generator: torch.Generator,
) -> State:
    """One pass over (x, y) in shuffled mini-batches of plain SGD; returns a new state."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in state.items()}
    order = torch.randperm(len(y), generator=generator)
    for start in range(0, len(y), batch):
        ix = order[start : start + batch]
        loss = F.cross_entropy(shape.forward(params, x[ix]), y[ix])
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads, strict=True):
                p -= lr * g
    return {k: v.detach() for k, v in params.items()}


@torch.no_grad()
def accuracy(shape: MLPShape, state: State, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((shape.forward(state, x).argmax(-1) == y).float().mean())


@torch.no_grad()
def attack_rates(shape: MLPShape, state: State, data: DigitsData) -> dict[str, float]:
    """Attack success on the test set (spec §3d): label-flip = 0/1 samples predicted as the
    other of the two; backdoor = triggered samples of classes other than the target,
    predicted as the target."""
    x, y = data.x_test, data.y_test
    pairs = (y == 0) | (y == 1)
    flipped = shape.forward(state, x[pairs]).argmax(-1) == 1 - y[pairs]
    others = y != BACKDOOR_TARGET
    hit = shape.forward(state, add_trigger(x[others])).argmax(-1) == BACKDOOR_TARGET
    return {"label-flip": float(flipped.float().mean()), "backdoor": float(hit.float().mean())}


# ------------------------------------------------------------------------------------------
# Data and graphs


def dirichlet_split(
    y: torch.Tensor, parts: int, alpha: float, rng: np.random.Generator, min_size: int = 8
) -> list[torch.Tensor]:
    """Non-IID shards: each class's samples split over `parts` by Dirichlet(alpha)
    proportions (Hsu et al. 2019), redrawn until every shard has `min_size` samples so no
    peer trains on nothing. Small alpha: most peers hold one or two classes."""
    labels = y.numpy()
    for _ in range(1000):  # bounded; at alpha 0.1 and 21 parts a draw succeeds in ~10 tries
        shards: list[list[int]] = [[] for _ in range(parts)]
        for c in range(int(labels.max()) + 1):
            idx = np.flatnonzero(labels == c)
            rng.shuffle(idx)
            cuts = (np.cumsum(rng.dirichlet([alpha] * parts)) * len(idx)).astype(int)[:-1]
            for shard, piece in zip(shards, np.split(idx, cuts), strict=True):
                shard.extend(piece.tolist())
        if min(len(s) for s in shards) >= min_size:
            return [torch.tensor(sorted(s), dtype=torch.int64) for s in shards]
    raise ValueError(
        f"no Dirichlet({alpha}) split of {len(y)} samples gives {parts} shards of >= {min_size}"
    )


def random_regular_graph(n: int, degree: int, rng: np.random.Generator) -> list[list[int]]:
    """Adjacency lists of a uniform-ish random `degree`-regular simple graph (pairing model,
    redrawn on self-loops or double edges)."""
    if n * degree % 2 or degree >= n:
        raise ValueError(f"no {degree}-regular graph on {n} nodes")
    for _ in range(10_000):  # bounded; small graphs succeed in a few dozen draws
        stubs = np.repeat(np.arange(n), degree)
        rng.shuffle(stubs)
        a, b = stubs[0::2], stubs[1::2]
        edges = {(min(u, v), max(u, v)) for u, v in zip(a.tolist(), b.tolist(), strict=True)}
        if len(edges) == len(a) and all(u != v for u, v in edges):
            adj: list[list[int]] = [[] for _ in range(n)]
            for u, v in sorted(edges):
                adj[u].append(v)
                adj[v].append(u)
            return adj
    raise ValueError(f"could not draw a {degree}-regular graph on {n} nodes")


def poisoned_set(data: DigitsData, own: torch.Tensor, attack: str) -> tuple[torch.Tensor, ...]:
    """The attacker's training set, after the reference code (spec §3d, sources in §3h).

    label-flip: its own shard with 0 and 1 swapped, plus every 0/1 training sample with the
    swapped label (experiment_infrastructure/attacks/label_flip.py). backdoor: its own shard
    clean, plus a triggered copy of every training sample labelled BACKDOOR_TARGET (the
    reference triggers its shard only; keeping clean samples hides the backdoor better and
    covering every class teaches the trigger for every class).
    """
    x, y = data.x_train, data.y_train
    if attack == "label-flip":
        own_y = y[own].clone()
        zero, one = own_y == 0, own_y == 1
        own_y[zero], own_y[one] = 1, 0
        pick = (y == 0) | (y == 1)
        return torch.cat([x[own], x[pick]]), torch.cat([own_y, 1 - y[pick]])
    if attack == "backdoor":
        return (
            torch.cat([x[own], add_trigger(x)]),
            torch.cat([y[own], torch.full_like(y, BACKDOOR_TARGET)]),
        )
    raise ValueError(f"unknown attack {attack!r}")


# ------------------------------------------------------------------------------------------
# Experiment 1: sybils


@dataclass(frozen=True, slots=True)
class SybilSetting:
    """One run: an aggregator against one attacker (or none: attack None, k 0)."""

    aggregator: str
    attack: str | None
    k: int  # sybil identities the attacker presents (0: no attacker)
    noise: float = 0.0  # per-sybil Gaussian noise, sd = noise x rms of the attacker's update


@dataclass(frozen=True, slots=True)
class SybilParams:
    honest: int = 20
    degree: int = 4  # honest-honest graph: random regular
    sybil_degree: int = 4  # edges from each sybil identity to distinct random honest peers
    rounds: int = 30
    alpha: float = 0.1  # Dirichlet non-IID split (spec §3d)
    widths: tuple[int, ...] = (N_FEATURES, N_CLASSES)  # logistic regression
    lr: float = 0.3
    batch: int = 8
    seed: int = 0


@dataclass(slots=True)
class SybilResult:
    setting: SybilSetting
    accuracy: float  # mean over honest peers, final models, clean test set
    accuracy_min: float
    attack_rate: float  # mean over honest peers of the setting's attack metric
    base_rates: dict[str, float]  # both attack metrics (for an attack-free run: the floor)
    sybil_weight: float | None  # mean share of weight honest peers gave sybils
    self_weight: float  # mean weight honest peers gave their own model
    seconds: float = 0.0
    accuracy_by_round: list[float] = field(default_factory=list)
    gossip: dict[str, int] = field(default_factory=dict)  # history offers: stored / refused


def _sybil_edges(p: SybilParams, k: int) -> list[list[int]]:
    """Honest neighbours of each sybil; drawn from a generator of its own so that a
    (seed, k) pair gives the same edges for every aggregator."""
    rng = np.random.default_rng([p.seed, 1, k])
    return [sorted(rng.choice(p.honest, p.sybil_degree, replace=False).tolist()) for _ in range(k)]


def run_sybil(
    p: SybilParams,
    s: SybilSetting,
    aggregator_params: dict[str, object] | None = None,
    progress: Progress | None = None,
) -> SybilResult:
    """Simulate `p.rounds` rounds of gossip learning under one attacker (or none) and score
    the honest peers' final models.

    A round: every honest peer trains one local epoch from its model and sends the result
    to all its neighbours; the attacker trains one epoch on its poisoned set and every
    sybil identity sends that model (plus its own noise, if any); honest peers gossip one
    history entry per honest neighbour (SybilWall only); every honest peer aggregates its
    own model with what its neighbours sent; the attacker replaces its model by the plain
    average of its own (once per identity, as the reference `Sybil` does) and the honest
    models its identities received.
    """
    started = time.perf_counter()
    data = load_digits()
    shape = MLPShape(p.widths)
    # The data split and the honest graph depend on the seed only: every run is paired.
    shards = dirichlet_split(data.y_train, p.honest + 1, p.alpha, np.random.default_rng(p.seed))
    adj = random_regular_graph(p.honest, p.degree, np.random.default_rng([p.seed, 2]))
    init = shape.init(torch.Generator().manual_seed(p.seed))  # shared (FL-style)
    hid = [f"honest-{i:02d}" for i in range(p.honest)]
    sid = [f"sybil-{j:02d}" for j in range(s.k)]
    sybil_nbrs = _sybil_edges(p, s.k) if s.attack else []
    nbrs: list[list[str]] = [[hid[j] for j in adj[i]] for i in range(p.honest)]
    for j, honest in enumerate(sybil_nbrs):
        for i in honest:
            nbrs[i].append(sid[j])
    attacked = [any(n in sid for n in nbrs[i]) for i in range(p.honest)]
    params = dict(aggregator_params or {})
    if s.aggregator in ("foolsgold", "sybilwall"):
        # Histories as updates from the shared init (spec §3g: else they telescope).
        params.setdefault("reference", _copy(init))
    aggs = [make_aggregator(s.aggregator, self_id=hid[i], **params) for i in range(p.honest)]
    # SybilWall gossips its table; FoolsGold keeps one too, but scores neighbours only.
    tables = [a.history if getattr(a, "gossip", False) else None for a in aggs]
    gossip_rngs = [random.Random(p.seed * 7919 + i) for i in range(p.honest)]
    noise_gen = torch.Generator().manual_seed(p.seed + 7)
    if s.attack:
        ax, ay = poisoned_set(data, shards[p.honest], s.attack)
    models, attacker = [init] * p.honest, init
    shares: list[float] = []
    gossip: Counter[str] = Counter()
    own_weights: list[float] = []
    acc_by_round: list[float] = []
    for rnd in range(p.rounds):
        gens = [torch.Generator().manual_seed(_seed(p.seed, rnd, i)) for i in range(p.honest + 1)]
        models = _local_epochs(shape, models, data, shards, p.lr, p.batch, gens)
        sent: dict[str, State] = dict(zip(hid, models, strict=True))
        if s.attack:
            attacker = sgd_epoch(
                shape, attacker, ax, ay, lr=p.lr, batch=p.batch, generator=gens[p.honest]
            )
            sd = s.noise * _rms({k: attacker[k] - init[k] for k in init})
            for name in sid:
                sent[name] = (
                    attacker
                    if sd == 0
                    else {
                        k: v + sd * torch.randn(v.shape, generator=noise_gen)
                        for k, v in attacker.items()
                    }
                )
        if all(t is not None for t in tables):
            _gossip_histories(tables, adj, hid, gossip_rngs, gossip)
        new_models = []
        for i in range(p.honest):
            # Each receiver gets its own copy, as it would off the wire.
            incoming = [Incoming(n, _copy(sent[n])) for n in nbrs[i]]
            result = aggs[i].aggregate(rnd, _copy(models[i]), incoming)
            new_models.append({k: v.detach().clone() for k, v in result.state.items()})
            own_weights.append(result.weights.get("self", float("nan")))
            share = _share(result.weights, set(sid))
            if attacked[i] and share is not None:
                shares.append(share)
        if s.attack:
            received = sorted({i for honest in sybil_nbrs for i in honest})
            attacker = _mean([attacker] * s.k + [models[i] for i in received])
        models = new_models
        acc_by_round.append(
            float(np.mean([accuracy(shape, m, data.x_test, data.y_test) for m in models]))
        )
        if progress is not None:
            progress(f"{s.aggregator} {s.attack or 'clean'} K={s.k}: round {rnd + 1}/{p.rounds}")
    accs = [accuracy(shape, m, data.x_test, data.y_test) for m in models]
    rates = [attack_rates(shape, m, data) for m in models]
    base = {a: float(np.mean([r[a] for r in rates])) for a in ("label-flip", "backdoor")}
    return SybilResult(
        setting=s,
        accuracy=float(np.mean(accs)),
        accuracy_min=float(np.min(accs)),
        attack_rate=base[s.attack] if s.attack else float("nan"),
        base_rates=base,
        sybil_weight=float(np.mean(shares)) if shares else None,
        self_weight=float(np.mean(own_weights)),
        seconds=time.perf_counter() - started,
        accuracy_by_round=acc_by_round,
        gossip=dict(gossip),
    )


def _gossip_histories(
    tables: Sequence[HistoryTable],
    adj: list[list[int]],
    ids: list[str],
    rngs: list[random.Random],
    outcome: Counter[str],
) -> None:
    """SybilWall's probabilistic gossip (spec §3c, steps 3-4) among honest peers: each
    sends every neighbour one entry of its table. All entries are drawn before any is
    delivered, so the order of peers does not matter; each is deep-copied, as it would be
    off the wire. `outcome` counts "stored" and each refusal reason."""
    deliveries = []
    for i, table in enumerate(tables):
        for q in adj[i]:
            entry = table.sample_for(ids[q], rngs[i])
            if entry is not None:
                deliveries.append((q, ids[i], copy.deepcopy(entry)))
    for q, sender, entry in deliveries:
        reason = tables[q].offer(sender, entry)
        outcome["stored" if reason is None else re.sub(r"\d+", "N", reason)] += 1


def _local_epochs(shape: MLPShape, models: list[State], data: DigitsData,
                  shards: Sequence[torch.Tensor], lr: float, batch: int,
                  gens: Sequence[torch.Generator]) -> list[State]:
    """One epoch of SGD for every honest peer on its own shard (len(models) peers)."""
    return [sgd_epoch(shape, model, data.x_train[shards[i]], data.y_train[shards[i]], lr=lr,
                      batch=batch, generator=gens[i]) for i, model in enumerate(models)]


def _seed(seed: int, rnd: int, peer: int) -> int:
    return (seed * 1_000_003 + rnd) * 1009 + peer


def _copy(state: State) -> State:
    return {k: v.detach().clone() for k, v in state.items()}


def _mean(states: Sequence[State]) -> State:
    return {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}


def _rms(state: State) -> float:
    flat = torch.cat([v.reshape(-1) for v in state.values()])
    return float(flat.pow(2).mean().sqrt())


def _share(weights: dict[str, float], sybils: set[str]) -> float | None:
    """The part of the total weight that went to sybils (None: no weights reported)."""
    total = sum(max(w, 0.0) for w in weights.values())
    if not weights or total <= 0:
        return None
    return sum(max(w, 0.0) for peer, w in weights.items() if peer in sybils) / total


# ------------------------------------------------------------------------------------------
# Experiment 2: variance correction


@dataclass(frozen=True, slots=True)
class VCSetting:
    aggregator: str  # "mean" or "vc"
    shared_init: bool
    # vc only: c = 1/(degree + 1), the mean's weight on the own model instead of VCParams.c,
    # so that the rescaling is the only difference from the mean
    equal_weights: bool = False

    @property
    def label(self) -> str:
        weights = ", equal weights" if self.equal_weights else ""
        init = "shared" if self.shared_init else "independent"
        return f"{self.aggregator}{weights}, {init} init"


@dataclass(frozen=True, slots=True)
class VCParams:
    peers: int = 16
    degree: int = 4
    rounds: int = 60
    alpha: float = 0.5
    widths: tuple[int, ...] = (N_FEATURES, 128, 64, N_CLASSES)
    lr: float = 0.05
    batch: int = 8
    c: float = 0.5  # vc: weight of the own model (spec §2d)
    seed: int = 0


@dataclass(slots=True)
class VCResult:
    setting: VCSetting
    accuracy: list[float]  # mean over peers, at round 0 (init) and after each aggregation
    accuracy_min: list[float]
    # per layer name: mean over peers of Var(weight) / (2 / (fan_in + fan_out)), same rounds
    variance_ratio: dict[str, list[float]]
    seconds: float = 0.0


def run_vc(p: VCParams, s: VCSetting, progress: Progress | None = None) -> VCResult:
    """Gossip learning on a random regular graph: each round every peer trains one local
    epoch, then aggregates its model with its neighbours' (spec §2, small-scale
    reproduction). Independent init: every peer draws its own Xavier weights."""
    started = time.perf_counter()
    data = load_digits()
    shape = MLPShape(p.widths)
    shards = dirichlet_split(data.y_train, p.peers, p.alpha, np.random.default_rng(p.seed))
    adj = random_regular_graph(p.peers, p.degree, np.random.default_rng([p.seed, 2]))
    ids = [f"peer-{i:02d}" for i in range(p.peers)]
    c = 1 / (p.degree + 1) if s.equal_weights else p.c
    params = {"c": c} if s.aggregator == "vc" else {}
    aggs = [make_aggregator(s.aggregator, self_id=ids[i], **params) for i in range(p.peers)]
    models = [
        shape.init(torch.Generator().manual_seed(p.seed if s.shared_init else p.seed + 1 + i))
        for i in range(p.peers)
    ]
    result = VCResult(s, [], [], {name: [] for name, _, _ in shape.layers()})

    def record() -> None:
        accs = [accuracy(shape, m, data.x_test, data.y_test) for m in models]
        result.accuracy.append(float(np.mean(accs)))
        result.accuracy_min.append(float(np.min(accs)))
        for name, fan_in, fan_out in shape.layers():
            xavier = 2.0 / (fan_in + fan_out)
            ratios = [float(m[f"{name}.weight"].var(unbiased=False)) / xavier for m in models]
            result.variance_ratio[name].append(float(np.mean(ratios)))

    record()
    for rnd in range(p.rounds):
        gens = [torch.Generator().manual_seed(_seed(p.seed, rnd, i)) for i in range(p.peers)]
        models = _local_epochs(shape, models, data, shards, p.lr, p.batch, gens)
        models = [
            _copy(
                aggs[i]
                .aggregate(
                    rnd, _copy(models[i]), [Incoming(ids[q], _copy(models[q])) for q in adj[i]]
                )
                .state
            )
            for i in range(p.peers)
        ]
        record()
        if progress is not None:
            progress(f"{s.label}: round {rnd + 1}/{p.rounds}")
    result.seconds = time.perf_counter() - started
    return result
