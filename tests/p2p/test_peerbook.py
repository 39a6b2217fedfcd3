"""The peer book's liveness bound (p2p/peerbook.py), with time passed in: a peer killed
without a goodbye leaves the live set exactly `ttl` after it was last heard. The churn test
with real processes (tests/swarm/test_testnet.py) checks that it leaves, this one checks when."""

from __future__ import annotations

from p2p.peerbook import PeerBook


def test_a_silent_peer_leaves_the_live_set_after_ttl_and_a_heard_one_stays():
    book = PeerBook(ttl=5.0)
    book.seen("a", 100.0, addrs=["/a"])
    book.seen("b", 100.0)
    for t in (101.0, 103.0, 105.0):
        book.seen("b", t)  # b keeps sending heartbeats; a was killed at 100
    assert [e.peer_id for e in book.live(105.0)] == ["a", "b"]
    assert [e.peer_id for e in book.live(105.01)] == ["b"]
    book.seen("a", 90.0)  # a late, older heartbeat does not bring a back
    assert [e.peer_id for e in book.live(106.0)] == ["b"]
    book.expire(151.0)  # forgotten after 10 x ttl of silence
    assert book.get("a") is None and book.get("b") is not None


def test_a_full_book_forgets_the_stalest_peer():
    book = PeerBook(ttl=5.0, max_peers=2)
    book.seen("a", 1.0)
    book.seen("b", 2.0)
    book.seen("c", 3.0)
    assert len(book) == 2 and book.get("a") is None
