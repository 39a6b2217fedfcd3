"""One stage map agreed through the run document: stage claims as leased CRDT entries
(node/pipe/claims.py; issue 27 item 2). Clocks are injected (`now_ms`): no sleeps."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from node.pipe import claims, placement
from node.pipe.claims import BID_S, LEASE_S, StageLease
from protocols.keys import Signer
from protocols.rundoc import RunDocument
from tests.node.pipe.test_pipe_convergence import service_hearing

RUN = "run-leases"
T0 = 1_700_000_000_000
LEASE_MS = int(LEASE_S * 1000)


class Node:
    """One peer: its replica of the document, its lease, the deltas it published."""

    def __init__(self, i: int, stages: int) -> None:
        self.signer = Signer(bytes([i + 1]) * 32)
        self.me = self.signer.peer_id
        self.doc = RunDocument(RUN, self.signer, [])
        self.out: list[bytes] = []
        self.lease = StageLease(self.doc, self.me, stages, self.out.append)
        self.stages = stages

    def agreed(self, now: int) -> dict[str, int]:
        return claims.hosting(self.lease.claims(now))


def gossip(nodes: list[Node], now: int, rng: random.Random) -> None:
    """Every published delta reaches every other node, in a random order per receiver."""
    sent = [(n, d) for n in nodes for d in n.out]
    for n in nodes:
        n.out.clear()
    for receiver in nodes:
        for sender, delta in rng.sample(sent, len(sent)):
            if sender is not receiver:
                assert not receiver.doc.merge(delta, now).rejected


@pytest.mark.parametrize("seed", range(5))
def test_concurrent_joiners_converge_on_one_balanced_map(seed: int):
    """Seven nodes start at the same moment on a 3-stage run: each sees an empty map and
    claims stage 0. Once the claims are merged (any order), every node computes the same
    agreed map, and placement.rebalance moves them apart one at a time until the map is
    balanced; then every replica of the document is the same, and so is every view."""
    rng = random.Random(seed)
    nodes = [Node(i, 3) for i in range(7)]
    now = T0
    for n in nodes:
        n.lease.hold(placement.choose(n.agreed(now), 3), now)
    for _ in range(20):  # bounded: each round moves at most one node
        now += 1000
        gossip(nodes, now, rng)
        moved = False
        for n in nodes:
            move = placement.rebalance(n.me, n.agreed(now), 3, training=False)
            if move is not None:
                n.lease.hold(move, now)
                moved = True
        if not moved:
            break
    gossip(nodes, now, rng)
    views = {tuple(tuple(r) for r in placement.stage_map(n.agreed(now), 3)) for n in nodes}
    assert len(views) == 1
    smap = placement.stage_map(nodes[0].agreed(now), 3)
    assert sorted(len(r) for r in smap) == [2, 2, 3]
    assert len({n.doc.digest() for n in nodes}) == 1
    # each node holds exactly one claim: the stages it left were withdrawn
    assert all(list(n.agreed(now)).count(n.me) == 1 for n in nodes)
    assert sum(not e.tombstone for e in nodes[0].doc.entries("stage/")) == 7


def test_concurrent_bids_for_an_empty_stage_have_one_winner_on_every_replica():
    a, b, c = Node(0, 4), Node(1, 4), Node(2, 4)
    rng = random.Random(1)
    for n, s in ((a, 0), (b, 1), (c, 3)):
        n.lease.hold(s, T0)
    gossip([a, b, c], T0, rng)
    # stage 2's host is gone and its lease expired: a and b bid in the same millisecond
    now = T0 + 20_000
    for n in (a, b):
        assert claims.verdict(n.me, 2, n.lease.claims(now), now) == ("bid", None)
        n.lease.place_bid(2, now)
    gossip([a, b, c], now, rng)
    later = now + int(BID_S * 1000)
    answers = {n.me: claims.verdict(n.me, 2, n.lease.claims(later), later)[0] for n in (a, b)}
    winner = min(a.me, b.me)  # same since_ms: the lower peer id
    assert answers == {winner: "won", max(a.me, b.me): "lost"}
    # the third node, which did not bid, sees the same first claim
    assert claims.holders(c.lease.claims(later), 2)[0].peer == winner
    # an earlier bid beats a lower id
    x, y = Node(3, 4), Node(4, 4)
    late, early = sorted((x, y), key=lambda n: n.me)  # the lower id bids later
    late.lease.place_bid(2, now + 5)
    early.lease.place_bid(2, now)
    gossip([x, y], now + 5, rng)
    assert claims.verdict(late.me, 2, late.lease.claims(later + 5), later + 5)[0] == "lost"
    assert claims.verdict(early.me, 2, early.lease.claims(later), later)[0] == "won"
    # a bid too young waits for concurrent ones
    assert claims.verdict(early.me, 2, early.lease.claims(now + 1), now + 1)[0] == "wait"


def test_an_expired_lease_frees_the_stage_and_a_renewed_one_holds_it():
    host, other = Node(0, 3), Node(1, 3)
    rng = random.Random(2)
    host.lease.hold(1, T0)
    gossip([host, other], T0, rng)
    assert claims.verdict(other.me, 1, other.lease.claims(T0 + LEASE_MS - 1),
                          T0 + LEASE_MS - 1) == ("refused", host.me)
    # the host renews every RENEW_S while it lives: its stage stays held
    assert not host.lease.renew(T0 + 1000)  # not due yet
    assert host.lease.renew(T0 + 3000)
    gossip([host, other], T0 + 3000, rng)
    assert other.agreed(T0 + LEASE_MS + 1) == {host.me: 1}
    # then it is SIGKILLed: no renewal, no tombstone; its lease ends, the stage is free
    gone = T0 + 3000 + LEASE_MS
    assert other.agreed(gone) == {}
    assert claims.verdict(other.me, 1, other.lease.claims(gone), gone) == ("bid", None)
    assert placement.choose(claims.merged({other.me: 0}, other.lease.claims(gone)), 3) == 1
    # a clean stop tombstones the claim: free at once
    host.lease.hold(2, gone)
    gossip([host, other], gone, rng)
    assert other.agreed(gone + 1) == {host.me: 2}
    host.lease.release(gone + 2)
    gossip([host, other], gone + 2, rng)
    assert other.agreed(gone + 3) == {}


def test_claims_that_cannot_be_read_hold_nothing():
    n = Node(0, 3)
    n.doc.set(claims.key(1, n.me), {"lease_ms": "long", "since_ms": T0}, T0)
    n.doc.set(claims.key(2, n.me), [1, 2], T0)
    n.doc.set(claims.key(7, n.me), {"lease_ms": 1000, "since_ms": T0, "bid": False}, T0)
    assert n.lease.claims(T0 + 1) == []
    # a lease longer than MAX_LEASE_MS is read as that: no claim holds a stage for ever
    n.doc.set(claims.key(0, n.me), {"lease_ms": 10**12, "since_ms": T0, "bid": False}, T0)
    assert n.agreed(T0 + claims.MAX_LEASE_MS - 1) == {n.me: 0}
    assert n.agreed(T0 + claims.MAX_LEASE_MS + 1) == {}


def leased_service(*beats, claims_of: dict[str, tuple[int, int]], stage: int = 0):
    """service_hearing's training service, with a run document holding, for each peer,
    a claim on (stage, written at ms) by a peer of its own (heartbeats name peers by
    made-up ids, claims by real keys: the claims alone decide the lease rule here)."""
    signer = Signer(bytes([9]) * 32)
    service = service_hearing(*beats, me=signer.peer_id, stage=stage)
    me = service.map.ctx.peer_id
    doc = RunDocument(RUN, signer, [])
    for i, (s, at) in enumerate(claims_of.values()):
        writer = Node(10 + i, 4)
        writer.lease.hold(s, at)
        for delta in writer.out:
            assert not doc.merge(delta, at).rejected
    service.map.lease = StageLease(doc, me, 4, lambda d: None)
    service.map.ctx.run = SimpleNamespace(document=doc)
    return service


def test_a_takeover_is_refused_while_the_stage_s_lease_is_live():
    """Stage 1's host was last heard 16 s ago: past the heartbeat rule's 15 s, so the
    live view alone would let this node (stage 0's second host) take stage 1 over. Its
    claim was renewed 5 s ago (anti-entropy brought it: the host is alive, its heartbeats
    late): refused. Once no claim is live, the node bids, and moves after BID_S."""
    import time

    # ids below this node's (a real key's, "12D3..."), so that it is the one to move
    others = [("0a0", 0, 0.5, {}), ("0c2", 2, 0.5, {}), ("0d3", 3, 0.5, {})]
    now = int(time.time() * 1000)
    service = leased_service(*others, ("0b1", 1, 16.0, {}),
                             claims_of={"0b1": (1, now - 5000)})
    service.choice.follow_once()
    assert service.state.move_to is None and not service.state.stop.is_set()
    assert service.state.counters["refused: takeover (lease)"] == 1
    assert service.map.lease.bid is None

    expired = {"0b1": (1, now - LEASE_MS - 1000)}
    service = leased_service(*others, ("0b1", 1, 16.0, {}), claims_of=expired)
    service.choice.follow_once()  # no live claim: a bid, no move yet
    assert service.map.lease.bid == 1 and service.state.move_to is None
    service = leased_service(*others, ("0b1", 1, 16.0, {}), claims_of=expired)
    service.map.lease.place_bid(1, now - int(BID_S * 1000) - 1)  # a bid placed BID_S ago
    service.choice.follow_once()
    assert service.state.move_to == 1 and service.state.stop.is_set()



def test_re_signing_a_claim_unchanged_renews_no_lease():
    """The document re-signs a live peer's old entries with their values unchanged (so
    that compaction never drops them): that must not bring an expired lease back."""
    n = Node(0, 3)
    n.lease.hold(1, T0)
    entry = n.doc.entry(claims.key(1, n.me))
    assert entry is not None
    later = T0 + LEASE_MS + 1
    n.doc.set(entry.key, entry.value, later)  # what a refresh writes
    assert n.agreed(later) == {}
    assert n.lease.renew(later) and n.agreed(later + 1) == {n.me: 1}  # a renewal does


async def test_a_stopping_service_frees_its_stage_at_once(autojump_clock):
    """The pipeline service's lease task renews the claim and, when the service stops
    (the task cancelled), tombstones it: others see the stage free without waiting out
    the lease."""
    import time

    import trio

    service = leased_service(("0a0", 0, 0.5, {}), claims_of={})
    now = int(time.time() * 1000)
    lease = service.map.lease
    lease.hold(2, now)
    other = Node(20, 4)
    doc = lease.doc

    def sync() -> None:  # what gossip would carry from the service's document to another
        assert not other.doc.merge(doc.encode_delta(doc.entries("stage/")), now + 2).rejected

    async with trio.open_nursery() as nursery:
        nursery.start_soon(service.choice.hold_lease)
        await trio.sleep(60)  # virtual: the task loops, renewing when due
        sync()
        assert other.agreed(now + 3) == {lease.me: 2}
        nursery.cancel_scope.cancel()
    assert lease.claims(now + 1) == [] and lease.stage is None
    sync()
    assert other.agreed(now + 3) == {}  # free at once, 15 s of lease left unused


def test_a_host_renewing_its_claim_counts_as_live_and_a_killed_one_drops_out_first():
    """claims.renewing: what a recovery waits to hear (node/pipe/recovery.py `_hear_hosts`).
    A host renewing every RENEW_S stays in; SIGKILLed, it drops out `within` after its last
    renewal, while its lease still holds the stage; a bid is no host."""
    host, bidder, other = Node(0, 3), Node(1, 3), Node(2, 3)
    rng = random.Random(3)
    host.lease.hold(2, T0)
    bidder.lease.place_bid(0, T0)
    gossip([host, bidder, other], T0, rng)
    within = 6000
    assert claims.renewing(other.lease.claims(T0 + 1000), T0 + 1000, within) == {host.me: 2}
    host.lease.renew(T0 + 3000)
    gossip([host, bidder, other], T0 + 3000, rng)
    assert claims.renewing(other.lease.claims(T0 + 9000), T0 + 9000, within) == {host.me: 2}
    # killed after the renewal at T0 + 3 s: out at 3 s + within, the lease holds on
    dead = T0 + 3000 + within + 1
    assert claims.renewing(other.lease.claims(dead), dead, within) == {}
    assert other.agreed(dead) == {host.me: 2}
