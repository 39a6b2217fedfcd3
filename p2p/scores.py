"""Peer scores and bans: a peer that keeps misbehaving is disconnected and refused a while.

Why decay: honest peers time out and drop streams under churn (a laptop sleeps, a link
stalls), so one miss must never add up to a ban over hours; a peer sending garbage sends
it fast and often. Every penalty is therefore forgotten exponentially (half-life
`half_life_s`): an honest peer's occasional resets fade, while 6 invalid messages in a
row ban at once.
Bans last `ban_s`, doubled for each earlier ban of the same peer (capped at `ban_max_s`).

Why slowness is scored apart: a peer starved of CPU or bandwidth misses deadlines often
(an honest peer on a loaded machine was scored to -22.9 by deadlines alone). A missed
deadline is not hostility: the `slow` kinds go to a second component of the score, which
decays like the first but never goes below `-slow_cap` (default 20, a fifth of the ban
threshold), so slowness alone never bans; it only brings a peer that also misbehaves
closer to its ban. Streams held on purpose are bounded by the budget, which scores its own
refusals (`over_budget`).

Pure bookkeeping: time is passed in (`now`, seconds on any monotonic clock), so tests and
the simulator drive it without sleeping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: What each kind of misbehaviour costs (scores start at 0; the ban threshold is negative).
#: `invalid`: bytes that do not decode or break a protocol rule (a hostile peer's mark);
#: `over_budget`: a stream refused by the resource budget; `deadline`: a stream that missed
#: its deadline; `broken`: a stream reset or ended mid-message (churn does that too);
#: `error`: a handler failed for a reason we cannot pin on the peer.
DEFAULT_PENALTIES: dict[str, float] = {
    "invalid": 20.0,
    "invalid_gossip": 20.0,
    "over_budget": 5.0,
    "deadline": 2.0,
    "broken": 1.0,
    "error": 1.0,
    "unwanted": 5.0,
}

#: Kinds that say a peer is slow, not hostile: scored in the capped component.
SLOW_KINDS = frozenset({"deadline"})


@dataclass(frozen=True)
class ScoreSettings:
    """How peers are scored and banned; the defaults are the table in docs/robustness.md."""

    half_life_s: float = 60.0
    ban_threshold: float = -100.0
    ban_s: float = 600.0
    ban_max_s: float = 86_400.0
    # Peers remembered at most; the ones with the least to remember go first.
    max_peers: int = 4096
    # The slow kinds' part of a score never goes below -slow_cap (above the threshold).
    slow_cap: float = 20.0
    penalties: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_PENALTIES))


@dataclass
class Ban:
    until: float
    reason: str
    count: int  # how many times this peer was banned (this one included)


@dataclass
class _Record:
    score: float = 0.0  # the hostile part (every kind not in SLOW_KINDS)
    slow: float = 0.0  # the slow part, in [-slow_cap, 0]
    at: float = 0.0  # when both were last brought up to date
    bans: int = 0
    ban: Ban | None = None
    by_kind: dict[str, int] = field(default_factory=dict)


class PeerScores:
    """Scores with exponential decay and bans with expiry. Not thread-safe (trio thread)."""

    def __init__(self, settings: ScoreSettings | None = None) -> None:
        self.settings = settings or ScoreSettings()
        self._peers: dict[str, _Record] = {}
        self.bans_total = 0

    def _decayed(self, rec: _Record, now: float) -> float:
        if now > rec.at:
            factor = math.pow(0.5, (now - rec.at) / self.settings.half_life_s)
            rec.score *= factor
            rec.slow *= factor
            rec.at = now
        return rec.score + rec.slow

    def penalize(self, peer: str, kind: str, now: float) -> Ban | None:
        """Count one misbehaviour; returns the new Ban if this one crossed the threshold."""
        s = self.settings
        rec = self._peers.get(peer)
        if rec is None:
            self._make_room(now)
            rec = self._peers[peer] = _Record(at=now)
        rec.by_kind[kind] = rec.by_kind.get(kind, 0) + 1
        if self.banned(peer, now) is not None:
            return None  # already out; what it still sends is refused, not scored twice
        self._decayed(rec, now)
        penalty = s.penalties.get(kind, s.penalties.get("error", 1.0))
        if kind in SLOW_KINDS:
            rec.slow = max(-s.slow_cap, rec.slow - penalty)
        else:
            rec.score -= penalty
        if rec.score + rec.slow > s.ban_threshold:
            return None
        rec.bans += 1
        rec.score = rec.slow = 0.0  # a fresh start when the ban ends; the doubling remembers
        duration = min(s.ban_max_s, s.ban_s * 2 ** (rec.bans - 1))
        rec.ban = Ban(until=now + duration, reason=kind, count=rec.bans)
        self.bans_total += 1
        return rec.ban

    def banned(self, peer: str, now: float) -> Ban | None:
        rec = self._peers.get(peer)
        if rec is None or rec.ban is None:
            return None
        if now >= rec.ban.until:
            rec.ban = None
            return None
        return rec.ban

    def score(self, peer: str, now: float) -> float:
        rec = self._peers.get(peer)
        return 0.0 if rec is None else self._decayed(rec, now)

    def bans(self, now: float) -> dict[str, Ban]:
        return {p: b for p in list(self._peers) if (b := self.banned(p, now)) is not None}

    def statistics(self, now: float, top: int = 20) -> dict[str, Any]:
        """The `top` lowest scores, every ban in force (seconds left) and the totals."""
        scored = sorted(((self._decayed(r, now), p) for p, r in self._peers.items()))
        return {
            "scores": {p: round(v, 1) for v, p in scored[:top] if v < -0.05},
            "bans": {p: {"reason": b.reason, "seconds_left": round(b.until - now, 1),
                         "count": b.count,
                         "misbehaviour": dict(self._peers[p].by_kind)}
                     for p, b in self.bans(now).items()},
            "bans_total": self.bans_total,
            "peers_scored": len(self._peers),
        }

    def _make_room(self, now: float) -> None:
        if len(self._peers) < self.settings.max_peers:
            return
        # Forget the peer with the least to remember: not banned, score nearest zero.
        candidates = [(abs(self._decayed(r, now)), p) for p, r in self._peers.items()
                      if self.banned(p, now) is None]
        if candidates:
            del self._peers[min(candidates)[1]]
        else:  # every remembered peer is banned: drop the ban that ends first
            del self._peers[min(self._peers, key=lambda p: self._peers[p].ban.until)]  # type: ignore[union-attr]
