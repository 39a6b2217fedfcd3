"""Stage claims: one stage map agreed through the run document, each claim a lease.

A host of stage n writes `stage/<n>/<its id>` in the run document (protocols/rundoc.py:
only the id may write it, signed, merged last-writer-wins), value `{"lease_ms", "since_ms",
"at_ms", "bid"}`, and rewrites it every RENEW_S while it hosts the stage. A claim is
honoured until it was renewed (`at_ms`, and never later than the entry's stamp) plus its
lease (LEASE_S, capped at MAX_LEASE_MS so a claim cannot hold a stage for ever): the
renewal time is in the value, so a re-signing of the entry with its value unchanged (the
document's refresh of a live peer's old entries) renews nothing. An expired claim frees
the stage with no word from its writer (a SIGKILLed host); a host that leaves or moves
tombstones its claim, which frees the stage at once; compaction forgets claims with the
rest of a departed peer's keys.

Why a lease and not only heartbeats: heartbeats say who is alive *now* in one node's view,
and under load they arrive late (issue 27: a host's heartbeat 7 s late made its stage look
empty and another node took it over from the seed). A claim is shared state: every
replica converges on the same set (gossip plus anti-entropy), so the nodes agree on who
holds a stage, and how long that holds without a renewal is written in the entry.

The rules (pure functions of the document and `now_ms`, so every node computes the same):

* `hosting`: each peer's stage is its newest live claim that is not a bid;
* a joiner fills the emptiest stage of the agreed map (`merged`: heartbeats for peers in
  the live view, claims for those a late view misses), and placement.rebalance moves
  concurrent joiners apart by its deterministic rule (highest id moves);
* a trained node takes over a stage left with no host only by bidding: it writes a claim
  with `bid` set and waits BID_S, long enough for a concurrent bid to arrive by gossip;
  the claims on a stage rank by `(since_ms, peer id)`, and the first one holds it
  (`verdict`). While any other claim on the stage is live (a host's lease, or an earlier
  bid) the takeover is refused; the losers withdraw their bids. Equal `since_ms` stamps
  (two bids written in the same millisecond) fall to the lower peer id: total, so
  concurrent bids converge on one winner on every replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from protocols.rundoc import Entry, RunDocument

LEASE_S = 15.0  # = convergence.FRESH_S: the same bound on a sign of life as heartbeats
RENEW_S = 3.0  # a host rewrites its claim this often: 5 renewals per lease
BID_S = 4.0  # a bid waits this long for concurrent ones (2 gossip announces of 2 s)
MAX_LEASE_MS = 60_000  # a longer lease in an entry is read as this

Verdict = Literal["bid", "wait", "won", "lost", "refused"]


@dataclass(frozen=True, slots=True)
class Claim:
    """A live claim of `peer` on `stage`, read from its `stage/<stage>/<peer>` entry."""

    peer: str
    stage: int
    since_ms: int  # when the peer first claimed the stage (kept across renewals)
    renewed_ms: int  # its writer's clock at the last renewal (at most the entry's stamp)
    lease_ms: int
    bid: bool

    @property
    def expires_ms(self) -> int:
        return self.renewed_ms + self.lease_ms

    @property
    def rank(self) -> tuple[int, str]:
        """Earlier claims first; the lower peer id between claims of the same ms."""
        return (self.since_ms, self.peer)


def key(stage: int, peer: str) -> str:
    return f"stage/{stage}/{peer}"


def parse(entry: Entry, stages: int) -> Claim | None:
    """The claim an entry holds, or None (a tombstone, another key, a malformed value:
    what cannot be read is no claim, so a garbled entry never holds a stage)."""
    parts = entry.key.split("/")
    if entry.tombstone or len(parts) != 3 or parts[0] != "stage" or not parts[1].isdecimal():
        return None
    stage = int(parts[1])
    if not 0 <= stage < stages:
        return None
    try:
        value = entry.value
    except Exception:  # RemoteProtocolError: admitted entries decode, but be safe
        return None
    if not isinstance(value, dict):
        return None
    lease, since, bid = value.get("lease_ms"), value.get("since_ms"), value.get("bid", False)
    at = value.get("at_ms", entry.hlc.wall_ms)
    if type(lease) is not int or type(since) is not int or type(bid) is not bool or lease <= 0:
        return None
    if type(at) is not int:
        return None
    renewed = min(at, entry.hlc.wall_ms)
    return Claim(parts[2], stage, min(since, renewed), renewed, min(lease, MAX_LEASE_MS), bid)


def live(doc: RunDocument, stages: int, now_ms: int) -> list[Claim]:
    """Every unexpired claim in the document."""
    out = []
    for entry in doc.entries("stage/"):
        c = parse(entry, stages)
        if c is not None and c.expires_ms > now_ms:
            out.append(c)
    return out


def hosting(claims: Iterable[Claim]) -> dict[str, int]:
    """peer -> the stage its newest live claim that is not a bid names (a peer that moved
    holds its old claim until the tombstone arrives or the lease ends: the newer wins)."""
    newest: dict[str, Claim] = {}
    for c in claims:
        if not c.bid and (c.peer not in newest or c.renewed_ms > newest[c.peer].renewed_ms):
            newest[c.peer] = c
    return {p: c.stage for p, c in newest.items()}


def merged(heard: Mapping[str, int], claims: Iterable[Claim]) -> dict[str, int]:
    """The map a joiner chooses by: peers in the live view where their heartbeats say,
    the others where their live claims say (a host whose heartbeats arrive late)."""
    return {**hosting(claims), **heard}


def renewing(claims: Iterable[Claim], now_ms: int, within_ms: int) -> dict[str, int]:
    """`hosting` over the claims renewed within the last `within_ms`: hosts that were alive
    a moment ago by their own writes, heard or not. A SIGKILLed host drops out `within_ms`
    after its last renewal, long before its lease ends."""
    return hosting(c for c in claims if now_ms - c.renewed_ms <= within_ms)


def holders(claims: Iterable[Claim], stage: int) -> list[Claim]:
    """The live claims on `stage`, bids included, in rank order (the first holds it)."""
    return sorted((c for c in claims if c.stage == stage), key=lambda c: c.rank)


def verdict(me: str, stage: int, claims: Iterable[Claim], now_ms: int,
            bid_s: float = BID_S) -> tuple[Verdict, str | None]:
    """What a trained node that wants to take `stage` over does now, and the peer that
    decides it: "refused" (another live claim holds it and we have not bid), "bid" (none:
    write a bid), "wait" (our bid is first but younger than `bid_s`), "won" (move),
    "lost" (a claim ranked before our bid: withdraw it)."""
    ranked = holders(claims, stage)
    mine = next((c for c in ranked if c.peer == me and c.bid), None)
    first = next((c for c in ranked if c.peer != me), None)
    if mine is None:
        return ("refused", first.peer) if first is not None else ("bid", None)
    if first is not None and first.rank < mine.rank:
        return "lost", first.peer
    if now_ms - mine.since_ms < bid_s * 1000:
        return "wait", None
    return "won", None


class StageLease:
    """This node's claims in the document: the stage it holds, and a takeover bid.

    Each write goes to `publish` (the delta, gossiped at once); anti-entropy repairs what
    gossip loses. Not thread-safe: the trio thread only."""

    def __init__(self, doc: RunDocument, me: str, stages: int,
                 publish: Callable[[bytes], None], lease_s: float = LEASE_S,
                 renew_s: float = RENEW_S) -> None:
        self.doc, self.me, self.stages, self.publish = doc, me, stages, publish
        self.lease_ms, self.renew_ms = int(lease_s * 1000), int(renew_s * 1000)
        self.stage: int | None = None
        self.since_ms = 0
        self.renewed_ms = 0
        self.bid: int | None = None  # the stage we bid for
        self.bid_since_ms = 0

    def claims(self, now_ms: int) -> list[Claim]:
        return live(self.doc, self.stages, now_ms)

    def hold(self, stage: int, now_ms: int) -> None:
        """Claim `stage` (a bid on it becomes the claim, keeping its rank); a claim on
        another stage is withdrawn."""
        if stage != self.stage:
            self.since_ms = self.bid_since_ms if self.bid == stage else now_ms
            self.stage = stage
            # every other claim of ours goes: the stage we leave, a bid, and what a
            # previous run of this node (its document reloaded from disk) held
            for entry in list(self.doc.entries("stage/")):
                c = parse(entry, self.stages)
                if c is not None and c.peer == self.me and c.stage != stage:
                    self._write(entry.key, None, now_ms)
        self.bid = None
        self._claim(stage, self.since_ms, False, now_ms)
        self.renewed_ms = now_ms

    def renew(self, now_ms: int) -> bool:
        """Rewrite the held claim (and a bid) once RENEW_S has passed; True if written."""
        if self.stage is None or now_ms - self.renewed_ms < self.renew_ms:
            return False
        self._claim(self.stage, self.since_ms, False, now_ms)
        if self.bid is not None:
            self._claim(self.bid, self.bid_since_ms, True, now_ms)
        self.renewed_ms = now_ms
        return True

    def place_bid(self, stage: int, now_ms: int) -> None:
        if self.bid is not None and self.bid != stage:
            self.withdraw_bid(now_ms)
        if self.bid is None:
            self.bid, self.bid_since_ms = stage, now_ms
        self._claim(stage, self.bid_since_ms, True, now_ms)

    def withdraw_bid(self, now_ms: int) -> None:
        if self.bid is not None and self.bid != self.stage:
            self._write(key(self.bid, self.me), None, now_ms)
        self.bid = None

    def release(self, now_ms: int) -> None:
        """Tombstone every claim of ours: the stage is free at once (a clean stop)."""
        self.withdraw_bid(now_ms)
        if self.stage is not None:
            self._write(key(self.stage, self.me), None, now_ms)
        self.stage = None

    def statistics(self, now_ms: int) -> dict[str, Any]:
        return {"stage": self.stage, "since_ms": self.since_ms, "bid": self.bid,
                "map": {str(s): sorted(p for p, t in hosting(self.claims(now_ms)).items()
                                       if t == s) for s in range(self.stages)}}

    def _claim(self, stage: int, since_ms: int, bid: bool, now_ms: int) -> None:
        self._write(key(stage, self.me), {"lease_ms": self.lease_ms, "since_ms": since_ms,
                                          "at_ms": now_ms, "bid": bid}, now_ms)

    def _write(self, k: str, value: dict[str, Any] | None, now_ms: int) -> None:
        delta = (self.doc.delete(k, now_ms) if value is None
                 else self.doc.set(k, value, now_ms))
        self.publish(delta)
