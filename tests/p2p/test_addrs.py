"""The address policy (p2p/addrs.py): what a node advertises and what it dials. A node
listening on 0.0.0.0 advertised `/ip4/0.0.0.0/tcp/P` (identify, peer records, status,
tickets) and dialed it when a peer advertised it; a DCUtR CONNECT could point its dials at
any port of its own machine."""

from __future__ import annotations

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from multiaddr import Multiaddr

from node.reach.punch import _advertisable, _dialable
from p2p.addrs import Network, expand
from p2p.host import DialError, Substrate

IFACES = ["127.0.0.1", "::1", "192.168.1.5", "fe80::1"]


def test_an_unspecified_address_is_expanded_and_never_advertised():
    assert expand(["/ip4/0.0.0.0/tcp/4001/p2p/X", "/ip4/203.0.113.7/tcp/4001"], IFACES) == [
        "/ip4/192.168.1.5/tcp/4001/p2p/X", "/ip4/203.0.113.7/tcp/4001"]
    # loopback (and link-local) only when there is nothing else: a one-machine node
    assert expand(["/ip4/0.0.0.0/tcp/1", "/ip6/::/tcp/1"], ["127.0.0.1", "::1"]) == [
        "/ip4/127.0.0.1/tcp/1", "/ip6/::1/tcp/1"]
    assert expand(["/ip4/0.0.0.0/tcp/1"], []) == []


@pytest.mark.parametrize(("listen", "addr", "why"), [
    (["/ip4/0.0.0.0/tcp/4001"], "/ip4/0.0.0.0/tcp/5", "unspecified"),
    (["/ip4/0.0.0.0/tcp/4001"], "/ip6/::/tcp/5", "unspecified"),
    (["/ip4/0.0.0.0/tcp/4001"], "/ip4/192.168.1.5/tcp/4001", "own listen"),  # us, expanded
    (["/ip4/0.0.0.0/tcp/4001"], "/ip4/127.0.0.1/tcp/4001", "own listen"),
    (["/ip4/192.168.1.5/tcp/4001"], "/ip4/127.0.0.1/tcp/9", "loopback"),
    (["/ip4/192.168.1.5/tcp/4001"], "/ip4/10.0.0.7/tcp/9", "private"),  # not our network
    (["/ip4/192.168.1.5/tcp/4001"], "/ip4/192.168.7.7/tcp/9", None),  # a LAN block we have
    (["/ip4/192.168.1.5/tcp/4001"], "/ip4/203.0.113.9/tcp/9", None),
    (["/ip4/127.0.0.1/tcp/4001"], "/ip4/127.0.0.1/tcp/9", None),  # a loopback testnet
    (["/ip4/198.18.3.2/tcp/4001"], "/ip4/198.19.2.2/tcp/9", None),  # the nat testnet's
    (["/ip4/198.18.3.2/tcp/4001"], "/dns4/example.org/tcp/9", None),
])
def test_what_may_be_dialed(listen, addr, why):
    net = Network.of(listen, interfaces=IFACES if "0.0.0.0" in listen[0] else [])
    reason = net.refuse(addr)
    assert (reason is None) if why is None else (why in (reason or "")), reason


def test_a_dcutr_connect_cannot_point_our_dials_at_our_machine():
    net = Network.of(["/ip4/0.0.0.0/tcp/4001"], interfaces=IFACES)
    raw = [Multiaddr(a).to_bytes() for a in (
        "/ip4/0.0.0.0/tcp/4002", "/ip4/127.0.0.1/tcp/22", "/ip4/192.168.1.5/tcp/4001",
        "/ip4/10.9.9.9/tcp/4001", "/ip4/203.0.113.9/tcp/4001", "/ip4/192.168.1.9/tcp/4001")]
    assert [str(a) for a in _dialable(raw, net)] == ["/ip4/203.0.113.9/tcp/4001",
                                                    "/ip4/192.168.1.9/tcp/4001"]
    # our own CONNECT never carries 0.0.0.0
    ours = _advertisable([Multiaddr("/ip4/0.0.0.0/tcp/4001").to_bytes()])
    assert ours and all("0.0.0.0" not in str(Multiaddr(b)) for b in ours)


async def test_a_node_on_0000_advertises_and_identifies_no_unspecified_address():
    a = Substrate(create_new_key_pair(), ["/ip4/0.0.0.0/tcp/0"])
    b = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    async with trio.open_nursery() as nursery:
        await nursery.start(a.serve)
        await nursery.start(b.serve)
        assert a.addrs() and not any("/0.0.0.0/" in x for x in a.addrs()), a.addrs()
        port = a.listen_ports()[0]
        # b dials a by one of its advertised addresses and learns a's addresses by identify
        await b.connect(next(x for x in a.addrs()), timeout=10)
        with trio.fail_after(20):
            while not [x for x in b.direct_addrs(a.peer_id) if f"/tcp/{port}" in x]:
                await trio.sleep(0.05)
        assert not any("/0.0.0.0/" in x for x in b.direct_addrs(a.peer_id))
        nursery.cancel_scope.cancel()


async def test_an_unspecified_address_is_never_dialed():
    a, b = (Substrate(create_new_key_pair(), ["/ip4/0.0.0.0/tcp/0"]) for _ in range(2))
    async with trio.open_nursery() as nursery:
        await nursery.start(a.serve)
        await nursery.start(b.serve)
        target = f"/ip4/0.0.0.0/tcp/{a.listen_ports()[0]}/p2p/{a.peer_id.to_base58()}"
        with pytest.raises(DialError, match="unspecified"):
            await b.connect(target, timeout=10)  # on Linux it reached this machine
        assert a.connected_peers() == [] and b.connected_peers() == []
        nursery.cancel_scope.cancel()


async def test_py_libp2ps_own_dials_follow_the_policy():
    """py-libp2p's dial_peer (new_stream or host.connect to a peer with no connection)
    dials whatever the peerstore holds, as identify and the DHT filled it from what peers
    said: a learned unspecified address, or a loopback one on a node not on loopback,
    reached this machine. Each is refused; an address the policy allows is still dialed."""
    from libp2p.peer.peerinfo import PeerInfo

    a = Substrate(create_new_key_pair(), ["/ip4/0.0.0.0/tcp/0"])
    b = Substrate(create_new_key_pair(), ["/ip4/0.0.0.0/tcp/0"])
    async with trio.open_nursery() as nursery:
        await nursery.start(a.serve)
        await nursery.start(b.serve)
        port = a.listen_ports()[0]
        store = b.host.get_peerstore()
        for bad in (f"/ip4/0.0.0.0/tcp/{port}", f"/ip4/127.0.0.1/tcp/{port}"):
            store.clear_addrs(a.peer_id)
            store.add_addrs(a.peer_id, [Multiaddr(bad)], 60)
            before = b.stats.dials_refused
            with pytest.raises(Exception), trio.fail_after(20):  # noqa: B017 py-libp2p's
                await b.host.connect(PeerInfo(a.peer_id, []))  # error types vary
            assert b.stats.dials_refused == before + 1, bad
            assert a.connected_peers() == [] and b.connected_peers() == [], bad
            # py-libp2p remembers a peer whose every address failed: forget it
            b.host.get_network()._negative_peer_cache.clear()
        # an address of this machine's interface, as a peer on our LAN would advertise
        good = next(x for x in a.addrs() if "/127." not in x).split("/p2p/")[0]
        store.clear_addrs(a.peer_id)
        store.add_addrs(a.peer_id, [Multiaddr(good)], 60)
        with trio.fail_after(20):
            await b.host.connect(PeerInfo(a.peer_id, []))
        assert b.connected_peers() == [a.peer_id]
        nursery.cancel_scope.cancel()
