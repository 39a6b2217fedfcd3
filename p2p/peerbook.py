"""The peer book: who we have heard from, at which addresses, and when.

A peer is *live* while we heard from it within `ttl` seconds. A peer killed without a
goodbye leaves everybody's live set after at most `ttl` (plus one heartbeat of gossip
delay); that bound is what the churn tests check. Time is passed in (`now`) so the book is
deterministic under test and in the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PeerEntry:
    peer_id: str
    addrs: list[str] = field(default_factory=list)
    first_seen: float = 0.0
    last_seen: float = 0.0
    info: dict = field(default_factory=dict)
    ttl: float | None = None  # this peer's liveness ttl (its heartbeat interval); None: ttl


class PeerBook:
    def __init__(self, ttl: float = 6.0, max_peers: int = 4096) -> None:
        self.ttl = ttl
        self.max_peers = max_peers
        self._peers: dict[str, PeerEntry] = {}

    def seen(self, peer_id: str, now: float, addrs: list[str] | None = None,
             info: dict | None = None, ttl: float | None = None) -> PeerEntry:
        entry = self._peers.get(peer_id)
        if entry is None:
            if len(self._peers) >= self.max_peers:
                self.expire(now)
                if len(self._peers) >= self.max_peers:  # still full: forget the stalest
                    del self._peers[min(self._peers.values(), key=lambda e: e.last_seen).peer_id]
            entry = self._peers[peer_id] = PeerEntry(peer_id, first_seen=now)
        entry.last_seen = max(entry.last_seen, now)
        if addrs is not None:
            entry.addrs = list(addrs)
        if info is not None:
            entry.info = dict(info)
        if ttl is not None:
            entry.ttl = ttl
        return entry

    def live(self, now: float) -> list[PeerEntry]:
        return sorted((e for e in self._peers.values()
                       if now - e.last_seen <= (e.ttl or self.ttl)),
                      key=lambda e: e.peer_id)

    def expire(self, now: float, keep_for: float | None = None) -> None:
        """Forget peers silent for longer than `keep_for` (default 10 x their ttl)."""
        for peer_id in [p for p, e in self._peers.items() if now - e.last_seen > (
                10 * (e.ttl or self.ttl) if keep_for is None else keep_for)]:
            del self._peers[peer_id]

    def get(self, peer_id: str) -> PeerEntry | None:
        return self._peers.get(peer_id)

    def __len__(self) -> int:
        return len(self._peers)
