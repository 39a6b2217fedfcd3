"""Gossipsub's mesh, traced message by message: who receives what, how often, and when.

Each topic's mesh is a random graph in which every peer keeps about D links (gossipsub's
target degree; the configuration model: D stubs per peer, shuffled, paired, self-loops and
doubles dropped). A published message floods it as gossipsub v1.1/1.2 forwards: the origin
sends to every mesh peer; every other peer, on first receipt, forwards to every mesh peer
except the one it got the message from, skipping (for messages of at least
IDONTWANT_MIN_BYTES, p2p/gossipsub.py) peers whose IDONTWANT, sent on their own first
receipt, arrived before the forward leaves. A hop takes both ends' one-way latency plus
the message's bytes at the slower link. The trace gives each peer's first-arrival time
and the copies it received: duplicates are what gossip's forwarding costs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


def mesh(n: int, degree: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Adjacency lists of a random graph with mean degree about `degree` (<= n - 1)."""
    d = min(degree, n - 1)
    stubs = np.repeat(np.arange(n), d)
    rng.shuffle(stubs)
    if len(stubs) % 2:
        stubs = stubs[:-1]
    a, b = stubs[0::2], stubs[1::2]
    keep = a != b
    a, b = a[keep], b[keep]
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    edges = np.unique(lo.astype(np.int64) * n + hi)
    lo, hi = edges // n, edges % n
    src = np.concatenate([lo, hi])
    dst = np.concatenate([hi, lo])
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    bounds = np.searchsorted(src, np.arange(n + 1))
    return [dst[bounds[i]:bounds[i + 1]] for i in range(n)]


@dataclass
class Flood:
    arrival: np.ndarray  # seconds after publishing; inf where never reached
    copies: np.ndarray  # copies each peer received (the first included)
    sent: np.ndarray  # copies each peer sent

    @property
    def transmissions(self) -> int:
        return int(self.copies.sum())

    def quantile(self, q: float) -> float:
        """Time by which a share q of the peers (the origin included) hold the message."""
        return float(np.quantile(self.arrival, q))


def flood(adj: list[np.ndarray], origin: int, latency: np.ndarray, bandwidth: np.ndarray,
          size: int, idontwant_min: int) -> Flood:
    """Trace one message of `size` bytes from `origin` (see the module docstring).
    `latency`: one-way seconds per peer; `bandwidth`: bytes/s per peer."""
    n = len(adj)
    arrival = np.full(n, np.inf)
    parent = np.full(n, -1, dtype=np.int64)
    arrival[origin] = 0.0
    heap = [(0.0, origin)]
    lat, bw = latency.tolist(), bandwidth.tolist()
    arr = arrival  # local alias
    done = np.zeros(n, dtype=bool)
    while heap:
        t, u = heapq.heappop(heap)
        if done[u]:
            continue
        done[u] = True
        lu, bu = lat[u], bw[u]
        for v in adj[u].tolist():
            if done[v]:
                continue
            tv = t + lu + lat[v] + size / min(bu, bw[v])
            if tv < arr[v]:
                arr[v] = tv
                parent[v] = u
                heapq.heappush(heap, (tv, v))
    # Copies: u forwards to each mesh peer v but its parent (the origin to all), unless
    # v's IDONTWANT (sent when v first got it) reached u before u forwarded.
    copies = np.zeros(n, dtype=np.int64)
    sent = np.zeros(n, dtype=np.int64)
    for u in range(n):
        if not np.isfinite(arrival[u]):
            continue
        nbrs = adj[u]
        mask = nbrs != parent[u]
        if size >= idontwant_min:
            heard = arrival[nbrs] + latency[nbrs] + latency[u] <= arrival[u]
            mask &= ~heard
        targets = nbrs[mask]
        sent[u] = len(targets)
        copies[targets] += 1
    return Flood(arrival, copies, sent)


@dataclass(frozen=True)
class FloodStats:
    """Averages over traced floods on one mesh: per message, per peer."""

    copies_mean: float  # copies a peer receives of one message (>= 1: gossip's duplicates)
    copies_max: float  # the busiest peer's, averaged over the traced messages
    t50: float  # median arrival, s
    t99: float  # 99% of peers hold it, s
    reach: float  # share of peers reached


def trace(adj: list[np.ndarray], latency: np.ndarray, bandwidth: np.ndarray, size: int,
          idontwant_min: int, floods: int, rng: np.random.Generator) -> FloodStats:
    n = len(adj)
    origins = rng.choice(n, size=min(floods, n), replace=False)
    copies = np.zeros(n)
    t50, t99, reach = [], [], []
    for o in origins.tolist():
        f = flood(adj, o, latency, bandwidth, size, idontwant_min)
        copies += f.copies
        reached = np.isfinite(f.arrival)
        reach.append(reached.mean())
        t50.append(float(np.quantile(f.arrival[reached], 0.5)))
        t99.append(f.quantile(0.99) if reached.mean() >= 0.99 else np.inf)
    copies /= len(origins)
    return FloodStats(float(copies.mean()), float(copies.max()), float(np.mean(t50)),
                      float(np.mean(t99)), float(np.mean(reach)))
