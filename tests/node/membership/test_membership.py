"""The membership view takes each peer's heartbeats in order (node/membership/view.py): a
heartbeat that gossip delivers late, older than one already taken, changes nothing, so a
killed peer does not come back to life and an old step does not replace a newer one."""

from __future__ import annotations

import msgpack
import pytest

from node.membership.view import Membership
from protocols import heartbeat as hb
from protocols.errors import RemoteProtocolError


def beat(seq: int, epoch: int = 1000, step: int = 0, peer: str = "peerA",
         t: float | None = None) -> hb.Heartbeat:
    stats = {"step": step} if t is None else {"step": step, "t": t}
    return hb.Heartbeat(peer, seq, ("/ip4/127.0.0.1/tcp/1",), stats=stats, epoch=epoch)


def test_a_late_heartbeat_neither_revives_a_silent_peer_nor_rolls_its_step_back():
    view = Membership("me", ttl_s=5.0)
    assert view.heard(beat(1, step=10), now=100.0)
    assert not view.heard(beat(2, step=20), now=101.0)
    assert view.book.get("peerA").info["stats"]["step"] == 20
    view.heard(beat(1, step=10), now=120.0)  # seq 1 again, 19 s late
    assert view.stale_heartbeats == 1
    entry = view.book.get("peerA")
    assert entry.info["stats"]["step"] == 20 and entry.last_seen == 101.0
    assert view.live(now=120.0) == []  # still gone: silent since 101


def test_a_restarted_peer_is_taken_from_its_first_heartbeat():
    view = Membership("me", ttl_s=5.0)
    view.heard(beat(500, epoch=1000, step=900), now=100.0)
    # The same identity, a new process: seq starts again at 1, its epoch is later.
    view.heard(beat(1, epoch=2000, step=0), now=102.0)
    assert view.stale_heartbeats == 0
    assert view.book.get("peerA").info["stats"]["step"] == 0
    view.heard(beat(501, epoch=1000, step=901), now=103.0)  # the old process, late
    assert view.stale_heartbeats == 1 and view.book.get("peerA").info["stats"]["step"] == 0


def test_the_epoch_round_trips_and_is_checked():
    b = beat(3, epoch=1_764_000_000_000)
    assert hb.decode(b.encode(), "peerA") == b
    assert hb.decode(beat(3, epoch=0).encode(), "peerA").epoch == 0
    doc = msgpack.unpackb(b.encode())
    for bad in (-1, "soon", True, 2**64 - 1):
        with pytest.raises(RemoteProtocolError, match="epoch"):
            hb.decode(msgpack.packb({**doc, "epoch": bad}), "peerA")
    del doc["epoch"]  # a sender from before epochs: ordered by seq alone
    assert hb.decode(msgpack.packb(doc), "peerA").epoch == 0


def test_heartbeat_ages_are_judged_by_the_swarms_clock_not_only_ours():
    """A heartbeat's `t` is its sender's wall clock. Where our own clock is 300 s off
    (no NTP), every fresh heartbeat looks 300 s old by it: the median offset over the
    live peers and ourselves corrects that. A peer whose clock alone is off, or a stale
    heartbeat that gossip re-delivered, still looks old."""
    wall = 1_000_000.0
    view = Membership("me", ttl_s=5.0)
    assert view.clock_offset() is None
    # Our clock runs 300 s ahead of the swarm's; peers B, C, D beat now (swarm time).
    for p in ("B", "C", "D"):
        view.heard(beat(1, peer=p, t=wall - 300), now=100.0, wall=wall)
    view.heard(beat(1, peer="E", t=wall - 300 - 120), now=100.0, wall=wall)  # 2 min stale
    assert view.clock_offset(now=100.5) == pytest.approx(300)
    ages = {e.peer_id: view.age(e, now_wall=wall + 1, now=100.5) for e in view.live(now=100.5)}
    assert ages["B"] == pytest.approx(1) and ages["E"] == pytest.approx(121)

    for bad in (float("nan"), float("inf")):  # a hostile clock is left out, not a median
        view.heard(beat(2, peer="F", t=bad), now=100.6, wall=wall)
        assert view.clock_offset(now=100.6) == pytest.approx(300)
        view.book.get("F").info["order"] = (-1, -1)  # let the next beat in

    # Synchronized clocks: one stale heartbeat, the only one a fresh joiner has heard,
    # does not pass for the swarm's clock (our own vote is in the median).
    view = Membership("me", ttl_s=5.0)
    view.heard(beat(1, peer="dead", t=wall - 120), now=100.0, wall=wall)
    assert view.age(view.live(now=100.0)[0], now_wall=wall, now=100.0) == pytest.approx(60)


def test_documented_members_and_their_addresses_come_from_one_pass_over_the_document():
    """One pass over the run document, not one scan per member (5.3 s at 1,000 members,
    every redial tick): the same answer as before."""
    from node.membership.view import now_ms
    from protocols.keys import Signer
    from protocols.rundoc import RunDocument

    me, a, b = (Signer(bytes([i]) * 32) for i in (1, 2, 3))
    doc = RunDocument("run", me, [])
    t = now_ms()
    for s, addrs in ((a, ["/ip4/10.0.0.2/tcp/1"]), (b, 42)):
        d = RunDocument("run", s, [])
        doc.merge(d.set(f"peer/{s.peer_id}/addrs", addrs, t), t)
        doc.merge(d.set(f"peer/{s.peer_id}/ckpt/Qmc", {"hash": "Qmc"}, t), t)
        doc.merge(d.set(f"peer/{s.peer_id}/last_seen", t, t), t)
    view = Membership(me.peer_id, ttl_s=5.0)
    view.attach(doc)
    got = view.documented(60.0)
    assert set(got) == {a.peer_id, b.peer_id}
    assert got[a.peer_id]["addrs"] == ["/ip4/10.0.0.2/tcp/1"] and "ckpt" not in got[a.peer_id]
    assert got[a.peer_id]["last_seen_ms"] >= t - 1 and got[a.peer_id]["last_seen"] == t
    assert view.addresses() == {a.peer_id: ["/ip4/10.0.0.2/tcp/1"]}  # b's addrs are not a list
    view.announce_interval_s = 100.0
    assert view.members_ttl_s() == 400.0


def test_a_peer_announces_two_entries_and_retires_its_older_ones():
    """Since issue 30 a peer's addrs, role, device and stats are one `info` entry (2 a
    peer with last_seen, not 5: 10,000 peers with churn stay under the document's cap);
    readers take both shapes, and a node deletes its own older per-field keys."""
    from node.membership.view import now_ms
    from node.run.rundoc_sync import MAX_INFO_ADDRS, own_announce, retire_legacy
    from protocols.keys import Signer
    from protocols.rundoc import RunDocument

    me, new, old = (Signer(bytes([i]) * 32) for i in (4, 5, 6))
    doc = RunDocument("run", me, [])
    t = now_ms()
    n = RunDocument("run", new, [])
    own = own_announce(new.peer_id, {"addrs": [f"/ip4/10.0.0.{i}/tcp/1" for i in range(40)],
                                     "role": "node", "device": "cpu", "stats": {"step": 3}}, t)
    assert sorted(own) == [f"peer/{new.peer_id}/info", f"peer/{new.peer_id}/last_seen"]
    assert len(own[f"peer/{new.peer_id}/info"]["addrs"]) == MAX_INFO_ADDRS
    for key, value in own.items():
        doc.merge(n.set(key, value, t), t)
    o = RunDocument("run", old, [])
    for name, value in (("addrs", ["/ip4/10.0.1.1/tcp/1"]), ("role", "node"), ("last_seen", t)):
        doc.merge(o.set(f"peer/{old.peer_id}/{name}", value, t), t)
    view = Membership(me.peer_id, ttl_s=5.0)
    view.attach(doc)
    got = view.documented(60.0)
    assert got[new.peer_id]["role"] == "node" and got[new.peer_id]["stats"] == {"step": 3}
    assert got[old.peer_id]["role"] == "node"
    assert view.addresses()[new.peer_id][0] == "/ip4/10.0.0.0/tcp/1"
    assert view.addresses()[old.peer_id] == ["/ip4/10.0.1.1/tcp/1"]
    # one partner's addresses, as the averager's on-demand dial asks for them
    assert view.addresses_of(new.peer_id) == view.addresses()[new.peer_id]
    assert view.addresses_of(old.peer_id) == ["/ip4/10.0.1.1/tcp/1"]
    assert view.addresses_of("nobody") == []
    # the older node upgrades: its per-field keys become tombstones, gossiped as one delta
    delta = retire_legacy(o, old.peer_id, t + 1)
    assert delta is not None and retire_legacy(o, old.peer_id, t + 2) is None
    doc.merge(delta, t + 1)
    assert doc.get(f"peer/{old.peer_id}/addrs") is None
    assert doc.get(f"peer/{old.peer_id}/last_seen") == t
