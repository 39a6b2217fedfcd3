"""Heartbeats: each member of a run gossips one every `heartbeat_interval_s` (1 s in a small
run, longer as the run grows) on `/peertrain/<run-id>/hb/1`.

A heartbeat says who is alive, where to dial them, and a few numbers for `node status`.
It is msgpack, at most MAX_BYTES, and must name the peer that signed the gossip message
(gossipsub's strict signing gives us `from_id`), so nobody can announce someone else.

`(epoch, seq)` orders one peer's heartbeats: `epoch` is when its process started (unix
ms), `seq` counts from 1 in each process. Gossip can deliver a heartbeat minutes late (a
mesh that re-forms re-sends what it cached); the receiver keeps only heartbeats newer than
the last one it took, so a late one cannot bring a killed peer or an old step back.
Heartbeats from senders without an epoch decode with 0 (ordered by seq alone).

Rate (issue 30): every node receives every heartbeat of the run, so a fixed interval costs
each node N messages per second. `heartbeat_interval_s` stretches the interval as the view
grows so that N / interval stays at or under a target inbound rate; each heartbeat carries
the interval its sender uses (`interval_ms`, optional on the wire: older senders omit it
and decode with 0, older receivers ignore it), and `liveness_ttl_s` turns it into how long
the receiver keeps the sender live. `InboundLimiter` enforces the bound on the receiving
side whatever senders do: one token bucket per peer and one for all of them; a heartbeat
without a token is dropped (and counted by the caller). All pure: time is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack

from protocols.errors import RemoteProtocolError
from protocols.limits import StreamLimits

VERSION = 1
MAX_BYTES = 4096
MAX_ADDRS = 8
MAX_INTERVAL_MS = 24 * 3600 * 1000  # an announced interval longer than a day is refused

#: One gossip message, checked on its length before msgpack sees it.
LIMITS = StreamLimits("/peertrain/<run-id>/hb/1", MAX_BYTES, framed=False,
                      note="none: a gossip message arrives whole")


#: Unique heartbeats per second a node budgets for the whole run's membership (its inbound
#: share before gossipsub's duplicates). 50/s of ~300 B messages, each decoded and checked
#: in ~0.1 ms of Python, is well under 1% of the trio thread a trainer shares with pubsub.
TARGET_INBOUND_PER_S = 50.0
#: A peer stays live while it has missed fewer than this many of its announced heartbeats.
TTL_BEATS = 4
#: InboundLimiter: how far past the expected rate a peer (and all peers) may go before
#: beats are dropped: room for a sender whose view is smaller than ours, and for jitter.
SLACK = 2.0
#: ... and the burst a new or quiet peer may send at once (a joiner's first 4 fast beats).
BURST = 6.0


def heartbeat_interval_s(view_size: int, base_s: float = 1.0,
                         target_inbound_per_s: float = TARGET_INBOUND_PER_S) -> float:
    """Seconds between a node's heartbeats when its view holds `view_size` peers (itself
    included): `max(base_s, view_size / target_inbound_per_s)`. If every node follows it,
    each receives min(N / base_s, target) heartbeats per second; at N = 10,000 and
    the default target that is one heartbeat every 200 s per peer."""
    if not base_s > 0 or not target_inbound_per_s > 0:
        raise ValueError("base_s and target_inbound_per_s must be positive")
    return max(base_s, max(1, view_size) / target_inbound_per_s)


def liveness_ttl_s(announced_interval_s: float, base_ttl_s: float,
                   own_interval_s: float = 0.0, beats: int = TTL_BEATS,
                   slack: float = SLACK) -> float:
    """How long a peer stays live after its last heartbeat: `beats` of the interval it
    announced (0 for an older sender: then `base_ttl_s`), never less than `base_ttl_s`, nor
    less than `beats` of the gap our InboundLimiter lets through at our own interval
    (`own_interval_s / slack`), so a peer we throttle never flaps out of the view."""
    announced = announced_interval_s if math.isfinite(announced_interval_s) else 0.0
    return max(base_ttl_s, beats * max(0.0, announced), beats * own_interval_s / slack)


class InboundLimiter:
    """The receiving side's bound on heartbeats, whatever the senders do.

    Per peer, a token bucket refilled at `slack / heartbeat_interval_s(view_size, ...)` (a
    peer following the policy uses half of it) holding at most `burst`; across all peers,
    one bucket refilled at `slack * target_inbound_per_s` per second holding one second of
    it (honest peers send min(N / base_s, target) a second together). Accepted heartbeats
    over any window of t seconds are then at most slack * target * (t + 1), whatever N:
    new identities cannot get past the global bucket. `admit` says whether one heartbeat
    is taken."""

    def __init__(self, base_s: float = 1.0, target_inbound_per_s: float = TARGET_INBOUND_PER_S,
                 *, slack: float = SLACK, burst: float = BURST, max_peers: int = 65_536) -> None:
        heartbeat_interval_s(1, base_s, target_inbound_per_s)  # checks the arguments
        self.base_s, self.target = base_s, target_inbound_per_s
        self.slack, self.burst, self.max_peers = slack, burst, max_peers
        self._peers: dict[str, tuple[float, float]] = {}  # peer -> (tokens, when)
        self._all: tuple[float, float] | None = None
        self.dropped = 0

    def global_rate(self, view_size: int = 0) -> float:
        """Heartbeats per second let through from all peers together (whatever the view
        size: the bound is a constant)."""
        return self.slack * self.target

    def admit(self, peer: str, now: float, view_size: int) -> bool:
        rate = self.slack / heartbeat_interval_s(view_size, self.base_s, self.target)
        tokens, when = self._peers.get(peer, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - when) * rate)
        cap = self.global_rate(view_size)
        all_tokens, all_when = self._all or (cap, now)
        all_tokens = min(cap, all_tokens + max(0.0, now - all_when) * cap)
        ok = tokens >= 1.0 and all_tokens >= 1.0
        if ok:
            tokens, all_tokens = tokens - 1.0, all_tokens - 1.0
        else:
            self.dropped += 1
        self._all = (all_tokens, now)
        if peer not in self._peers and len(self._peers) >= self.max_peers:
            self._forget(now, rate)
        if len(self._peers) < self.max_peers or peer in self._peers:
            self._peers[peer] = (tokens, now)
        return ok

    def _forget(self, now: float, rate: float) -> None:
        """Drop peers whose bucket has refilled (they cost nothing to recreate full)."""
        for p in [p for p, (t, w) in self._peers.items() if t + (now - w) * rate >= self.burst]:
            del self._peers[p]

    def __len__(self) -> int:
        return len(self._peers)


def topic(run_id: str) -> str:
    return f"/peertrain/{run_id}/hb/1"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    peer: str
    seq: int
    addrs: tuple[str, ...] = ()
    role: str = "node"
    device: str = "cpu"
    stats: dict = field(default_factory=dict)  # small numbers: step, loss, ...
    epoch: int = 0  # the sender process's start, unix ms
    interval_ms: int = 0  # the sender's interval until its next beat; 0: not said (older)

    @property
    def order(self) -> tuple[int, int]:
        """Later heartbeats of one peer compare greater."""
        return (self.epoch, self.seq)

    def encode(self) -> bytes:
        data = msgpack.packb({"v": VERSION, "peer": self.peer, "seq": self.seq,
                              "addrs": list(self.addrs[:MAX_ADDRS]), "role": self.role,
                              "device": self.device, "stats": self.stats, "epoch": self.epoch,
                              **({"iv": self.interval_ms} if self.interval_ms else {})})
        if len(data) > MAX_BYTES:
            raise ValueError(f"heartbeat of {len(data)} bytes exceeds {MAX_BYTES}")
        return data


def decode(data: bytes, sender: str) -> Heartbeat:
    """Decode a heartbeat gossiped by `sender`; RemoteProtocolError on anything odd."""
    if len(data) > MAX_BYTES:
        raise RemoteProtocolError(f"heartbeat of {len(data)} bytes exceeds {MAX_BYTES}")
    try:
        doc = msgpack.unpackb(data, max_str_len=MAX_BYTES, max_bin_len=0,
                              max_array_len=64, max_map_len=64)
    except Exception as e:
        raise RemoteProtocolError(f"heartbeat is not msgpack: {e}") from e
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise RemoteProtocolError("heartbeat with an unknown version")
    peer, seq, addrs = doc.get("peer"), doc.get("seq"), doc.get("addrs", [])
    if peer != sender:
        raise RemoteProtocolError(f"heartbeat for {peer!r} gossiped by {sender}")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise RemoteProtocolError("heartbeat seq must be a non-negative int")
    epoch = doc.get("epoch", 0)
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 2**63:
        raise RemoteProtocolError("heartbeat epoch must be a non-negative int")
    interval_ms = doc.get("iv", 0)
    if not isinstance(interval_ms, int) or isinstance(interval_ms, bool) or not (
            0 <= interval_ms <= MAX_INTERVAL_MS):
        raise RemoteProtocolError(f"heartbeat interval must be an int in 0..{MAX_INTERVAL_MS} ms")
    if not isinstance(addrs, list) or not all(isinstance(a, str) and len(a) < 256 for a in addrs):
        raise RemoteProtocolError("heartbeat addrs must be a list of short strings")
    role, device = doc.get("role", "node"), doc.get("device", "cpu")
    stats = doc.get("stats", {})
    if not isinstance(role, str) or not isinstance(device, str) or not isinstance(stats, dict):
        raise RemoteProtocolError("heartbeat role/device/stats have the wrong type")
    stats = {str(k)[:32]: v for k, v in stats.items()
             if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    return Heartbeat(peer, seq, tuple(addrs[:MAX_ADDRS]), role[:32], device[:32], stats, epoch,
                     interval_ms)
