"""The membership view takes each peer's heartbeats in order (node/membership/view.py): a
heartbeat that gossip delivers late, older than one already taken, changes nothing, so a
killed peer does not come back to life and an old step does not replace a newer one."""

from __future__ import annotations

import msgpack
import pytest

from node.membership.view import Membership
from protocols import heartbeat as hb
from protocols.errors import RemoteProtocolError


def beat(seq: int, epoch: int = 1000, step: int = 0) -> hb.Heartbeat:
    return hb.Heartbeat("peerA", seq, ("/ip4/127.0.0.1/tcp/1",), stats={"step": step},
                        epoch=epoch)


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
