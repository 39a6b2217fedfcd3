"""Duplicate relayed connections between two peers (issue 26, item 6) on real hosts over
loopback: a peer that dials a node's relayed address while it already holds a relayed
connection to it, and two private nodes that dial each other's relayed addresses. The
node keeps its own connection to the relay (the same one), its reservation, and the
relay keeps bringing it circuits.

The issue saw the node close its connection to the relay within 0.5 s of such a dial,
behind NATs in namespaces; this in-process form did not reproduce it (it passes before
and after this branch): it guards the loopback case."""

from __future__ import annotations

import trio

from tests.conftest import await_until, node_context
from tests.node.reach.test_relay import ECHO, _echo, _node, _send


async def test_a_second_relayed_connection_keeps_the_relay_link_and_the_reservation():
    (r, rs), (a, as_), (b, bs), (c, _) = (_node("public"), _node("private"),
                                          _node("private"), _node("private"))
    async with trio.open_nursery() as nursery:
        for sub, svc in ((r, rs), (a, as_), (b, bs), (c, None)):
            await nursery.start(sub.serve)
            if svc is not None:
                await nursery.start(svc.run, node_context(substrate=sub))
        for sub in (a, b, c):
            sub.set_handler(ECHO, _echo)
        await a.connect(r.addrs()[0])
        await b.connect(r.addrs()[0])
        rid = r.peer_id.to_base58()
        await await_until(lambda: rid in as_.held and rid in bs.held, 30, "the reservations")
        (link,) = a.host.get_network().get_connections(r.peer_id)
        relayed_a = next(x for x in a.addrs() if "/p2p-circuit" in x)
        relayed_b = next(x for x in b.addrs() if "/p2p-circuit" in x)

        await b.connect(relayed_a, timeout=30)  # B -> A through R
        await b.connect(relayed_a, timeout=30)  # and again, while connected
        await a.connect(relayed_b, timeout=30)  # A -> B through R as well
        assert len(a.host.get_network().get_connections(b.peer_id)) == 3
        assert await _send(a, b.peer_id, b"x" * 100) == b"x" * 100
        assert await _send(b, a.peer_id, b"y" * 100) == b"y" * 100

        # the relay still brings A circuits: a peer it never met reaches it
        assert await c.connect(relayed_a, timeout=30) == a.peer_id
        assert await _send(c, a.peer_id, b"z" * 100) == b"z" * 100
        assert a.host.get_network().get_connections(r.peer_id) == [link]
        assert not link.is_closed and rid in as_.held and as_.last_error is None
        assert rs.statistics()["serving"]["reservations"].keys() >= {
            a.peer_id.to_base58(), b.peer_id.to_base58()}
        nursery.cancel_scope.cancel()
