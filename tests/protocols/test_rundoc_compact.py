"""Compaction of the run document (issue 30): the rule that drops departed peers' keys and
old tombstones (protocols/rundoc.py `compactable`), replicas that compact at different times
still converging, and a fresh replica that compacts only once it caught up with a peer
(node/run/rundoc_sync.py), so it never refuses the swarm's older entries for good."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from node.run.rundoc_sync import RunDocSync
from protocols.keys import Signer
from protocols.rundoc import RunDocument, compactable

RUN = "run-1"
SIGNERS = [Signer(bytes([i + 1]) * 32) for i in range(6)]
ADMINS = {SIGNERS[0].peer_id}
T0 = 1_700_000_000_000
EMPTY = RunDocument(RUN, SIGNERS[0], ADMINS).summary()


def doc(i: int, **limits: int) -> RunDocument:
    return RunDocument(RUN, SIGNERS[i], ADMINS, **limits)


def sync(a: RunDocument, b: RunDocument, now: int) -> None:
    """One anti-entropy round, as RunDocSync runs it: a asks, b answers, a answers back."""
    reply = b.delta_since(a.summary())
    a.merge(reply, now)
    b.merge(a.delta_since(b.summary()), now)


def test_the_rule_drops_a_silent_peers_whole_namespace_and_old_tombstones_only():
    d = doc(0)
    gone, alive = doc(1), doc(2)
    # stamps are HLC readings: the old writes come first
    d.set("run/lr", 0.1, T0)
    d.delete("run/old", T0)
    d.merge(gone.set(f"peer/{gone.signer.peer_id}/addrs", ["/a"], T0), T0)
    d.merge(gone.set(f"peer/{gone.signer.peer_id}/ckpt/c1", {"hash": "c1"}, T0), T0)
    d.merge(alive.set(f"peer/{alive.signer.peer_id}/ckpt/c2", {"hash": "c2"}, T0), T0)
    d.merge(alive.delete(f"peer/{alive.signer.peer_id}/x", T0 + 1), T0 + 1)
    d.merge(alive.set(f"peer/{alive.signer.peer_id}/last_seen", 1, T0 + 90_000), T0 + 90_000)
    keys = compactable(d.entries(), T0 + 100_000, 30_000)
    assert keys == sorted([f"peer/{gone.signer.peer_id}/addrs",
                           f"peer/{gone.signer.peer_id}/ckpt/c1",
                           f"peer/{alive.signer.peer_id}/x"])
    # the live peer's old checkpoint entry stays with it; an old admin setting and an
    # admin's tombstone stay (run keys are few, and never under the floor)
    assert d.gc(T0 + 100_000, 30_000) == 3
    assert d.get(f"peer/{alive.signer.peer_id}/ckpt/c2") == {"hash": "c2"}
    assert d.get("run/lr") == 0.1 and d.entry("run/old").tombstone


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_replicas_that_compact_at_different_times_converge(seed):
    """Five writers come and go (some leave for good), gossip loses deltas, each of three
    replicas compacts at its own moments, one anti-entropy round runs a second, live
    writers re-sign what is half a horizon old (`refresh`); after the last writes, a common
    compaction and rounds of anti-entropy every replica holds the same document. (Without
    the refresh a live writer's old key, missed by one replica before its floor passed
    it, was refused there for good: seed 1583.)"""
    rng = random.Random(seed)
    horizon = 20_000
    writers = [doc(i) for i in range(1, 6)]
    replicas = [doc(0), doc(1), doc(2)]
    leave_at = {i: rng.randrange(0, 60) for i in range(5)}
    now = T0
    for step in range(80):
        now = T0 + step * 1_000
        for i, w in enumerate(writers):
            if step > leave_at[i] and i % 2 == 0:
                continue  # writers 0, 2, 4 leave for good
            if (delta := w.refresh(now, horizon // 2)) is not None:
                for r in replicas:
                    if rng.random() < 0.6:
                        r.merge(delta, now)
            if rng.random() < 0.3:
                pid = w.signer.peer_id
                key = f"peer/{pid}/{rng.choice(['a', 'b', 'last_seen'])}"
                delta = w.delete(key, now) if rng.random() < 0.2 else w.set(key, step, now)
                for r in replicas:
                    if rng.random() < 0.6:  # lossy gossip
                        r.merge(delta, now)
        for r in replicas:
            if rng.random() < 0.2:
                r.gc(now, horizon)
        a, b = rng.sample(replicas, 2)
        sync(a, b, now)
    end = now + 1_000
    for r in replicas:
        r.gc(end, horizon)
    for _ in range(2):
        for a in replicas:
            for b in replicas:
                if a is not b:
                    sync(a, b, end)
    assert len({r.digest() for r in replicas}) == 1
    assert compactable(replicas[0].entries(), end, horizon) == []


def test_a_departed_peers_stage_claims_go_with_it_and_the_admins_plan_stays():
    d = doc(0)
    gone, alive = SIGNERS[1], SIGNERS[2]
    d.set("stage/1", {"layers": [0, 1]}, T0)
    d.merge(doc(1).set(f"stage/1/{gone.peer_id}", 1, T0), T0)
    d.merge(doc(1).set(f"peer/{gone.peer_id}/last_seen", 1, T0), T0)
    d.merge(doc(2).set(f"stage/1/{alive.peer_id}", 1, T0), T0)
    d.merge(doc(2).set(f"peer/{alive.peer_id}/last_seen", 1, T0 + 50_000), T0 + 50_000)
    assert compactable(d.entries(), T0 + 60_000, 30_000) == sorted(
        [f"stage/1/{gone.peer_id}", f"peer/{gone.peer_id}/last_seen"])
    d.gc(T0 + 60_000, 30_000)
    # the departed claim is refused when a stale replica sends it back
    stale = doc(3)
    stale.merge(doc(1).set(f"stage/1/{gone.peer_id}", 1, T0), T0)
    result = d.merge(stale.delta_since(EMPTY), T0 + 60_000)
    assert result.rejected == [(f"stage/1/{gone.peer_id}",
                                "older than the GC horizon for an unknown key")]
    assert d.get("stage/1") == {"layers": [0, 1]}


def test_refresh_re_signs_only_our_own_old_live_entries():
    d = doc(1)
    me = SIGNERS[1].peer_id
    d.set(f"peer/{me}/ckpt/c1", {"hash": "c1"}, T0)
    d.set(f"peer/{me}/gone", 1, T0)
    d.delete(f"peer/{me}/gone", T0)
    d.set(f"stage/2/{me}", 1, T0)
    d.set(f"peer/{me}/last_seen", 5, T0 + 9_000)
    d.merge(doc(2).set(f"peer/{SIGNERS[2].peer_id}/a", 1, T0), T0)
    assert [e.key for e in d.stale_own(T0 + 10_000, 5_000)] == [f"peer/{me}/ckpt/c1",
                                                                 f"stage/2/{me}"]
    delta = d.refresh(T0 + 10_000, 5_000)
    assert delta is not None and d.entry(f"peer/{me}/ckpt/c1").hlc.wall_ms == T0 + 10_000
    assert d.get(f"peer/{me}/ckpt/c1") == {"hash": "c1"}
    other = doc(3)
    assert other.merge(delta, T0 + 10_000).applied == [f"peer/{me}/ckpt/c1", f"stage/2/{me}"]
    assert d.refresh(T0 + 10_000, 5_000) is None


def test_caught_up_says_whether_an_answer_brought_everything():
    big = doc(1)
    for i in range(40):
        big.merge(doc(2).set(f"peer/{SIGNERS[2].peer_id}/k{i}", "x" * 200, T0), T0)
    joiner = doc(3)
    joiner.set(f"peer/{SIGNERS[3].peer_id}/addrs", ["/a"], T0)  # ours, which big lacks
    reply = big.delta_since(joiner.summary())
    joiner.merge(reply, T0)
    assert joiner.caught_up(big.summary())
    # a capped answer (one bucket at a time) leaves the other buckets unequal
    small = doc(4, max_delta_bytes=2_000)
    for e in big.entries():
        small.merge(big.encode_delta([e]), T0)
    late = doc(5)
    late.merge(small.delta_since(late.summary()), T0)
    assert not late.caught_up(small.summary())


def fresh_sync(d: RunDocument, *, horizon_s: float = 3600.0) -> RunDocSync:
    s = RunDocSync(gc_horizon_s=horizon_s)
    s.doc, s.live_peers = d, list  # what run() sets
    return s


def test_a_fresh_replica_compacts_only_after_catching_up_and_then_keeps_old_entries():
    """On the old code the first compaction (2 s after the start, before any sync) raised
    a joiner's floor to now - horizon, and the run's older entries (an admin's stage plan,
    a live peer's checkpoint announced hours ago) were refused for good."""
    now = T0 + 10 * 3600_000
    swarm = doc(1)
    writer = doc(2)
    old_ckpt = f"peer/{SIGNERS[2].peer_id}/ckpt/c9"
    swarm.merge(writer.set(old_ckpt, {"hash": "c9", "step": 5}, T0), T0)  # hours ago
    swarm.merge(writer.set(f"peer/{SIGNERS[2].peer_id}/last_seen", 1, now), now)
    swarm.merge(doc(0).set("stage/1", [1, 2], T0), T0)  # the admins' plan, hours ago

    joiner = doc(3)
    s = fresh_sync(joiner)
    assert not s.may_compact() and s.compact(now) == 0 and joiner.floor_ms == 0
    reply = swarm.delta_since(joiner.summary())
    joiner.merge(reply, now)
    assert joiner.caught_up(swarm.summary())
    s.caught_up.set()  # what _sync_with does on that answer
    assert s.may_compact()
    s.compact(now)
    assert joiner.floor_ms == now - s.horizon_ms()
    assert joiner.get(old_ckpt) == {"hash": "c9", "step": 5} and joiner.get("stage/1") == [1, 2]
    assert joiner.digest() == swarm.digest()


def test_the_horizon_never_falls_under_ten_announce_intervals():
    s = fresh_sync(doc(1), horizon_s=60.0)
    assert s.horizon_ms() == 60_000
    s.live_peers = lambda: [f"p{i}" for i in range(9_999)]  # 10,000: announces every 1,000 s
    assert s.announce_interval_s() == 1_000.0 and s.horizon_ms() == 10_000_000


def test_a_replica_with_a_floor_already_or_alone_long_enough_compacts():
    d = doc(1)
    d.gc(T0, 1_000)
    assert fresh_sync(d).may_compact()
    alone = fresh_sync(doc(2), horizon_s=40.0)
    assert not alone.may_compact(alone.started + 9.0)
    assert alone.may_compact(alone.started + 10.0)
