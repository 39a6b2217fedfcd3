"""The swarm on virtual time: peers join and leave, train, pair, average, and cost traffic.

A discrete-event loop (a heap of (time, seq, event)) drives joins, leaves and outer-round
boundaries; trio's MockClock was measured 70x slower per timer at 10,000 peers
(docs/simulator.md). Per round, with V the membership view at the boundary:

* V: peers whose first heartbeat has spread (a joiner is in V once it is ready and one
  heartbeat flood's 99% time has passed), plus crashed peers still inside `ttl_s`.
* NoLoCo: groups = node.ml.optim.pairing.noloco_groups(round, V) (the real function, once
  per round: every peer in V holds the same view); a group averages if all its members
  are alive at the exchange, else its live members take a local step; the update is
  node.ml.optim.noloco.noloco_update on every peer's row at once.
* DiLoCo: the all-reduce over V succeeds only if every member of V is alive at the end
  of the round (node/ml/optim/allreduce.py: one failed swap fails it); then
  node.ml.optim.diloco.diloco_update with the mean pseudo-gradient, else a local step.
* Model: each peer trains a quadratic f_i(θ) = ½ Σ a_k (θ_k − c_ik)² with its own optimum
  c_i (heterogeneity) and noisy gradients; the loss reported is the population's
  F(φ) = ½ Σ a_k (φ_k − c*_k)², averaged over live peers.
* Traffic per node and second follows from the live count and the traced gossip floods
  (testnet/sim/gossip.py) at the run's size, with each message's bytes from the real
  encoders (testnet/sim/sizes.py); see `traffic`.

Everything random comes from one numpy Generator and one torch Generator seeded by the
scenario: the same scenario gives the same numbers.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from node.ml.optim.diloco import DiLoCoConfig, diloco_update
from node.ml.optim.noloco import NoLoCoConfig, noloco_update
from node.ml.optim.pairing import noloco_groups
from testnet.sim import gossip, policies
from testnet.sim.document import DocModel
from testnet.sim.scenario import NAT_KINDS, Scenario
from testnet.sim.sizes import Sizes, avg_session_bytes, measure

MBIT = 1e6 / 8
PUNCH_S = 5.5  # measured time to a punched or relayed path (docs/benchmarks.md, reach)
K_BUCKET, ALPHA = 20, 3  # Kademlia's k and α (py-libp2p's defaults)
# An averaging partner not already connected is dialed on demand (node/membership/redial.py
# dial_partner): TCP, Noise XX and the muxer's negotiation, about 4 round trips and 8
# messages each way before the exchange's own.
DIAL_RTTS, DIAL_MSGS = 4, 8
#: Inbound gossip messages per second a Python node can take while it trains: ~1.8 ms of
#: CPU each (p2p/gossipsub.py: 4 idle nodes spent 2.6-2.8 CPU s/min on ~25 messages/s in),
#: so 100/s is ~18% of one core, the most a trainer's trio thread can give up.
INBOUND_BUDGET = 100.0
JOIN, LEAVE, ROUND, EXCH = 0, 1, 2, 3


def path_kind(a: str, b: str) -> str:
    """The path two NAT kinds end up on (docs/benchmarks.md, the reachability matrix)."""
    pair = {a, b}
    if "symmetric" in pair and pair & {"home", "symmetric"} and pair <= {"home", "symmetric"}:
        return "relayed"
    if pair == {"home"}:
        return "punched"
    return "direct"


@dataclass
class Traffic:
    """Per node and second, inbound; `max` columns are the busiest peer's."""

    msgs: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    msgs_max: dict[str, float] = field(default_factory=dict)

    @property
    def total_msgs(self) -> float:
        return sum(self.msgs.values())

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())


@dataclass
class Result:
    scenario: Scenario
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time: the load-independent figure
    virtual_s: float = 0.0
    rounds: list[dict] = field(default_factory=list)  # per round: n, averaged, local, loss, ...
    joins: int = 0
    leaves: int = 0
    join_to_ready: list[float] = field(default_factory=list)  # s, per joiner
    join_to_averaged: list[float] = field(default_factory=list)  # s, per joiner
    traffic: Traffic | None = None
    flood: gossip.FloodStats | None = None
    write_t99_s: float = math.inf  # a run-document write reaches 99% of peers (gossip)
    anti_entropy_t99_s: float = math.inf  # ... by anti-entropy alone (gossip lost it)
    doc_entries: int = 0  # at the end of the run
    doc_peak: int = 0  # the most at any round boundary
    doc_compacted: int = 0  # entries dropped by compaction (gc_horizon_s > 0)
    partner_dial_share: float = 0.0  # of a round's partners, those dialed on demand
    heartbeat_interval_s: float = 0.0  # the policies' intervals at the run's size
    announce_interval_s: float = 0.0
    gc_horizon_s: float = 0.0  # 0: no compaction
    connections: float = 0.0  # per node, what IHAVE's targets are drawn from
    sync_s: float = 0.0  # mean wait for partners / all-reduce per round per peer

    @property
    def averaged_share(self) -> float:
        a = sum(r["averaged"] for r in self.rounds)
        return a / max(1, a + sum(r["local"] for r in self.rounds))

    @property
    def final_loss(self) -> float:
        return self.rounds[-1]["loss"] if self.rounds else math.nan

    def digest(self) -> tuple:
        """Everything a determinism test compares."""
        return (tuple((r["n"], r["averaged"], r["local"], round(r["loss"], 9))
                      for r in self.rounds), self.joins, self.leaves,
                tuple(round(x, 9) for x in self.join_to_averaged))


class Swarm:
    """One simulated run of `scenario`. `policy`: the heartbeat interval as a function of
    (live peers, heartbeat_s); default: the scenario's. `announce_policy`: the same for
    the run document's announces."""

    def __init__(self, scenario: Scenario,
                 policy: Callable[[int, float], float] | None = None,
                 announce_policy: Callable[[int, float], float] | None = None) -> None:
        self.sc = sc = scenario
        self.policy = policy or sc.interval_policy()
        self.announce_policy = announce_policy or sc.announce_policy()
        self._conns: dict[int, float] = {}
        self.rng = np.random.default_rng(sc.seed)
        self.gen = torch.Generator().manual_seed(sc.seed)
        self.sizes: Sizes = measure()
        # a peer's run-document entries and announce: the node's, or a key per field
        sz = self.sizes
        fields = sc.membership.announce_shape == "fields"
        self.per_peer = sz.entries_per_peer_fields if fields else sz.entries_per_peer
        self.announce_bytes = sz.announce_fields if fields else sz.announce
        self.entry_bytes = sz.entry_fields if fields else sz.entry
        hours = sc.rounds * self._round_s_guess() / 3600
        cap = int(sc.peers * (1 + 1.5 * sc.churn.per_hour * hours)) + 64
        self.cap = cap
        net = sc.network
        self.lat = self.rng.uniform(net.latency_ms[0], net.latency_ms[1], cap) / 1000
        lo, hi = (math.log(max(x, 1e-3) * MBIT) for x in net.bandwidth_mbit)
        self.bw = np.exp(self.rng.uniform(lo, hi, cap))
        shares = np.array([net.nat[k] for k in NAT_KINDS])
        self.nat = self.rng.choice(len(NAT_KINDS), size=cap, p=shares / shares.sum())
        self.speed = np.exp(self.rng.normal(0, sc.training.step_jitter, cap))
        self.ids = [f"{i:07d}" for i in range(cap)]  # sorted like the real ids would be
        self.alive = np.zeros(cap, dtype=bool)
        self.ready_at = np.full(cap, np.inf)  # full participation: synced, checkpoint loaded
        self.in_view_at = np.full(cap, np.inf)
        self.gone_at = np.full(cap, np.inf)
        self.crashed = np.zeros(cap, dtype=bool)
        self.joined_at = np.full(cap, np.inf)
        self.first_avg = np.full(cap, np.inf)
        self.count = 0
        self.doc = DocModel(self.per_peer)
        self.last_compact = 0.0
        t = sc.training
        self.a = torch.linspace(0.2, 1.0, t.dim)  # curvatures: condition number 5
        self.c_star = torch.zeros(t.dim)
        self.c = t.heterogeneity * torch.randn(cap, t.dim, generator=self.gen)
        self.phi = torch.randn(1, t.dim, generator=self.gen).mul_(3.0).expand(cap, t.dim).clone()
        self.theta = self.phi.clone()
        self.m = torch.zeros(cap, t.dim)
        # what one side of a /peertrain/avg/1.0.0 exchange writes (protocols/averaging.py)
        self.model_bytes, self.model_msgs = avg_session_bytes(self.sizes, t.model_mb * 1e6)

    # -- set-up ----------------------------------------------------------------------------

    def _round_s_guess(self) -> float:
        t = self.sc.training
        return t.inner_steps * t.step_s + 5.0

    def exchange_s(self, i: int, j: int) -> float:
        """One pairwise swap of the model: a round trip plus the bytes at the slower end
        (the relay's rate on a relayed path)."""
        bw = min(self.bw[i], self.bw[j])
        if path_kind(NAT_KINDS[self.nat[i]], NAT_KINDS[self.nat[j]]) == "relayed":
            bw = min(bw, self.sc.network.relay_mbit * MBIT)
        return 2 * (self.lat[i] + self.lat[j]) + self.model_bytes / bw

    def _group_exchange_s(self, M: np.ndarray, G: np.ndarray, n: int) -> np.ndarray:
        """Per group, its slowest swap: the two largest latencies' round trip plus the
        model at the group's slowest link (the relay's rate if any pair is relayed)."""
        lat = self.lat[M]
        lat1 = np.zeros(n)
        np.maximum.at(lat1, G, lat)
        bw = np.full(n, np.inf)
        np.minimum.at(bw, G, self.bw[M])
        nat = self.nat[M]
        sym = np.bincount(G, weights=nat == NAT_KINDS.index("symmetric"), minlength=n)
        hs = np.bincount(G, weights=nat >= NAT_KINDS.index("home"), minlength=n)
        relayed = (sym >= 1) & (hs >= 2)
        bw = np.where(relayed, np.minimum(bw, self.sc.network.relay_mbit * MBIT), bw)
        return 4 * lat1 + self.model_bytes / bw + self.dial_share() * DIAL_RTTS * 2 * lat1

    def dial_share(self) -> float:
        """Of a round's partners, the share not already connected, so dialed first:
        partners come from the whole live view (node.ml.optim.pairing over the view), a
        node holds `connections` of the others (at the run's size; the expected cost is
        added to each group's exchange)."""
        n = self.sc.peers
        return max(0.0, 1 - self.connections(n) / (n - 1)) if n > 1 else 0.0

    def _grow(self) -> None:
        """Double every per-peer array (churn brought more peers than first guessed)."""
        old, cap = self.cap, 2 * self.cap
        net, t = self.sc.network, self.sc.training
        extra = cap - old
        lo, hi = (math.log(max(x, 1e-3) * MBIT) for x in net.bandwidth_mbit)
        shares = np.array([net.nat[k] for k in NAT_KINDS])
        self.lat = np.concatenate([self.lat, self.rng.uniform(
            net.latency_ms[0], net.latency_ms[1], extra) / 1000])
        self.bw = np.concatenate([self.bw, np.exp(self.rng.uniform(lo, hi, extra))])
        self.nat = np.concatenate([self.nat, self.rng.choice(
            len(NAT_KINDS), size=extra, p=shares / shares.sum())])
        self.speed = np.concatenate([self.speed, np.exp(self.rng.normal(
            0, t.step_jitter, extra))])
        self.ids += [f"{i:07d}" for i in range(old, cap)]
        for name, fill in (("alive", False), ("crashed", False), ("ready_at", np.inf),
                           ("in_view_at", np.inf), ("gone_at", np.inf), ("joined_at", np.inf),
                           ("first_avg", np.inf)):
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.full(extra, fill, dtype=arr.dtype)]))
        more = torch.randn(extra, t.dim, generator=self.gen).mul_(t.heterogeneity)
        self.c = torch.cat([self.c, more])
        for name in ("phi", "theta", "m"):
            setattr(self, name, torch.cat([getattr(self, name), torch.zeros(extra, t.dim)]))
        self.cap = cap

    def _new_peer(self, now: float, joining: bool) -> int:
        i = self.count
        if i >= self.cap:
            self._grow()
        self.count += 1
        self.alive[i] = True
        self.joined_at[i] = now
        if joining:
            self.ready_at[i] = now + self.join_phases(i)
            self.in_view_at[i] = self.ready_at[i] + self.flood.t99
            donor = self._random_ready(now)
            if donor is not None:  # the joiner starts from a live peer's checkpoint
                self.phi[i] = self.phi[donor]
                self.theta[i] = self.phi[donor]
        else:
            self.ready_at[i] = self.in_view_at[i] = now
        if self.sc.membership.gc_horizon_s > 0:
            self.doc.join(self.ids[i], now)
        return i

    def _random_ready(self, now: float) -> int | None:
        ready = np.flatnonzero(self.alive[:self.count] & (self.ready_at[:self.count] <= now))
        return int(self.rng.choice(ready)) if len(ready) else None

    def join_phases(self, i: int) -> float:
        """Seconds from `node join` to full participation (trained weights, in sync):
        DHT lookup of the run's providers, a connection (punched or relayed: measured 5.5 s),
        the run document's full sync (capped deltas, one round trip each), and the
        checkpoint from one holder (the newest's writer, at the slower of the two links)."""
        n = max(2, int(self.alive.sum()))
        rtt = 2 * (self.lat[i] + float(np.median(self.lat[:max(self.count, 1)])))
        hops = 1 + max(0, math.ceil(math.log2(n / K_BUCKET)))
        dht = hops * rtt
        connect = 2 * rtt + (PUNCH_S if NAT_KINDS[self.nat[i]] in ("home", "symmetric") else 0)
        doc_bytes = self._doc_entries(n) * self.entry_bytes
        deltas = max(1, math.ceil(doc_bytes / (1 << 20)))
        holder_bw = float(np.median(self.bw[:max(self.count, 1)]))
        sync = deltas * rtt + doc_bytes / min(self.bw[i], holder_bw)
        ckpt = self.sc.checkpoint.size_mb * 1e6 / min(self.bw[i], holder_bw) + rtt
        return dht + connect + sync + ckpt

    def _doc_entries(self, n: int) -> int:
        """Entries a replica holds now: the modelled document when it compacts, else six
        per peer ever seen (nothing leaves)."""
        if self.sc.membership.gc_horizon_s > 0:
            return max(len(self.doc), n * self.per_peer)
        return max(self.count, n) * self.per_peer

    def connections(self, n: int) -> float:
        """Connections per node: the old model's 2 x want_peers, or with max_peers set what
        the redialer's plan_connections leaves (policies.connections)."""
        m = self.sc.membership
        if not m.max_peers:
            return float(min(n - 1, 2 * m.want_peers))
        if n not in self._conns:
            self._conns[n] = min(n - 1, policies.connections(
                n, m.want_peers, m.max_peers, self.sc.seed))
        return self._conns[n]

    def gc_horizon_s(self, n: int) -> float:
        m = self.sc.membership
        if m.gc_horizon_s <= 0:
            return 0.0
        return policies.gc_horizon_s(n, m.announce_s, m.gc_horizon_s)

    def _compact(self, now: float) -> None:
        """Every eighth of the horizon (the node checks every persist_s, 10 s; the
        granularity moves a departure's drop by at most that): live peers' stamps are
        fresh, then the node's rule drops what it names."""
        n = int(self.alive.sum())
        horizon = self.gc_horizon_s(n)
        if horizon <= 0:
            return
        if now - self.last_compact >= horizon / 8:
            self.last_compact = now
            live = np.flatnonzero(self.alive[:self.count]).tolist()
            self.doc.touch([self.ids[i] for i in live], now)
            self.doc.compact(now, horizon)
        self.doc.peak = max(self.doc.peak, len(self.doc))

    # -- traffic -----------------------------------------------------------------------------

    def traffic(self, n: int) -> Traffic:
        """Inbound messages and bytes per node and second with n live peers (formulas over
        the traced floods; docs/simulator.md lists each)."""
        sc, s, f = self.sc, self.sizes, self.flood
        m, g = sc.membership, sc.gossip
        hb_rate = n / self.policy(n, m.heartbeat_s)  # heartbeats published per second
        ann_s = self.announce_policy(n, m.announce_s)
        ann_rate = n / ann_s
        tr = Traffic()
        tr.msgs["heartbeats"] = hb_rate * f.copies_mean
        tr.msgs_max["heartbeats"] = hb_rate * f.copies_max
        tr.bytes["heartbeats"] = tr.msgs["heartbeats"] * s.heartbeat
        # announces are >= 1 KiB: IDONTWANT applies (the announce flood was traced with it)
        tr.msgs["rundoc gossip"] = ann_rate * self.announce_copies
        tr.msgs_max["rundoc gossip"] = ann_rate * self.announce_copies_max
        tr.bytes["rundoc gossip"] = tr.msgs["rundoc gossip"] * self.announce_bytes
        # IHAVE: every gossipsub heartbeat, per topic, to max(lazy, 25% of the non-mesh
        # connected peers), listing every message id of the last `window` heartbeats.
        conns = round(self.connections(n))
        targets = min(max(0, conns - g.degree), max(g.lazy_min, int(0.25 * (conns - g.degree))))
        ihave_msgs = 2 * targets / g.heartbeat_s
        ids = g.window * g.heartbeat_s * (hb_rate + ann_rate)
        tr.msgs["ihave"] = ihave_msgs
        tr.msgs_max["ihave"] = ihave_msgs
        tr.bytes["ihave"] = 2 * targets / g.heartbeat_s * s.ihave_base + \
            targets / g.heartbeat_s * ids * s.ihave_per_id
        # Anti-entropy: each node starts one round every anti_entropy_s and answers about
        # one (summary in, delta+summary out, delta in). A bucket differs when an entry in
        # it was rewritten within the announce's spread time.
        entries = self._doc_entries(n)
        in_flight = n * (self.per_peer - 1) * f.t99 / ann_s
        differing = 1024 * (1 - math.exp(-in_flight / 1024)) if entries else 0
        per_bucket = entries / 1024
        delta = min(1 << 20, differing * per_bucket * self.entry_bytes)
        summary = min(s.summary, 64 + 10 * min(1024, entries))
        tr.msgs["anti-entropy"] = 4 / m.anti_entropy_s
        tr.msgs_max["anti-entropy"] = 4 / m.anti_entropy_s
        tr.bytes["anti-entropy"] = 2 * (summary + delta) / m.anti_entropy_s
        # DHT: a re-provide of the run key every reprovide_s: a lookup (α requests per hop)
        # then ADD_PROVIDER to the k closest. The k peers closest to the run key receive
        # everybody's ADD_PROVIDER: the busiest.
        hops = 1 + max(0, math.ceil(math.log2(max(n, 2) / K_BUCKET)))
        lookup = ALPHA * hops
        # Before issue 30 every member re-provides; with `providers` set, the node's
        # rendezvous sample (node/run/providers.py) does, and each joiner provides once.
        joins_per_s = sc.churn.per_hour * n / 3600
        if m.providers:
            per_window = policies.providers(n, m.providers) + joins_per_s * m.reprovide_s
        else:
            per_window = float(n)
        share = min(1.0, per_window / max(n, 1))  # of the members that provide per window
        tr.msgs["dht"] = share * (lookup + min(K_BUCKET, n - 1)) / m.reprovide_s
        tr.bytes["dht"] = share * (lookup * (s.dht_request + s.dht_reply)
                                   + min(K_BUCKET, n - 1) * s.add_provider) / m.reprovide_s
        # each of them receives every other provider's ADD_PROVIDER once per reprovide_s
        tr.msgs_max["dht"] = tr.msgs["dht"] + max(0.0, per_window - 1) / m.reprovide_s
        # on-demand dials of partners not connected: each round, both ends of each pair
        partners = sc.training.group_size - 1
        tr.msgs["partner dials"] = self.dial_share() * partners * DIAL_MSGS / \
            self._round_s_guess()
        tr.msgs_max["partner dials"] = tr.msgs["partner dials"]
        tr.bytes["partner dials"] = tr.msgs["partner dials"] * 200  # handshake messages
        return tr

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> Result:
        """Simulate the scenario on one thread (torch's intra-op threads cost more than
        they give on [N, 32] tensors, and the figures are per core)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._run()
        finally:
            torch.set_num_threads(threads)

    def _run(self) -> Result:
        started, cpu = time.perf_counter(), time.process_time()
        sc, _t = self.sc, self.sc.training
        res = Result(sc)
        n0 = sc.peers
        # The mesh at the run's size, traced for copies and spread (heartbeat and announce).
        self.adj = adj = gossip.mesh(n0, sc.gossip.degree, self.rng)
        lat, bw = self.lat[:n0], self.bw[:n0]
        self.flood = gossip.trace(adj, lat, bw, self.sizes.heartbeat,
                                  sc.gossip.idontwant_min_bytes, sc.gossip.floods, self.rng)
        ann = gossip.trace(adj, lat, bw, self.announce_bytes, sc.gossip.idontwant_min_bytes,
                           sc.gossip.floods, self.rng)
        self.announce_copies, self.announce_copies_max = ann.copies_mean, ann.copies_max
        res.flood, res.write_t99_s = self.flood, ann.t99
        res.anti_entropy_t99_s = self._anti_entropy_spread(n0)
        res.traffic = self.traffic(n0)
        for _ in range(n0):
            self._new_peer(0.0, joining=False)
        heap: list[tuple[float, int, int, int]] = []
        seq = 0

        def push(at: float, kind: int, who: int) -> None:
            nonlocal seq
            heapq.heappush(heap, (at, seq, kind, who))
            seq += 1

        rate = sc.churn.per_hour / 3600  # leaves per live peer per second
        if rate > 0:
            # Poisson leaves of each live peer, and Poisson joins at n0 x rate keeping N level
            for i in range(n0):
                push(float(self.rng.exponential(1 / rate)), LEAVE, i)
            push(float(self.rng.exponential(1 / (n0 * rate))), JOIN, -1)
        push(0.0, ROUND, 0)
        pending: dict = {}
        while heap:
            now, _, kind, who = heapq.heappop(heap)
            if kind == JOIN:
                i = self._new_peer(now, joining=True)
                res.joins += 1
                push(now + float(self.rng.exponential(1 / rate)), LEAVE, i)
                push(now + float(self.rng.exponential(1 / (n0 * rate))), JOIN, -1)
            elif kind == LEAVE:
                if self.alive[who]:
                    self.alive[who] = False
                    if sc.membership.gc_horizon_s > 0:
                        self.doc.leave(self.ids[who], now)
                    self.gone_at[who] = now
                    self.crashed[who] = self.rng.random() < sc.churn.crash_share
                    res.leaves += 1
            elif kind == ROUND:
                if who >= sc.rounds:
                    break
                self._compact(now)
                pending = self._start_round(who, now)
                push(pending["end"], EXCH, who)
            else:
                push(self._exchange(pending, res), ROUND, who + 1)
        res.virtual_s = now
        if res.rounds and now > 0 and res.traffic is not None:
            # weight exchanges: each averaged peer receives its partner's vector once a round
            per_s = sum(r["averaged"] / max(1, r["training"]) for r in res.rounds) / now
            res.traffic.msgs["averaging"] = per_s * self.model_msgs
            res.traffic.msgs_max["averaging"] = per_s * self.model_msgs
            res.traffic.bytes["averaging"] = per_s * self.model_bytes
        res.sync_s = float(np.mean([r["sync"] for r in res.rounds])) if res.rounds else 0.0
        arrived = self.joined_at[:self.count] > 0
        res.join_to_ready = (self.ready_at[:self.count][arrived]
                             - self.joined_at[:self.count][arrived]).tolist()
        firsts = self.first_avg[:self.count][arrived] - self.joined_at[:self.count][arrived]
        res.join_to_averaged = [float(x) for x in firsts if np.isfinite(x)]
        n_end = int(self.alive.sum())
        res.doc_entries = self._doc_entries(n_end)
        res.doc_peak = max(self.doc.peak, res.doc_entries) if sc.membership.gc_horizon_s > 0 \
            else res.doc_entries
        res.doc_compacted = self.doc.compacted
        res.heartbeat_interval_s = self.policy(n0, sc.membership.heartbeat_s)
        res.announce_interval_s = self.announce_policy(n0, sc.membership.announce_s)
        res.gc_horizon_s = self.gc_horizon_s(n0)
        res.connections = self.connections(n0)
        res.partner_dial_share = self.dial_share()
        res.wall_s = time.perf_counter() - started
        res.cpu_s = time.process_time() - cpu
        return res

    def _start_round(self, r: int, now: float) -> dict:
        """Outer round r starts: the view and the training set are fixed, the inner steps
        run; the exchange happens at `end`, after the leaves the event loop delivers first."""
        sc, t = self.sc, self.sc.training
        cnt = self.count
        alive = self.alive[:cnt]
        training = np.flatnonzero(alive & (self.ready_at[:cnt] <= now))
        ttl_alive = alive | (self.gone_at[:cnt] + sc.membership.ttl_s > now)
        view = np.flatnonzero(ttl_alive & (self.in_view_at[:cnt] <= now))
        compute = t.inner_steps * t.step_s * self.speed[training] * \
            np.exp(self.rng.normal(0, t.step_jitter / 2, len(training)))
        median = float(np.median(compute)) if len(compute) else t.inner_steps * t.step_s
        idx = torch.from_numpy(training)
        th = self.theta[idx]
        c = self.c[idx]
        for _ in range(t.inner_steps):  # every training peer's rows at once
            noise = torch.randn(th.shape, generator=self.gen).mul_(t.noise)
            th.sub_((th - c).mul_(self.a).add_(noise), alpha=t.lr)
        return {"r": r, "start": now, "end": now + median, "training": training,
                "view": view, "compute": compute, "theta": th, "median": median}

    def _exchange(self, st: dict, res: Result) -> float:
        """The exchange of round st["r"] at st["end"]: pairing, averaging or a local step,
        the outer update. Returns the time the next round starts."""
        t = self.sc.training
        training, view, th, end = st["training"], st["view"], st["theta"], st["end"]
        idx = torch.from_numpy(training)
        live_now = self.alive
        mean = th.clone()
        averaged = np.zeros(len(training), dtype=bool)
        wait = np.zeros(len(training))
        if t.algorithm == "noloco":
            groups = noloco_groups(st["r"], [self.ids[i] for i in view.tolist()], t.group_size)
            if groups:
                M = np.array([int(x) for g in groups for x in g], dtype=np.int64)
                G = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
                row = np.full(self.count, -1, dtype=np.int64)
                row[training] = np.arange(len(training))
                live = (row[M] >= 0) & live_now[M]
                size_g = np.bincount(G, minlength=len(groups))
                n_live = np.bincount(G, weights=live, minlength=len(groups))
                full = (n_live == size_g) & (size_g >= 2)
                # a member gone: its partners wait out the exchange deadline if it crashed,
                # are refused at once if it left cleanly or is not training yet
                crash_g = np.bincount(G, weights=(~live_now[M]) & self.crashed[M],
                                      minlength=len(groups)) > 0
                ex_g = self._group_exchange_s(M, G, len(groups))
                comp_all = np.zeros(self.count)
                comp_all[training] = st["compute"]
                finish_g = np.zeros(len(groups))
                np.maximum.at(finish_g, G, comp_all[M])
                avg_m = full[G] & live
                rows = row[M[avg_m]]
                if len(rows):
                    gi = torch.from_numpy(G[avg_m])
                    sums = torch.zeros(len(groups), th.shape[1]).index_add_(0, gi, th[rows])
                    mean[rows] = sums[gi] / torch.from_numpy(size_g[G[avg_m]]).unsqueeze(1).float()
                    averaged[rows] = True
                    wait[rows] = finish_g[G[avg_m]] - comp_all[M[avg_m]] + ex_g[G[avg_m]]
                lone = live & ~full[G] & crash_g[G]
                wait[row[M[lone]]] = 2 * ex_g[G[lone]]
            phi, m = self.phi[idx], self.m[idx]
            cfg = NoLoCoConfig()
            noloco_update(phi, m, mean, outer_lr=cfg.outer_lr, momentum=cfg.momentum)
        else:
            pos = {p: k for k, p in enumerate(training.tolist())}
            members = view.tolist()
            ok = len(members) >= 2 and all(i in pos and live_now[i] for i in members)
            phi, m = self.phi[idx], self.m[idx]
            delta = phi - th
            if ok:
                rows = [pos[i] for i in members]
                sel = torch.zeros(len(training), dtype=torch.bool)
                sel[rows] = True
                delta[sel] = phi[sel] - th[rows].mean(dim=0, keepdim=True)
                averaged[rows] = True
                # recursive doubling: log2(P) swaps in sequence (+2 when N is not a power
                # of two), each as slow as its slowest pair: bounded by the slowest link
                p = 1 << (len(rows).bit_length() - 1)
                steps = math.log2(p) + (0 if p == len(rows) else 2)
                slow = max(members, key=lambda i: self.model_bytes / self.bw[i] + 4 * self.lat[i])
                ex = steps * self.exchange_s(slow, slow)
                barrier = float(st["compute"][rows].max())
                wait[rows] = barrier - st["compute"][rows] + ex
            elif len(members) >= 2:
                # the all-reduce fails at a swap with a gone member: the live members
                # waited for the slowest of them, then for that swap's deadline (twice
                # a swap), before their local step
                rows = [pos[i] for i in members if i in pos and live_now[i]]
                if rows:
                    slow = max(members, key=lambda i: self.model_bytes / self.bw[i]
                               + 4 * self.lat[i])
                    barrier = float(st["compute"][rows].max())
                    wait[rows] = barrier - st["compute"][rows] + 2 * self.exchange_s(slow, slow)
            cfg = DiLoCoConfig()
            diloco_update(phi, m, delta, outer_lr=cfg.outer_lr, momentum=cfg.momentum,
                          nesterov=cfg.nesterov)
        self.phi[idx], self.m[idx], self.theta[idx] = phi, m, phi
        for k in np.flatnonzero(averaged).tolist():
            i = int(training[k])
            if not np.isfinite(self.first_avg[i]):
                self.first_avg[i] = end + wait[k]
        n_train = len(training)
        loss = float((0.5 * ((phi - self.c_star) ** 2 * self.a).sum(dim=1)).mean()) \
            if n_train else math.nan
        spread = float(((phi - phi.mean(dim=0)) ** 2).sum(dim=1).mean()) if n_train else 0.0
        n_avg = int(averaged.sum())
        res.rounds.append({"round": st["r"], "t": st["start"], "n": int(self.alive.sum()),
                           "view": len(view), "training": n_train, "averaged": n_avg,
                           "local": n_train - n_avg, "loss": loss, "spread": spread,
                           "sync": float(wait.mean()) if n_train else 0.0})
        return end + (float(np.median(wait)) if n_train else 0.0)

    def _anti_entropy_spread(self, n: int) -> float:
        """Seconds until 99% of n peers hold a write by push-pull anti-entropy alone (every
        peer syncs with one random live peer every anti_entropy_s; both end with the union)."""
        has = np.zeros(n, dtype=bool)
        has[0] = True
        rounds = 0
        rng = np.random.default_rng(self.sc.seed + 1)
        while has.mean() < 0.99 and rounds < 200:
            partner = rng.integers(0, n - 1, n)
            partner += partner >= np.arange(n)
            got = has | has[partner]
            got[partner[has]] = True
            has = got
            rounds += 1
        return rounds * self.sc.membership.anti_entropy_s
