"""SybilWall's history table: an update history per known peer, with its hop distance.

Direct neighbours' entries (distance 1) come from the models they send us; the others
arrive by gossip (node/history_gossip.py) one hop further than the sender had them. The
rules (specs/algorithms.md §3c, steps 3-5) are enforced here, with bounds a hostile peer
cannot push past: no entry about ourselves or about the sender, a distance of at most
`max_distance`, direct entries never overwritten by gossip, gossiped ones only by a newer
round, at most `max_per_sender_per_round` new entries per sender per round, and at most
`max_peers` entries (the oldest gossiped one is evicted first).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

import torch

LAMBDA = 0.8  # P(p) ∝ λ·exp(−λ·(d_p − 1)): nearby peers are gossiped more (spec §3d)


@dataclass
class HistoryEntry:
    peer: str  # whose history
    round: int  # the round it was observed in
    distance: int  # hops from us: 1 = a direct neighbour
    vector: torch.Tensor  # flat fp32 update history (θ_peer − θ_0 with a shared reference)
    received_from: str | None = None  # the neighbour that gossiped it (None: observed)
    proof: object = None  # the observer's signed message, forwarded unchanged


class HistoryTable:
    def __init__(self, self_id: str, *, max_distance: int = 8, max_peers: int = 1024,
                 max_per_sender_per_round: int = 4, lam: float = LAMBDA) -> None:
        self.self_id = self_id
        self.max_distance = max_distance
        self.max_peers = max_peers
        self.max_per_sender_per_round = max_per_sender_per_round
        self.lam = lam
        self.entries: dict[str, HistoryEntry] = {}
        self.round = 0
        self._added: Counter[str] = Counter()  # new entries per sender in `round`

    def begin_round(self, round: int) -> None:
        """Our round advanced: the per-sender flood budget starts again."""
        if round > self.round:
            self.round = round
            self._added.clear()

    def observe_direct(self, peer: str, round: int, history: torch.Tensor) -> None:
        """A neighbour's model arrived: its history is now what we saw (distance 1)."""
        self.entries[peer] = HistoryEntry(peer, round, 1, history.detach().clone().float())
        self._evict()

    def offer(self, sender: str, entry: HistoryEntry) -> str | None:
        """Take a gossiped entry (its distance as the sender has it). None if stored, else
        the reason it was refused."""
        p = entry.peer
        if p == self.self_id:
            return "an entry about ourselves"
        if p == sender:
            return "an entry about the sender itself"
        if not isinstance(entry.distance, int) or not 1 <= entry.distance < self.max_distance:
            return f"absurd distance {entry.distance!r} (at most {self.max_distance - 1})"
        if self._added[sender] >= self.max_per_sender_per_round:
            return f"flood: over {self.max_per_sender_per_round} entries from one peer in a round"
        if self.entries and entry.vector.numel() != self._numel():
            return f"history of {entry.vector.numel()} values, expected {self._numel()}"
        if not bool(torch.isfinite(entry.vector).all()):
            return "history with NaN or Inf values"
        held = self.entries.get(p)
        if held is not None and held.distance == 1:
            return "a direct neighbour: we keep what we observed"
        if held is not None and entry.round <= held.round:
            return f"round {entry.round} is not newer than the {held.round} we hold"
        if held is None and len(self.entries) >= self.max_peers and not self._gossiped():
            return "table full of direct neighbours"
        self.entries[p] = HistoryEntry(p, entry.round, entry.distance + 1,
                                       entry.vector.detach().clone().float(), sender, entry.proof)
        self._added[sender] += 1
        self._evict()
        return None

    def sample_for(self, neighbour: str, rng: random.Random) -> HistoryEntry | None:
        """One entry to gossip to `neighbour`: not itself, nor one it told us about; nearby
        peers more likely (spec §3c step 3)."""
        candidates = [e for e in self.entries.values()
                      if e.peer not in (self.self_id, neighbour) and e.received_from != neighbour]
        if not candidates:
            return None
        weights = [self.lam * math.exp(-self.lam * (e.distance - 1)) for e in candidates]
        return rng.choices(candidates, weights=weights, k=1)[0]

    def _numel(self) -> int:
        return next(iter(self.entries.values())).vector.numel()

    def _gossiped(self) -> list[HistoryEntry]:
        return [e for e in self.entries.values() if e.distance > 1]

    def _evict(self) -> None:
        while len(self.entries) > self.max_peers:
            victims = self._gossiped() or list(self.entries.values())
            oldest = min(victims, key=lambda e: (e.round, -e.distance))
            del self.entries[oldest.peer]
