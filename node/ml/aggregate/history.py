"""SybilWall's history table: an update history per known peer, with its hop distance.

Direct neighbours' entries (distance 1) come from the models they send us; the others
arrive by gossip (node/averaging/history_gossip.py) one hop further than the sender had them. The
rules (specs/algorithms.md §3c, steps 3-5) are enforced here, with bounds a hostile peer
cannot push past: no entry about ourselves or about the sender, a stored distance of at
most `max_distance`, the vector length of our own model, finite values, direct entries
never overwritten by gossip, gossiped ones only by a newer round, at most
`max_per_sender_per_round` offers per sender per round, and at most `max_peers` entries
(the oldest gossiped one is evicted first). Rounds are bounded too: an entry may claim at
most `max_ahead` rounds past ours (a huge round would otherwise pin it, since only a newer
round replaces it), and an entry older than `max_age` rounds is forgotten.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from .base import State, flat

LAMBDA = 0.8  # P(p) ∝ λ·exp(−λ·(d_p − 1)): nearby peers are gossiped more (spec §3d)


@dataclass
class HistoryEntry:
    peer: str  # whose history
    round: int  # the round it was observed in
    distance: int  # hops from us: 1 = a direct neighbour
    vector: torch.Tensor  # flat fp32 update history (w_peer − w_0 with a shared reference)
    received_from: str | None = None  # the neighbour that gossiped it (None: observed)
    proof: Any = None  # the observer's signed message (protocols/history.py), forwarded as is


class HistoryTable:
    """{peer -> HistoryEntry}. `reference` (the run's shared initial model) makes histories
    updates rather than models (spec §3g: without it the history telescopes into the
    latest model). `numel` is the history length; it is learnt from the reference or the
    first observed model when not given, and gossip is refused until it is known."""

    def __init__(
        self,
        self_id: str,
        *,
        reference: State | None = None,
        numel: int | None = None,
        max_distance: int = 8,
        max_peers: int = 1024,
        max_per_sender_per_round: int = 4,
        lam: float = LAMBDA,
        max_ahead: int = 8,
        max_age: int = 64,
    ) -> None:
        if (max_distance < 2 or max_peers < 1 or max_per_sender_per_round < 1 or lam <= 0
                or max_ahead < 0 or max_age < 1):
            raise ValueError(
                "max_distance >= 2, max_peers >= 1, max_per_sender_per_round >= 1, "
                "lam > 0, max_ahead >= 0 and max_age >= 1 are required"
            )
        self.max_ahead, self.max_age = max_ahead, max_age
        self.self_id = self_id
        self.reference = flat(reference) if reference is not None else None
        if self.reference is not None and numel is not None and numel != self.reference.numel():
            raise ValueError(f"numel {numel} but the reference has {self.reference.numel()}")
        self.numel = self.reference.numel() if self.reference is not None else numel
        self.max_distance = max_distance
        self.max_peers = max_peers
        self.max_per_sender_per_round = max_per_sender_per_round
        self.lam = lam
        self.entries: dict[str, HistoryEntry] = {}
        self.round = 0
        self._offers: Counter[str] = Counter()  # offers per sender in `round`

    def begin_round(self, round: int) -> None:
        """Our round advanced: the per-sender flood budget starts again, and entries
        older than `max_age` rounds (or, taken before we knew our round, too far ahead of
        it) are forgotten."""
        if round > self.round:
            self.round = round
            self._offers.clear()
            self.entries = {p: e for p, e in self.entries.items()
                            if round - self.max_age <= e.round <= round + self.max_ahead}

    def observe_direct(self, peer: str, round: int, state: State) -> None:
        """A neighbour's model arrived: its history becomes w − w_0 (or w), at distance 1.

        This is the spec's accumulation H ← H + (w_new − w_prev) from a first sighting
        H ← w − w_0: the sum telescopes to the latest model minus w_0 exactly, so the
        table keeps that instead of a copy of every neighbour's previous model.
        """
        history = flat(state)
        if self.reference is not None:
            if history.numel() != self.reference.numel():
                raise ValueError(
                    f"a model of {history.numel()} values; the reference has "
                    f"{self.reference.numel()}"
                )
            history = history - self.reference
        if history.numel() != self.numel:
            # A model we accepted is the authority on the length: drop anything else.
            self.numel = history.numel()
            self.entries = {p: e for p, e in self.entries.items() if e.vector.numel() == self.numel}
        self.entries.pop(peer, None)
        self.entries[peer] = HistoryEntry(peer, round, 1, history)
        self._make_room()

    def offer(self, sender: str, entry: HistoryEntry) -> str | None:
        """Take a gossiped entry (its distance as the sender has it). None if stored, else
        the reason it was refused."""
        p, d = entry.peer, entry.distance
        if p == self.self_id:
            return "an entry about ourselves"
        if p == sender:
            return "an entry about the sender itself (its model is its history)"
        if type(d) is not int or not 1 <= d < self.max_distance:
            return f"absurd distance {d!r} (at most {self.max_distance - 1} for the sender)"
        if type(entry.round) is not int or entry.round < 0:
            return f"round {entry.round!r} is not a non-negative int"
        if self.round and entry.round > self.round + self.max_ahead:
            return f"round {entry.round} is over {self.max_ahead} rounds past ours ({self.round})"
        if self.numel is None:
            return "no history length yet: we have observed no model"
        if not isinstance(entry.vector, torch.Tensor) or entry.vector.numel() != self.numel:
            size = entry.vector.numel() if isinstance(entry.vector, torch.Tensor) else "no"
            return f"history of {size} values, expected {self.numel}"
        if self._offers[sender] >= self.max_per_sender_per_round:
            return f"flood: over {self.max_per_sender_per_round} entries from one peer in a round"
        self._offers[sender] += 1  # counted before the O(P) checks, which it bounds
        vector = entry.vector.detach().reshape(-1).float()
        if not bool(torch.isfinite(vector).all()):
            return "history with NaN or Inf values"
        held = self.entries.get(p)
        if held is not None and held.distance == 1:
            return "a direct neighbour: we keep what we observed"
        if held is not None and entry.round <= held.round:
            return f"round {entry.round} is not newer than the {held.round} we hold"
        if held is None and len(self.entries) >= self.max_peers:
            victim = self._oldest_gossiped()
            if victim is None:
                return "table full of direct neighbours"
            if (entry.round, -(d + 1)) < (victim.round, -victim.distance):
                return "table full of newer entries"
            del self.entries[victim.peer]
        self.entries[p] = HistoryEntry(p, entry.round, d + 1, vector.clone(), sender, entry.proof)
        return None

    def sample_for(self, neighbour: str, rng: random.Random) -> HistoryEntry | None:
        """One entry to gossip to `neighbour`: not about itself, nor one it told us about;
        P(p) ∝ λ·exp(−λ·(d_p − 1)), so nearby peers are likelier (spec §3c step 3).
        Deterministic given `rng` (entries keep insertion order)."""
        candidates = [
            e
            for e in self.entries.values()
            if e.peer not in (self.self_id, neighbour) and e.received_from != neighbour
        ]
        if not candidates:
            return None
        weights = [self.lam * math.exp(-self.lam * (e.distance - 1)) for e in candidates]
        return rng.choices(candidates, weights=weights, k=1)[0]

    def _oldest_gossiped(self) -> HistoryEntry | None:
        """The eviction victim: the oldest round, the farthest among equals."""
        gossiped = [e for e in self.entries.values() if e.distance > 1]
        return min(gossiped, key=lambda e: (e.round, -e.distance)) if gossiped else None

    def _make_room(self) -> None:
        """After a direct observation: over `max_peers`, drop the oldest gossiped entry, or
        with none left the oldest direct one (a neighbour not heard from for longest)."""
        while len(self.entries) > self.max_peers:
            victim = self._oldest_gossiped() or min(self.entries.values(), key=lambda e: e.round)
            del self.entries[victim.peer]
