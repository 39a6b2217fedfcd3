"""Heartbeat rate that falls as the run grows (issue 30): the interval policy, the liveness
ttl that follows the announced interval, the receiving side's bound (protocols/heartbeat.py),
and the heartbeat service's use of them (node/membership/heartbeats.py)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.membership.heartbeats import HeartbeatService, RateMeter
from node.membership.view import Membership
from protocols import heartbeat as hb


@given(n=st.integers(1, 200_000), base=st.floats(0.1, 10), target=st.floats(1, 1000))
def test_every_node_following_the_interval_receives_at_most_the_target(n, base, target):
    interval = hb.heartbeat_interval_s(n, base, target)
    assert interval >= base
    # N peers each beating once per interval: the inbound rate of any one node
    assert n / interval <= max(target, n / base) * (1 + 1e-9)
    if n / target > base:
        assert n / interval == pytest.approx(target)


def test_the_interval_grows_with_the_view_and_rejects_nonsense():
    assert hb.heartbeat_interval_s(4, 1.0, 50) == 1.0  # small runs: as before
    assert hb.heartbeat_interval_s(10_000, 1.0, 50) == 200.0
    assert hb.heartbeat_interval_s(0, 1.0, 50) == 1.0
    with pytest.raises(ValueError):
        hb.heartbeat_interval_s(10, 0.0, 50)
    with pytest.raises(ValueError):
        hb.heartbeat_interval_s(10, 1.0, 0)


def test_the_ttl_follows_the_announced_interval_and_never_drops_below_the_base():
    assert hb.liveness_ttl_s(0.0, 5.0) == 5.0  # an older sender announces nothing
    assert hb.liveness_ttl_s(1.0, 5.0) == 5.0
    assert hb.liveness_ttl_s(200.0, 5.0) == 800.0
    # a peer announcing a short interval that our limiter throttles to our own pace
    assert hb.liveness_ttl_s(1.0, 5.0, own_interval_s=200.0) == 400.0
    assert hb.liveness_ttl_s(float("nan"), 5.0) == 5.0


def test_the_interval_travels_and_older_peers_are_still_understood():
    beat = hb.Heartbeat("peerA", 3, ("/ip4/1.2.3.4/tcp/1",), epoch=7, interval_ms=200_000)
    assert hb.decode(beat.encode(), "peerA").interval_ms == 200_000
    # an older sender: no "iv" at all -> 0 (the receiver's own ttl applies)
    old = msgpack.packb({"v": 1, "peer": "peerA", "seq": 1, "addrs": [], "role": "node",
                         "device": "cpu", "stats": {}, "epoch": 7})
    assert hb.decode(old, "peerA").interval_ms == 0
    # an older receiver: the new field is one more map key, which it never reads
    doc = msgpack.unpackb(beat.encode())
    assert doc["v"] == hb.VERSION and doc["iv"] == 200_000
    assert "iv" not in msgpack.unpackb(hb.Heartbeat("p", 1).encode())  # unsaid: bytes as before
    for bad in (-1, True, 1.5, hb.MAX_INTERVAL_MS + 1):
        data = msgpack.packb({"v": 1, "peer": "peerA", "seq": 1, "iv": bad})
        with pytest.raises(hb.RemoteProtocolError):
            hb.decode(data, "peerA")


def test_a_peer_announcing_a_long_interval_stays_live_for_it():
    view = Membership("me", ttl_s=5.0)
    slow = hb.Heartbeat("slow", 1, ("/ip4/1.2.3.4/tcp/1",), interval_ms=100_000)
    old = hb.Heartbeat("old", 1, ("/ip4/1.2.3.4/tcp/2",))
    view.heard(slow, now=1000.0)
    view.heard(old, now=1000.0)
    assert [e.peer_id for e in view.live(1004.0)] == ["old", "slow"]
    assert [e.peer_id for e in view.live(1010.0)] == ["slow"]  # old: past 5 s
    assert [e.peer_id for e in view.live(1399.0)] == ["slow"]  # 4 beats of 100 s
    assert view.live(1401.0) == []
    view.book.expire(1401.0)
    assert view.book.get("old") is None and view.book.get("slow") is not None
    view.book.expire(2000.0 + 4001.0)  # 10 x its ttl
    assert len(view.book) == 0


def test_a_peer_beating_faster_than_the_policy_has_the_excess_dropped_and_counted():
    lim = hb.InboundLimiter(1.0, 50.0)
    n = 10_000  # interval 200 s; a peer may send SLACK per 200 s after its burst
    t, took = 0.0, 0
    for _ in range(1000):  # one beat a second for 1,000 s: an old node, or a hostile one
        took += lim.admit("fast", t, n)
        t += 1.0
    allowed = hb.BURST + 1000 * hb.SLACK / 200
    assert took <= allowed and took >= allowed - 1
    assert lim.dropped == 1000 - took
    # a peer following the policy loses nothing
    polite = [lim.admit("polite", 200.0 * i, n) for i in range(50)]
    assert all(polite)


@settings(max_examples=50, deadline=None)
@given(peers=st.integers(1, 3000), n=st.integers(1, 20_000), seconds=st.integers(1, 30),
       per_peer_per_s=st.integers(1, 5))
def test_all_peers_together_never_pass_the_global_bound(peers, n, seconds, per_peer_per_s):
    """Whatever the senders do (new identities included), what is taken over t seconds
    is at most the global rate x (t + 1)."""
    lim = hb.InboundLimiter(1.0, 50.0)
    took = 0
    for step in range(seconds * per_peer_per_s):
        now = step / per_peer_per_s
        for p in range(min(peers, 400)):
            took += lim.admit(f"p{p}", now, n)
    bound = lim.global_rate(n) * (seconds + 1)
    assert took <= bound


def test_the_limiter_forgets_quiet_peers_past_its_cap():
    lim = hb.InboundLimiter(1.0, 50.0, max_peers=100)
    for i in range(100):
        lim.admit(f"p{i}", 0.0, 100)
    assert len(lim) == 100
    assert lim.admit("late", 1000.0, 100)  # the rest have refilled: forgotten, not refused
    assert len(lim) == 1


def test_the_rate_meter_counts_over_its_window():
    m = RateMeter(window_s=10)
    for i in range(100):
        m.add(1000.0 + i * 0.1)  # 10/s for 10 s
    assert m.rate(1009.9) == pytest.approx(10.0)
    assert m.rate(1015.0) == pytest.approx(4.0, abs=0.2)  # seconds 1006-1009 still in
    assert m.rate(1030.0) == 0.0


def test_the_service_announces_and_shows_the_interval_of_its_view_size():
    class Ctx:
        membership = Membership("me", ttl_s=5.0)

    svc = HeartbeatService(["run"], publish=True, interval_s=1.0, target_inbound_per_s=50.0)
    svc._ctx = Ctx()  # type: ignore[assignment]
    for i in range(999):
        Ctx.membership.heard(hb.Heartbeat(f"p{i:04}", 1), now=100.0)
    assert svc.view_size(100.5) == 1000
    assert svc.current_interval_s(100.5) == 20.0
    st = svc.statistics()
    assert {"heartbeat_interval_s", "inbound_heartbeats_per_s", "throttled_heartbeats",
            "inbound_heartbeat_bound_per_s"} <= set(st)


def test_the_interval_holds_while_heartbeats_are_late_and_relaxes_once_peers_left():
    """A load spike that delays every heartbeat past its ttl must not shorten the
    interval (more heartbeats, more load: the 31-node collapse of issue 30); peers that
    stay silent for 10 ttls are forgotten and the interval follows."""
    class Ctx:
        membership = Membership("me", ttl_s=5.0)

    svc = HeartbeatService(["run"], publish=True, interval_s=1.0, target_inbound_per_s=8.0)
    svc._ctx = Ctx()  # type: ignore[assignment]
    for i in range(30):
        Ctx.membership.heard(hb.Heartbeat(f"p{i:02}", 1, interval_ms=3875), now=100.0)
    assert svc.current_interval_s(100.0) == 31 / 8
    late = 100.0 + 4 * 3.875 + 1  # every peer past its liveness ttl: none live
    assert Ctx.membership.live(late) == []
    assert svc.current_interval_s(late) == 31 / 8
    gone = 100.0 + 10 * 4 * 3.875 + 1  # silent for 10 ttls: forgotten
    assert svc.current_interval_s(gone) == 1.0
