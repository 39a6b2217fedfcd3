"""Two experiments that need no round loop: a checkpoint download burst, and sybils.

`checkpoint_burst`: a share of the swarm joins at once and every joiner pulls a checkpoint
(node/checkpoints/exchange.py: from every provider it knows, in parallel). Where the
joiners' providers come from is the policy: "newest" is today's (everyone pulls the
newest checkpoint, held by its writer alone: a joiner only provides what it holds after
its pull, and its one extra lookup runs while it pulls); "any-recent" lets each joiner
take any recent checkpoint that passes the progress check (every trainer writes one every
few rounds), one holder drawn at random; "holders" is the node's since issue 30
(node/checkpoints/holders.py, its functions called here): the newest checkpoint starts
with its writer as the one holder, every joiner that finished its pull becomes one more,
each joiner asks the `choose_holders` pick among the holders with a free upload slot (up
to SOURCES at once, topped up as slots free), and each holder serves at most
`UploadSlots(MAX_UPLOADS)` askers (the rest are refused as busy and ask the next).
Bandwidth is shared fluidly: a holder's uplink is split evenly among the pulls it serves,
a joiner's pull is the sum over its holders, capped by its downlink.

`sybil_attack`: SybilWall (node/ml/aggregate, the real class and its history gossip)
against one attacker behind many identities, all sending the same poisoned model, among
honest peers that gossip-learn a quadratic. Attack success: how far the honest peers'
mean model moved from the honest optimum toward the attacker's target, in [0, 1].
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from node.checkpoints.holders import MAX_UPLOADS, SOURCES, UploadSlots, choose_holders
from node.ml.aggregate import HistoryTable, Incoming, make_aggregator

MBIT = 1e6 / 8


@dataclass
class Burst:
    n: int
    joiners: int
    policy: str
    busiest_gb: float  # bytes the busiest holder served, GB
    busiest_pulls: int  # pulls it served at once, at the start
    t50_s: float  # half of the joiners hold their checkpoint
    t99_s: float  # 99% of them


def checkpoint_burst(n: int, share: float, policy: str, size_mb: float,
                     bandwidth_mbit: tuple[float, float], seed: int) -> Burst:
    rng = np.random.default_rng([seed, n, 7])
    joiners = max(1, round(n * share))
    lo, hi = (math.log(x * MBIT) for x in bandwidth_mbit)
    up = np.exp(rng.uniform(lo, hi, n))  # holders' uplinks (the swarm's peers)
    down = np.exp(rng.uniform(lo, hi, joiners))
    if policy == "holders":
        return _holders_burst(n, joiners, up, down, size_mb)
    if policy == "newest":
        holder = np.zeros(joiners, dtype=np.int64)  # peer 0 wrote the newest
    elif policy == "any-recent":
        holder = rng.integers(0, n, joiners)
    else:
        raise ValueError(f"unknown checkpoint policy {policy!r}; known: newest, any-recent, "
                         "holders")
    left = np.full(joiners, size_mb * 1e6)
    served = np.zeros(n)
    busiest_pulls = int(np.bincount(holder, minlength=n).max())
    t, done_at = 0.0, np.full(joiners, np.inf)
    active = np.ones(joiners, dtype=bool)
    while active.any():
        load = np.bincount(holder[active], minlength=n)
        rate = np.minimum(down[active], up[holder[active]] / load[holder[active]])
        dt = float((left[active] / rate).min())
        served += np.bincount(holder[active], weights=rate * dt, minlength=n)
        left[active] -= rate * dt
        t += dt
        finished = np.flatnonzero(active)[left[active] <= 1e-6 * size_mb * 1e6]
        done_at[finished] = t
        active[finished] = False
    return Burst(n, joiners, policy, float(served.max() / 1e9), busiest_pulls,
                 float(np.quantile(done_at, 0.5)), float(np.quantile(done_at, 0.99)))


def _holders_burst(n: int, joiners: int, up: np.ndarray, down: np.ndarray,
                   size_mb: float) -> Burst:
    """The burst under the node's provision (module docstring). Holder ids: "w" (the
    writer, swarm peer 0, with up[0]) and "j<k>" for joiner k once done (its uplink: the
    same draw as its downlink). Events are completions; at each one, waiting joiners in
    id order top up their sources from the holders with a free slot."""
    cid = "ckpt-newest"
    size = size_mb * 1e6
    uplink = {"w": float(up[0])}
    slots = {"w": UploadSlots(MAX_UPLOADS)}
    sources: list[list[str]] = [[] for _ in range(joiners)]
    left = np.full(joiners, size)
    done_at = np.full(joiners, np.inf)
    served: dict[str, float] = {"w": 0.0}
    names = [f"j{k}" for k in range(joiners)]
    busiest_pulls = 0
    t = 0.0
    active = set(range(joiners))

    def top_up() -> None:
        free = [h for h, sl in slots.items() if sl.askers < sl.cap]
        for k in sorted(active, key=lambda k: (len(sources[k]), k)):
            if not free:
                return
            if len(sources[k]) >= SOURCES:
                continue
            for h in choose_holders(cid, names[k], free, SOURCES - len(sources[k]),
                                    exclude=sources[k]):
                if slots[h].acquire(names[k]):
                    sources[k].append(h)
                if slots[h].askers >= slots[h].cap:
                    free.remove(h)

    top_up()
    busiest_pulls = max(sl.askers for sl in slots.values())
    while active:
        act = sorted(active)
        rate = np.zeros(len(act))
        per: list[list[tuple[str, float]]] = []
        for r, k in enumerate(act):
            shares = [(h, uplink[h] / slots[h].askers) for h in sources[k]]
            total = sum(x for _, x in shares)
            scale = min(1.0, float(down[k]) / total) if total > 0 else 0.0
            per.append([(h, x * scale) for h, x in shares])
            rate[r] = total * scale
        if not (rate > 0).any():  # pragma: no cover - the writer always has a slot free
            raise RuntimeError("checkpoint burst stalled: no joiner has a holder")
        moving = rate > 0
        dt = float((left[act][moving] / rate[moving]).min())
        for r, k in enumerate(act):
            for h, x in per[r]:
                served[h] += x * dt
            left[k] -= rate[r] * dt
        t += dt
        for r, k in enumerate(act):
            if rate[r] > 0 and left[k] <= 1e-6 * size:
                done_at[k] = t
                active.discard(k)
                for h in sources[k]:
                    slots[h].release(names[k])
                sources[k] = []
                uplink[names[k]] = float(down[k])  # a pulled checkpoint is served on
                slots[names[k]] = UploadSlots(MAX_UPLOADS)
                served[names[k]] = 0.0
        top_up()
    return Burst(n, joiners, "holders", max(served.values()) / 1e9, busiest_pulls,
                 float(np.quantile(done_at, 0.5)), float(np.quantile(done_at, 0.99)))


@dataclass
class SybilOutcome:
    peers: int
    sybils: int
    aggregator: str
    success: float  # 0: honest models unmoved, 1: at the attacker's target
    sybil_weight: float  # mean weight honest peers with a sybil neighbour gave sybils
    seconds: float


def sybil_attack(peers: int, share: float, aggregator: str, *, rounds: int = 15,
                 degree: int = 4, sybil_degree: int = 4, dim: int = 16,
                 seed: int = 0) -> SybilOutcome:
    """One attacker with round(peers x share) identities among the rest, honest. One
    torch thread: on small tensors more threads cost more than they give (measured 6x
    slower on this loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sybil_attack(peers, share, aggregator, rounds, degree, sybil_degree, dim, seed)
    finally:
        torch.set_num_threads(threads)


def _sybil_attack(peers: int, share: float, aggregator: str, rounds: int, degree: int,
                  sybil_degree: int, dim: int, seed: int) -> SybilOutcome:
    import time

    started = time.perf_counter()
    rng = np.random.default_rng([seed, peers, int(share * 1000)])
    gen = torch.Generator().manual_seed(seed)
    k = round(peers * share)
    h = peers - k
    hid = [f"h{i:05d}" for i in range(h)]
    sid = [f"s{j:05d}" for j in range(k)]
    sybil_ids = set(sid)  # not a prefix test: the own model's weight is keyed "self"
    # honest graph: each peer links to `degree` random others (mean degree ~ 2 x degree / 2)
    nbrs: list[set[int]] = [set() for _ in range(h)]
    for i in range(h):
        while len(nbrs[i]) < degree:
            j = int(rng.integers(h))
            if j != i:
                nbrs[i].add(j)
                nbrs[j].add(i)
    adj = [sorted(s) for s in nbrs]
    sybil_of: list[list[int]] = [[] for _ in range(h)]
    for j in range(k):
        for i in rng.choice(h, sybil_degree, replace=False).tolist():
            sybil_of[i].append(j)
    c_star = torch.zeros(dim)
    c = torch.randn(h, dim, generator=gen)  # honest optima around c*
    u = torch.randn(dim, generator=gen)
    target = c_star + 5.0 * u / u.norm()
    init = {"w": torch.zeros(dim)}
    params = {"reference": init} if aggregator in ("sybilwall", "foolsgold") else {}
    aggs = [make_aggregator(aggregator, self_id=hid[i], **params) for i in range(h)]
    tables: list[HistoryTable | None] = [getattr(a, "history", None)
                                         if getattr(a, "gossip", False) else None for a in aggs]
    rngs = [random.Random(seed * 7919 + i) for i in range(h)]
    models = torch.zeros(h, dim)
    attacker = torch.zeros(dim)
    shares: list[float] = []
    for rnd in range(rounds):
        for _ in range(5):  # local steps toward each honest peer's own optimum, with noise
            models -= 0.2 * (models - c + 0.3 * torch.randn(h, dim, generator=gen))
        attacker = attacker - 0.5 * (attacker - target)
        if all(tb is not None for tb in tables):
            deliveries = []
            for i, tb in enumerate(tables):
                for q in adj[i]:
                    entry = tb.sample_for(hid[q], rngs[i])  # type: ignore[union-attr]
                    if entry is not None:
                        deliveries.append((q, hid[i], entry))
            for q, sender, entry in deliveries:
                tables[q].offer(sender, entry)  # type: ignore[union-attr]
        new = models.clone()
        for i in range(h):
            incoming = [Incoming(hid[q], {"w": models[q].clone()}) for q in adj[i]]
            incoming += [Incoming(sid[j], {"w": attacker.clone()}) for j in sybil_of[i]]
            result = aggs[i].aggregate(rnd, {"w": models[i].clone()}, incoming)
            new[i] = result.state["w"]
            if sybil_of[i]:
                shares.append(sum(w for p, w in result.weights.items() if p in sybil_ids))
        models = new
    moved = float((models.mean(dim=0) - c_star) @ (target - c_star)) / float(
        (target - c_star).norm() ** 2)
    return SybilOutcome(peers, k, aggregator, min(1.0, max(0.0, moved)),
                        float(np.mean(shares)) if shares else 0.0,
                        time.perf_counter() - started)
