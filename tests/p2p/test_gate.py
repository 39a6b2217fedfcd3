"""The gate (p2p/gate.py) between two real hosts on loopback, in this process: budgets
refuse before the handler runs, the DHT's stream has a deadline, a garbage sender is
banned, disconnected and refused."""

from __future__ import annotations

import contextlib

import pytest
import trio
import varint
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.pb.kademlia_pb2 import Message, Record
from libp2p.records.validator import Validator

import p2p.host
from p2p.budget import BudgetLimits
from p2p.dht import DHT_PROTOCOL
from p2p.gate import Gate
from p2p.host import DialError, Substrate
from tests.conftest import await_until

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class Garbage(Exception):
    """What the test's handler raises for bad bytes; classified as `invalid`."""


def _classify(e: BaseException) -> str | None:
    return "invalid" if isinstance(e, Garbage) else None


async def _open(sender: Substrate, peer, protocol: str):
    try:
        with trio.fail_after(10):
            return await sender.open_stream(peer, protocol)
    except Exception:
        return None  # refused: reset during or right after negotiation


async def test_streams_over_the_per_protocol_budget_never_reach_the_handler():
    node = Substrate(create_new_key_pair(), [LOOPBACK],
                     gate=Gate(BudgetLimits(streams_per_peer_protocol=4)))
    other = Substrate(create_new_key_pair(), [LOOPBACK])
    started = 0

    async def idle(stream) -> None:
        nonlocal started
        started += 1
        await trio.sleep_forever()

    node.set_handler("/test/idle/1", idle)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            await nursery.start(other.serve)
            peer = await other.connect(node.addrs()[0])
            for _ in range(10):
                await _open(other, peer, "/test/idle/1")
            await await_until(lambda: node.gate.budget.refused["streams_per_peer_protocol"] >= 6,
                              30, "6 refusals")
            assert started == 4
            # refused, not scored: honest peers reach a protocol's budget too
            assert node.gate.misbehaviour["over_budget"] == 0
            nursery.cancel_scope.cancel()


async def test_a_half_sent_dht_message_is_cut_at_the_deadline(monkeypatch):
    monkeypatch.setattr(p2p.host, "STREAM_DEADLINE_S", 1.0)
    node = Substrate(create_new_key_pair(), [LOOPBACK])
    other = Substrate(create_new_key_pair(), [LOOPBACK])
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            await nursery.start(other.serve)
            peer = await other.connect(node.addrs()[0])
            stream = await other.open_stream(peer, str(DHT_PROTOCOL))
            await stream.write(b"\x40half")  # announces 64 bytes, sends 4
            await await_until(lambda: node.gate.deadline_misses[str(DHT_PROTOCOL)] >= 1,
                              30, "the DHT stream's deadline")
            assert node.gate.misbehaviour["deadline"] == 1
            nursery.cancel_scope.cancel()


class _OkOnly(Validator):
    """A namespace whose only valid value is b"ok"."""

    def validate(self, key: str, value: bytes) -> None:
        if value != b"ok":
            raise ValueError("not ok")

    def select(self, key: str, values: list[bytes]) -> int:
        return 0


def _put(key: bytes, value: bytes, **record) -> bytes:
    msg = Message(type=Message.MessageType.PUT_VALUE, key=key,
                  record=Record(key=key, value=value, **record))
    data = msg.SerializeToString()
    return varint.encode(len(data)) + data


async def test_dht_junk_is_scored_on_its_sender():
    """KadDHT drops an oversized message, a record its validator refuses and a badly
    signed one, and logs it, but never told the gate: 500 oversized PUT_VALUEs and 20
    badly signed records cost their sender nothing. Now each is blamed on it (invalid)
    and it is banned; a valid record costs nothing."""
    node = Substrate(create_new_key_pair(), [LOOPBACK],
                     dht_protocol_validators={"t": _OkOnly()})
    other = Substrate(create_new_key_pair(), [LOOPBACK])
    hostile = other.peer_id.to_base58()
    junk = [_put(b"/t/a", b"x" * 20_000),  # refused by the validator
            _put(b"/t/a", b"ok", signature=b"s" * 64, author=b"a" * 38),  # bad signature
            _put(b"/nobody/a", b"ok"),  # a namespace nobody registered
            bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x7F]) + b"x" * 64]  # announces 32 GiB
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            await nursery.start(other.serve)
            peer = await other.connect(node.addrs()[0])
            stream = await other.open_stream(peer, str(DHT_PROTOCOL))
            await stream.write(_put(b"/t/a", b"ok"))  # valid: stored, nothing scored
            await stream.read(4096)
            assert node.gate.misbehaviour["invalid"] == 0
            sent = 0
            while node.gate.banned(hostile) is None and sent < 40:
                stream = await _open(other, peer, str(DHT_PROTOCOL))
                if stream is not None:
                    with trio.move_on_after(5), contextlib.suppress(Exception):
                        await stream.write(junk[sent % len(junk)])
                        await stream.read(4096)  # reset by KadDHT
                    sent += 1
            assert node.gate.banned(hostile) is not None and sent <= 6, sent
            assert node.dht is not None and node.dht.junk >= 3
            assert node.gate.statistics()["bans"][hostile]["reason"] == "invalid"
            nursery.cancel_scope.cancel()


async def test_a_garbage_sender_is_banned_disconnected_and_refused():
    node = Substrate(create_new_key_pair(), [LOOPBACK], gate=Gate(classify=_classify))
    other = Substrate(create_new_key_pair(), [LOOPBACK])

    async def strict(stream) -> None:
        raise Garbage(await stream.read(100))

    node.set_handler("/test/strict/1", strict)
    hostile = other.peer_id.to_base58()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            await nursery.start(other.serve)
            peer = await other.connect(node.addrs()[0])
            sent = 0
            while node.gate.banned(hostile) is None and sent < 50:
                stream = await _open(other, peer, "/test/strict/1")
                if stream is not None:
                    sent += 1
                    try:
                        await stream.write(b"junk")
                        await stream.read(10)
                    except Exception:
                        pass
            assert node.gate.banned(hostile) is not None and sent <= 8, sent
            await await_until(lambda: other.peer_id not in node.connected_peers(), 30,
                              "the banned peer to be disconnected")
            assert node.gate.statistics()["bans"][hostile]["reason"] == "invalid"
            # It may dial again; the node closes the connection and refuses its streams.
            try:
                await other.connect(node.addrs()[0])
                assert await _open(other, peer, "/test/strict/1") is None
            except DialError:
                pass
            await await_until(lambda: other.peer_id not in node.connected_peers(), 30,
                              "the redialed connection to be closed")
            with pytest.raises(DialError, match="banned"):  # and never dials it itself
                await node.connect(other.addrs()[0])
            nursery.cancel_scope.cancel()


async def test_garbage_on_gossipsub_ends_that_stream_not_the_host():
    """py-libp2p's gossipsub handler lets a protobuf DecodeError (or MessageTooLarge)
    escape; unguarded, 11 bytes took the whole host down and every connection with it
    (the supervisor restarted it; the node then redialed its peers)."""
    from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12

    node = Substrate(create_new_key_pair(), [LOOPBACK])
    other = Substrate(create_new_key_pair(), [LOOPBACK])
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            await nursery.start(other.serve)
            peer = await other.connect(node.addrs()[0])
            stream = await other.open_stream(peer, str(PROTOCOL_ID_V12))
            await stream.write(bytes([10]) + b"\xff" * 10)
            await await_until(lambda: node.gate.misbehaviour["invalid"] >= 1, 30,
                              "the node to score the garbage")
            assert node.stats.restarts == 0
            assert other.peer_id in node.connected_peers()
            nursery.cancel_scope.cancel()


async def test_bytes_of_streams_we_refused_are_dropped_not_held_against_the_sender():
    """py-libp2p's Yamux keeps a closed or reset stream's unread bytes for 60 s, and they
    count in the sender's bytes_per_peer. A handler that refuses without reading (history
    gossip at a node that does not run SybilWall) kept an honest sender over its budget,
    so its next streams were refused and it was banned (a CI run of the SybilWall swarm
    test). Streams closed through node.transport.streams.close_quietly drop what was not read."""
    from node.transport.streams import close_quietly

    node = Substrate(create_new_key_pair(), [LOOPBACK],
                     gate=Gate(BudgetLimits(bytes_per_peer=300_000)))
    other = Substrate(create_new_key_pair(), [LOOPBACK])
    refused = 0

    async def refuse_unread(stream) -> None:
        nonlocal refused
        await trio.sleep(0.2)  # the sender's bytes are in by now (one window)
        await close_quietly(stream)
        refused += 1

    node.set_handler("/test/refuse/1", refuse_unread)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            await nursery.start(other.serve)
            peer = await other.connect(node.addrs()[0])
            for i in range(5):  # 5 x 200 KB, past the 300 KB budget if they were kept
                stream = await _open(other, peer, "/test/refuse/1")
                assert stream is not None, f"stream {i} refused"
                with trio.move_on_after(5):
                    await stream.write(b"x" * 200_000)
                await await_until(lambda i=i: refused > i, 10, f"stream {i} refused unread")
            assert node.gate.budget.refused["bytes_per_peer"] == 0
            assert node.gate.misbehaviour["over_budget"] == 0
            nursery.cancel_scope.cancel()


async def test_a_host_that_stops_closes_its_connections_so_peers_stop_counting_them():
    """Three identities in turn from one address, each stopped after connecting (what a
    restarted host, or the reach benchmark's agents, do): the peer counts each connection
    against the address only while it is open. py-libp2p alone left the sockets open, and
    a relay refused that address after ~128 identities (conns_per_ip)."""
    relay = Substrate(create_new_key_pair(), [LOOPBACK])
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.serve)
        for _ in range(3):
            visitor = Substrate(create_new_key_pair(), [LOOPBACK])
            async with trio.open_nursery() as visit:
                await visit.start(visitor.serve)
                await visitor.connect(relay.addrs()[0])
                await await_until(lambda: relay.gate.budget.conns_by_ip, 10,
                                  "the relay to count the connection")
                visit.cancel_scope.cancel()
            await await_until(lambda: not relay.gate.budget.conns_by_ip, 10,
                              "the relay to release the stopped host's connection")
        nursery.cancel_scope.cancel()


async def test_relayed_connections_are_not_counted_on_the_relays_ip():
    """A private node's relayed connections arrive from the relay's IP: counted there, the
    peers a relay brings took the relay's own per-IP budget and, past it, the node closed
    their circuits. With a budget of 2 per IP, the relay link and three relayed peers."""
    from node.reach.relays import RelayService
    from tests.conftest import node_context
    from tests.node.reach.test_relay import ECHO, _echo, _send

    r = Substrate(create_new_key_pair(), [LOOPBACK])
    a = Substrate(create_new_key_pair(), [LOOPBACK],
                  gate=Gate(BudgetLimits(conns_per_ip=2, conns_per_subnet=100)))
    rs = RelayService(lambda: "public", want=1, tick_s=0.2, direct=False)
    as_ = RelayService(lambda: "private", want=1, tick_s=0.2, retry_s=600, direct=False)
    peers = [Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(3)]
    async with trio.open_nursery() as nursery:
        for sub in (r, a, *peers):
            await nursery.start(sub.serve)
        await nursery.start(rs.run, node_context(substrate=r))
        await nursery.start(as_.run, node_context(substrate=a))
        a.set_handler(ECHO, _echo)
        await a.connect(r.addrs()[0])
        await await_until(lambda: r.peer_id.to_base58() in as_.held, 30, "the reservation")
        relayed = next(x for x in a.addrs() if "/p2p-circuit" in x)
        for p in peers:
            await p.connect(relayed, timeout=30)
        for p in peers:
            assert await _send(p, a.peer_id, b"x" * 100) == b"x" * 100
            assert len(a.host.get_network().get_connections(p.peer_id)) == 1
        assert dict(a.gate.budget.conns_by_ip) == {"127.0.0.1": 1}  # the relay link only
        assert "conns_per_ip" not in a.gate.budget.refused
        nursery.cancel_scope.cancel()
