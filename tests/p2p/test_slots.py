"""Inbound connection slots (p2p/slots.py) on real hosts over loopback.

py-libp2p's swarm holds an inbound slot from accept until the whole swarm stops, so a
node took `max_connections - min_connections` (250) inbound connections in its life and
then reset every new one. Here the cap is lowered to a few slots on the swarm's own
limiter (the same one py-libp2p takes and releases), which keeps the tests fast."""

from __future__ import annotations

import contextlib
import logging

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from multiaddr import Multiaddr

from p2p.host import DialError, Substrate
from tests.conftest import await_until

ECHO = "/peertrain-test/echo/1"


async def _echo(stream) -> None:
    try:
        while data := await stream.read(65536):
            await stream.write(data)
    except Exception:
        return


def _sub() -> Substrate:
    return Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])


async def _start(nursery, *subs: Substrate) -> None:
    for sub in subs:
        await nursery.start(sub.serve)


def _slots(node: Substrate, n: int) -> None:
    node.host.get_network()._inbound_limiter.total_tokens = n


def _in_use(node: Substrate) -> int:
    return node.slots.statistics()["in_use"]


async def _echo_once(sub: Substrate, peer) -> bytes:
    stream = await sub.open_stream(peer, ECHO)
    await stream.write(b"ping")
    got = await stream.read(4)
    await stream.close()
    return got


async def test_slots_come_back_when_connections_close_so_a_fresh_peer_still_connects():
    node, client, fresh = _sub(), _sub(), _sub()
    async with trio.open_nursery() as nursery:
        await _start(nursery, node, client, fresh)
        node.set_handler(ECHO, _echo)
        _slots(node, 4)
        addr = node.addrs()[0]
        # one identity connects and disconnects three times as often as there are slots
        for _ in range(12):
            await client.connect(addr, timeout=20)
            assert await _echo_once(client, node.peer_id) == b"ping"
            await client.host.disconnect(node.peer_id)
            await await_until(lambda: _in_use(node) == 0, 30, "the node to free the slot")
        # a peer that never connected before gets in at once
        assert await fresh.connect(addr, timeout=20) == node.peer_id
        assert await _echo_once(fresh, node.peer_id) == b"ping"
        stats = node.slots.statistics()
        assert stats["accepted"] == 13 and stats["refused"] == {}
        assert stats["slots"] == 4 and stats["in_use"] == 1
        nursery.cancel_scope.cancel()


async def test_a_refused_connection_is_counted_and_logged_and_its_slot_reused(caplog):
    caplog.set_level(logging.WARNING, logger="p2p.slots")
    node, a, b, late = _sub(), _sub(), _sub(), _sub()
    async with trio.open_nursery() as nursery:
        await _start(nursery, node, a, b, late)
        _slots(node, 2)
        addr = node.addrs()[0]
        await a.connect(addr, timeout=20)
        await b.connect(addr, timeout=20)
        await await_until(lambda: _in_use(node) == 2, 30, "both slots taken")
        with pytest.raises(DialError):  # closed before the handshake (each retry too)
            await late.connect(addr, timeout=20)
        await await_until(lambda: node.slots.statistics()["refused"].get("slots_full"), 30,
                          "the refusal to be counted")
        assert "refused inbound connections (" in caplog.text
        assert "all 2 inbound slots in use" in caplog.text
        assert late.peer_id not in node.connected_peers()
        # a connection that closes gives its slot to the next one
        await a.host.disconnect(node.peer_id)
        await await_until(lambda: _in_use(node) == 1, 30, "A's slot to come back")
        with trio.fail_after(30):
            while True:  # its last refused dial may still sit in the dialer's backoff
                try:
                    await late.connect(addr, timeout=20)
                    break
                except DialError:
                    await trio.sleep(0.2)
        assert late.peer_id in node.connected_peers()
        nursery.cancel_scope.cancel()


async def test_one_peer_holds_at_most_per_peer_connections():
    node, greedy, other = _sub(), _sub(), _sub()
    node.slots.per_peer = 2
    async with trio.open_nursery() as nursery:
        await _start(nursery, node, greedy, other)
        addr = Multiaddr(node.addrs()[0])
        swarm = greedy.host.get_network()
        for _ in range(4):  # new connections each time, not py-libp2p's reuse
            with contextlib.suppress(Exception):  # the node closed it as soon as it was up
                await swarm.dial_addr(addr, node.peer_id)
        await await_until(lambda: node.slots.statistics()["refused"].get("conns_per_peer") == 2,
                          30, "two refusals")
        await await_until(
            lambda: len(node.host.get_network().get_connections(greedy.peer_id)) == 2, 30,
            "the node to keep two of the greedy peer's connections")
        # the slots of the refused ones came back; others still get in
        await await_until(lambda: _in_use(node) == 2, 30, "refused slots freed")
        assert await other.connect(node.addrs()[0], timeout=20) == node.peer_id
        nursery.cancel_scope.cancel()
