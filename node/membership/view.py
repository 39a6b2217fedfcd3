"""The one membership view: who is in the run, where to reach them, what they report.

Two sources, one view:
* heartbeats (gossip, every second): who is *live* right now. A peer silent for `ttl_s`
  has left; a SIGKILLed peer disappears within it. The averager pairs among live nodes,
  anti-entropy picks live partners, the trainer follows the live swarm's step.
* the run document (signed, replicated, persisted): who has been a member recently and
  at which addresses, even while we cannot hear them (a partition, our own restart). The
  redialer dials those addresses; `node status` lists them as members.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from node.run.rundoc_sync import now_ms
from p2p.peerbook import PeerBook, PeerEntry
from protocols.heartbeat import Heartbeat, liveness_ttl_s
from protocols.rundoc import RunDocument

#: How long a run-document member's addresses stay worth dialing after its last entry.
REDIAL_HORIZON_S = 600.0
#: A run-document member is listed while its last_seen is at most three announces (2 s
#: each, node/run/rundoc_sync.py) and some gossip delay old.
MEMBER_TTL_S = 8.0


class Membership:
    def __init__(self, me: str, ttl_s: float) -> None:
        self.me = me
        # 65,536: a run of 10,000 (issue 30) must not evict live peers; departed ones
        # are expired (HeartbeatService.view_size)
        self.book = PeerBook(ttl=ttl_s, max_peers=65_536)
        self.document: RunDocument | None = None  # attached when the run is known
        self.started = time.monotonic()
        self.first_peer_after_s: float | None = None
        self.stale_heartbeats = 0  # late gossip, older than what the view holds
        # How often members rewrite their run-document entries now (RunDocSync sets it):
        # a member is listed while its last_seen is within a few of these.
        self.announce_interval_s = 2.0

    # -- writes ---------------------------------------------------------------------------

    def heard(self, beat: Heartbeat, now: float | None = None,
              wall: float | None = None, own_interval_s: float = 0.0) -> bool:
        """Record a verified heartbeat; True when the peer is new to the view. A heartbeat
        no newer than the last one taken from its peer (gossip delivered it late) is
        counted in `stale_heartbeats` and changes nothing (protocols/heartbeat.py). The
        peer stays live for `liveness_ttl_s` of the interval it announced (at least the
        view's ttl): in a large run heartbeats are minutes apart."""
        now = time.monotonic() if now is None else now
        entry = self.book.get(beat.peer)
        if entry is not None and tuple(entry.info.get("order", (-1, -1))) >= beat.order:
            self.stale_heartbeats += 1
            return False
        new = entry is None
        if self.first_peer_after_s is None and beat.role == "node":
            self.first_peer_after_s = now - self.started
        info: dict[str, Any] = {"role": beat.role, "device": beat.device, "stats": beat.stats,
                "order": beat.order}
        t = beat.stats.get("t") if isinstance(beat.stats, dict) else None
        if isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t):
            # our clock minus its, plus gossip's delay (a hostile t moves the median by one
            # rank at most; NaN or inf would have broken it)
            info["offset"] = (time.time() if wall is None else wall) - t
        ttl = liveness_ttl_s(beat.interval_ms / 1000, self.book.ttl, own_interval_s)
        self.book.seen(beat.peer, now, list(beat.addrs), info, ttl=ttl)
        return new

    def attach(self, document: RunDocument) -> None:
        self.document = document

    # -- reads ----------------------------------------------------------------------------

    def live(self, now: float | None = None) -> list[PeerEntry]:
        """Peers heard within the ttl (training nodes and bootstraps), sorted by id."""
        return self.book.live(time.monotonic() if now is None else now)

    def recent_count(self, now: float | None = None) -> int:
        """Peers heard within 10 of their ttls (the book's memory; older ones are
        forgotten here): the run's size as the heartbeat and announce intervals see it.
        Not the live count, which a loaded machine's late heartbeats shrink: a smaller
        count shortens both intervals, and the extra messages load every node further
        (node/membership/heartbeats.py, `view_size`)."""
        now = time.monotonic() if now is None else now
        self.book.expire(now)
        return len(self.book)

    def live_nodes(self) -> list[str]:
        """Ids of live training nodes: the averager's pairing pool."""
        return [e.peer_id for e in self.live() if e.info.get("role") == "node"]

    def live_peers(self) -> list[str]:
        return [e.peer_id for e in self.live()]

    def clock_offset(self, now: float | None = None) -> float | None:
        """The median, over live peers whose heartbeats carry their wall clock (`t`) and
        ourselves (0), of our clock minus theirs (plus gossip's delay): about 0 where
        clocks are synchronized (NTP). Subtracted before a heartbeat's age is judged, so a
        node whose own clock is off still sees the swarm as live, and a peer whose clock
        is off from everyone's looks old to the others. Our own vote keeps one stale
        heartbeat, the only one a fresh joiner has heard, from passing for the swarm's
        clock. None before any such heartbeat."""
        offsets = [e.info["offset"] for e in self.live(now) if "offset" in e.info]
        return statistics.median([0.0, *offsets]) if offsets else None

    def age(self, entry: PeerEntry, now_wall: float | None = None,
            now: float | None = None) -> float | None:
        """How long ago `entry`'s last heartbeat was written, by the swarm's clock (see
        clock_offset); None when it carries no `t`."""
        t = (entry.info.get("stats") or {}).get("t")
        if not isinstance(t, int | float) or isinstance(t, bool):
            return None
        now_wall = time.time() if now_wall is None else now_wall
        return now_wall - t - (self.clock_offset(now) or 0.0)

    def swarm_step(self) -> int:
        """The highest step a live peer reports: a node behind it catches up."""
        steps = [e.info.get("stats", {}).get("step") for e in self.live()]
        return max((s for s in steps if isinstance(s, int)), default=0)

    def documented(self, ttl_s: float) -> dict[str, dict[str, Any]]:
        """Run-document members with a `last_seen` within `ttl_s`: id -> own entries. One
        pass over the `peer/` entries (not one scan per member: 10,000 members would make
        that 10,000 sorts of the whole document, every redial tick)."""
        doc = self.document
        if doc is None:
            return {}
        members = doc.members(now_ms(), int(ttl_s * 1000))
        out: dict[str, dict[str, Any]] = {p: {} for p in members}
        for key, value in doc.items("peer/"):
            parts = key.split("/", 2)
            if len(parts) == 3 and parts[1] in out and "/" not in parts[2]:
                if parts[2] == "info" and isinstance(value, dict):  # one entry, since #30
                    out[parts[1]].update(value)
                else:  # an older node's one key per field; not peer/<id>/ckpt/<cid>
                    out[parts[1]][parts[2]] = value
        for peer, wall_ms in members.items():
            out[peer]["last_seen_ms"] = wall_ms
        return out

    def addresses(self) -> dict[str, list[str]]:
        """Where to dial each known peer: the run document's recent members, then the live
        peers' heartbeat addresses (newer, so they win)."""
        out: dict[str, list[str]] = {}
        doc = self.document
        members = doc.members(now_ms(), int(REDIAL_HORIZON_S * 1000)) if doc else {}
        for peer in members:  # only the addresses: N = 10,000 holds 30,000 entries
            assert doc is not None
            info = doc.get(f"peer/{peer}/info")
            addrs = info.get("addrs") if isinstance(info, dict) else \
                doc.get(f"peer/{peer}/addrs")  # an older node's own key
            if isinstance(addrs, list) and all(isinstance(a, str) for a in addrs):
                out[peer] = addrs
        for e in self.live():
            if e.addrs:
                out[e.peer_id] = e.addrs
        out.pop(self.me, None)
        return out

    def addresses_of(self, peer: str) -> list[str]:
        """Where to dial one peer (an averaging partner): its live heartbeat's addresses,
        else its run-document entry's; [] when neither is known."""
        for e in self.live():
            if e.peer_id == peer and e.addrs:
                return list(e.addrs)
        doc = self.document
        if doc is None:
            return []
        info = doc.get(f"peer/{peer}/info")
        addrs = info.get("addrs") if isinstance(info, dict) else doc.get(f"peer/{peer}/addrs")
        return [a for a in addrs if isinstance(a, str)] if isinstance(addrs, list) else []

    def members_ttl_s(self) -> float:
        """How old a member's last_seen may be for it to be listed: three announces and
        some gossip delay (MEMBER_TTL_S at the small-run 2 s)."""
        return max(MEMBER_TTL_S, 4 * self.announce_interval_s)

    def statistics(self, members_ttl_s: float | None = None) -> dict[str, Any]:
        now, wall = time.monotonic(), now_ms()
        members_ttl_s = self.members_ttl_s() if members_ttl_s is None else members_ttl_s
        return {
            "peers": [{"peer_id": e.peer_id, "last_seen_s": round(now - e.last_seen, 1),
                       "addrs": e.addrs, **{k: v for k, v in e.info.items()
                                            if k not in ("order", "offset")}}
                      for e in self.live(now) if e.info.get("role") == "node"],
            "members": [{"peer_id": p, "last_seen_s": round((wall - info.pop("last_seen_ms"))
                                                            / 1000, 1), **info}
                        for p, info in sorted(self.documented(members_ttl_s).items())
                        if p != self.me],
            "first_peer_after_s": self.first_peer_after_s,
            "stale_heartbeats": self.stale_heartbeats,
            "clock_offset_s": None if (off := self.clock_offset()) is None else round(off, 1),
        }
