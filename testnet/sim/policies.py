"""The real node's scale policies, as the simulator calls them (issue 30 item 3).

Each adapter calls the node's own code (nothing copied), with the signature a scenario
names in `[membership]`: `(n_live, base_s) -> seconds`.

* `heartbeat`: protocols.heartbeat.heartbeat_interval_s (node/membership/heartbeats.py
  passes its view size, `heartbeat_s` and `heartbeat_target_per_s`);
* `announce`: node.run.rundoc_sync.RunDocSync.announce_interval_s, on a RunDocSync whose
  live view holds n_live peers (itself included, as the node counts it);
* `gc_horizon_s`: RunDocSync.horizon_ms at that size (the configured horizon, never under
  ten announce intervals);
* `providers`: node.run.providers.provider_sample, the members re-providing the run key;
* connections: node.membership.redial.plan_connections (`connections`), and checkpoint
  provision: node.checkpoints.holders (testnet/sim/experiments.py, policy "holders").
"""

from __future__ import annotations

import random
from functools import lru_cache

from node.membership.redial import plan_connections
from node.run.providers import provider_sample
from node.run.rundoc_sync import RunDocSync
from protocols.heartbeat import heartbeat_interval_s


def heartbeat(n_live: int, heartbeat_s: float) -> float:
    """The node's heartbeat interval at n_live peers (default target, 50 inbound/s)."""
    return heartbeat_interval_s(n_live, heartbeat_s)


@lru_cache(maxsize=256)
def _sync(n_live: int, announce_s: float, gc_horizon_s: float) -> RunDocSync:
    sync = RunDocSync(announce_s=announce_s, gc_horizon_s=gc_horizon_s)
    others = [f"p{i}" for i in range(max(0, n_live - 1))]
    sync.live_peers = lambda: others  # the view the membership service would hand it
    return sync


def announce(n_live: int, announce_s: float) -> float:
    """The run document's announce interval at n_live peers (RunDocSync's own method)."""
    return _sync(n_live, announce_s, 3600.0).announce_interval_s()


def gc_horizon_s(n_live: int, announce_s: float, configured_s: float) -> float:
    """The compaction horizon RunDocSync uses at n_live peers, in seconds."""
    return _sync(n_live, announce_s, configured_s).horizon_ms() / 1000


@lru_cache(maxsize=256)
def providers(n_live: int, k: int) -> int:
    """Members re-providing the run key at n_live peers whose views agree: the node's
    sample, drawn over n_live peer names (epoch 0; every epoch draws the same count)."""
    return len(provider_sample("sim-run", 0, (f"p{i}" for i in range(n_live)), k))


def connections(n: int, want: int, max_peers: int, seed: int, sample: int = 2000,
                passes: int = 5) -> float:
    """Mean connections per node when every node runs the redialer's `plan_connections`
    (dial while under `want`, close past `max_peers`) and peers accept whoever dials them:
    a random dialing order over `passes` redial passes, on min(n, sample) nodes. Each
    node's `members` is a random draw of 4 x want others (the dial plan draws at random
    from the view; drawing from a sample is the same distribution, without sorting N
    names per call)."""
    m = min(n, sample)
    if m < 2:
        return 0.0
    rng = random.Random(seed)
    conns: list[set[int]] = [set() for _ in range(m)]
    names = [str(i) for i in range(m)]
    for _ in range(passes):
        order = list(range(m))
        rng.shuffle(order)
        for i in order:
            members = {names[j]: None for j in rng.sample(range(m), min(m, 4 * want + 1))
                       if j != i}
            dial, close = plan_connections([names[j] for j in conns[i]], members, want=want,
                                           max_peers=max_peers, rng=rng)
            for p in close:
                j = int(p)
                conns[i].discard(j)
                conns[j].discard(i)
            for p in dial:
                j = int(p)
                if len(conns[j]) < max_peers:  # the callee's bound: it closes the excess
                    conns[i].add(j)
                    conns[j].add(i)
    return sum(len(c) for c in conns) / m
