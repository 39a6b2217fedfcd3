"""Circuit relay v2 between real hosts on loopback: a reservation, a relayed dial and a
stream over it, and a relay that refuses beyond each of its limits (reservations, circuits,
bytes, duration) with a log line naming the limit; renewal, the fallback to a relayed
address in a peer record, the direct dial that replaces a relayed path, garbage on the hop
protocol and bogus relayed addresses. The NAT case (two symmetric-NAT nodes that reach each
other only through a public node) is in tests/swarm/test_nat.py."""

from __future__ import annotations

import logging

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg
from multiaddr import Multiaddr

from node.reach.relay import RelayLimits
from node.reach.relays import RelayService
from p2p import circuit
from p2p.host import DialError, Substrate
from tests.conftest import await_until, node_context

ECHO = "/peertrain-test/echo/1"


async def _echo(stream) -> None:
    try:
        while data := await stream.read(65536):
            await stream.write(data)
    except Exception:  # EOF, or the relay closed the circuit
        return


async def _send(sub: Substrate, peer, payload: bytes) -> bytes:
    """Write `payload` on a new echo stream and read it back; b"" on a broken stream."""
    stream = await sub.open_stream(peer, ECHO)
    got = b""
    try:
        for i in range(0, len(payload), 16384):
            await stream.write(payload[i:i + 16384])
            while len(got) < i + len(payload[i:i + 16384]):
                data = await stream.read(65536)
                if not data:
                    return got
                got += data
    except Exception:
        return got
    return got


def _node(verdict: str, limits: RelayLimits | None = None):
    sub = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    # on loopback every node is dialable: a private node would dial its relayed peers
    # directly at once; that is tested on its own, below
    svc = RelayService(lambda: verdict, limits=limits, want=1, tick_s=0.2, retry_s=600,
                       direct=False)
    return sub, svc


@pytest.fixture
def relay_logs(caplog):
    caplog.set_level(logging.INFO, logger="node.relay")
    return caplog


async def test_reserve_dial_through_and_every_limit_refused_with_a_reason(relay_logs):
    limits = RelayLimits(reservations=1, circuits=1, circuit_bytes=200_000, duration_s=3600)
    (r, rs), (a, as_), (b, _), (c, cs) = (
        _node("public", limits), _node("private"), _node("private"), _node("private"))
    async with trio.open_nursery() as nursery:
        for sub, svc in ((r, rs), (a, as_), (b, None), (c, cs)):
            await nursery.start(sub.serve)
            if svc is not None:
                await nursery.start(svc.run, node_context(substrate=sub))
        a.set_handler(ECHO, _echo)
        await a.connect(r.addrs()[0])

        # A (private) finds the public relay among its peers, reserves, advertises it. C
        # meets the relay only then: connected together, C took the one slot first in a
        # loaded fresh-clone run.
        rid = r.peer_id.to_base58()
        await await_until(lambda: rid in as_.held, 30, "A's reservation")
        await c.connect(r.addrs()[0])
        relayed = [x for x in a.addrs() if "/p2p-circuit" in x]
        assert relayed and relayed[0].endswith(f"/p2p/{rid}/p2p-circuit/p2p/{a.peer_id}")
        assert rs.statistics()["serving"]["reservations"].keys() == {a.peer_id.to_base58()}

        # C's reservation is one too many: refused, with the limit in the relay's log.
        await await_until(lambda: cs.last_error, 30, "C's refused reservation")
        assert "RESOURCE_LIMIT_EXCEEDED" in cs.last_error and not cs.held
        assert (f"relay: refused a reservation from {c.peer_id}: 1 of 1 reservations in use "
                "(limit reservations=1)") in relay_logs.text

        # a peer without a reservation cannot be reached through the relay
        with pytest.raises(DialError, match="NO_RESERVATION"):
            await a.connect(f"{r.addrs()[0]}/p2p-circuit/p2p/{c.peer_id}", timeout=30)

        # B dials A at its relayed address only: a relayed connection, and a stream over it.
        assert await b.connect(relayed[0], timeout=30) == a.peer_id
        assert b.peer_paths()[a.peer_id.to_base58()] == f"relayed via {rid}"
        await await_until(lambda: a.peer_paths().get(b.peer_id.to_base58()), 30, "A sees B")
        assert a.peer_paths()[b.peer_id.to_base58()] == f"relayed via {rid}"
        assert await _send(b, a.peer_id, b"x" * 1000) == b"x" * 1000

        # A second circuit while one is open: refused (circuits=1), a reason for C and the log.
        with pytest.raises(DialError, match="RESOURCE_LIMIT_EXCEEDED"):
            await c.connect(relayed[0], timeout=30)
        assert "(limit circuits=1)" in relay_logs.text

        # Past the byte limit the relay closes the circuit and says so.
        got = await _send(b, a.peer_id, b"y" * 400_000)
        assert len(got) < 400_000
        await await_until(lambda: "circuit_bytes" in relay_logs.text, 30, "the byte-limit line")
        assert f"relay: closed the circuit {b.peer_id} -> {a.peer_id}" in relay_logs.text
        assert "byte limit 200000 reached (circuit_bytes)" in relay_logs.text
        serving = rs.statistics()["serving"]
        assert serving["closed_by_limit"] == {"circuit_bytes": 1}
        assert serving["refused"]["reservations"] >= 1 and serving["refused"]["circuits"] == 1
        for sub in (r, a, b, c):
            assert sub.handler_errors == 0
        nursery.cancel_scope.cancel()


async def test_a_silent_circuit_is_closed_at_its_duration_and_a_private_node_never_relays(
    relay_logs,
):
    (r, rs), (a, as_), (b, _) = (_node("public", RelayLimits(duration_s=2)),
                                 _node("private"), _node("private"))
    (p, ps) = _node("private")
    async with trio.open_nursery() as nursery:
        for sub, svc in ((r, rs), (a, as_), (b, None), (p, ps)):
            await nursery.start(sub.serve)
            if svc is not None:
                await nursery.start(svc.run, node_context(substrate=sub))
        await a.connect(r.addrs()[0])
        rid = r.peer_id.to_base58()
        await await_until(lambda: rid in as_.held, 30, "A's reservation")
        relayed = next(x for x in a.addrs() if "/p2p-circuit" in x)
        await b.connect(relayed, timeout=30)
        # nothing is sent: the circuit is closed anyway when its 2 s are up
        await await_until(lambda: "duration limit 2 s reached" in relay_logs.text, 30,
                          "the duration-limit line")
        await await_until(lambda: a.peer_id.to_base58() not in b.peer_paths(), 30,
                          "B's relayed connection to close")

        # A private node refuses to relay, with the reason the client sees.
        await b.connect(p.addrs()[0])
        with pytest.raises(circuit.CircuitError, match="PERMISSION_DENIED"):
            await circuit.reserve(b.host, p.peer_id)
        assert ps.statistics()["serving"] is None
        nursery.cancel_scope.cancel()


async def test_renewal_fallback_dial_and_garbage_or_bogus_addresses(relay_logs):
    (r, rs), (a, as_), (d, _) = (_node("public", RelayLimits(reservation_ttl_s=4)),
                                 _node("private"), _node("private"))
    async with trio.open_nursery() as nursery:
        for sub, svc in ((r, rs), (a, as_), (d, None)):
            await nursery.start(sub.serve)
            if svc is not None:
                await nursery.start(svc.run, node_context(substrate=sub))
        a.set_handler(ECHO, _echo)
        await a.connect(r.addrs()[0])
        rid = r.peer_id.to_base58()
        await await_until(lambda: rid in as_.held, 30, "A's reservation")
        # a 4 s reservation is renewed at half its life, and kept
        await await_until(lambda: as_.renewals >= 2, 30, "two renewals")
        assert rid in as_.held and as_.last_error is None
        relayed = next(x for x in a.addrs() if "/p2p-circuit" in x)

        # D knows A only by its relayed address (a peer record): open_stream dials it,
        # connecting to the relay on the way (py-libp2p's dialer would skip the address).
        d.host.get_peerstore().add_addrs(a.peer_id, [Multiaddr(relayed)], 600)
        assert await _send(d, a.peer_id, b"z" * 100) == b"z" * 100
        assert d.peer_paths()[a.peer_id.to_base58()] == f"relayed via {rid}"

        # A (private) dials directly a peer that reached it through a relay
        as_.direct = True
        # (the path turns direct inside the dial, before the service counts it: wait for both)
        await await_until(lambda: as_.statistics()["direct_after_relay"] == 1, 30,
                          "A to reach D directly")
        assert a.peer_paths().get(d.peer_id.to_base58()) == "direct"

        # garbage on the hop protocol: a reason back, the relay's host unharmed
        stream = await d.open_stream(r.peer_id, circuit.HOP_PROTOCOL)
        await stream.write(b"\xff" * 64)
        reply = await read_delimited_msg(stream, HopMessage)
        assert reply.status == StatusCode.MALFORMED_MESSAGE
        # ... and the sender scored for it by the gate (one stream ended, not the host)
        await await_until(lambda: r.gate.misbehaviour["invalid"] == 1, 10, "the score")
        assert r.handler_errors == 1 and rs.statistics()["serving"]["refused"]["malformed"] == 1
        # bogus relayed addresses are refused with a reason, without a dial
        for bogus, why in ((f"/ip4/127.0.0.1/tcp/1/p2p-circuit/p2p/{a.peer_id}",
                            "not a relayed address"),
                           (f"{r.addrs()[0]}/p2p-circuit/p2p/notapeer",
                            "bad relayed address.*Invalid CID")):
            with pytest.raises(DialError, match=why):
                await d.connect(bogus, timeout=10)
        nursery.cancel_scope.cancel()


async def test_reservations_from_one_ip_are_capped():
    """50 identities on one host took all 16 slots of a relay: a relay now gives one IP
    `reservations_per_ip` of them, and says why to the rest."""
    (r, rs) = _node("public", RelayLimits(reservations=16, reservations_per_ip=2))
    clients = [Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(4)]
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        await nursery.start(rs.run, node_context(substrate=r))
        outcomes = []
        for c in clients:
            await nursery.start(c.serve)
            await c.connect(r.addrs()[0])
            try:
                await circuit.reserve(c.host, r.peer_id)
                outcomes.append("reserved")
            except circuit.CircuitError as e:
                outcomes.append(str(e))
        assert outcomes[:2] == ["reserved", "reserved"]
        assert all("RESOURCE_LIMIT_EXCEEDED" in o for o in outcomes[2:]), outcomes
        assert rs.statistics()["serving"]["refused"]["reservations_per_ip"] == 2
        # a holder renews its own slot: the cap counts the others on its IP
        await circuit.reserve(clients[0].host, r.peer_id)
        nursery.cancel_scope.cancel()


async def test_garbage_on_the_stop_protocol_is_scored_banned_and_its_log_bounded(caplog):
    """py-libp2p's stop handler caught every error and logged one ERROR line each, never
    scored: 200 garbage streams gave 211 lines. Now the gate scores each (invalid), bans
    the sender, and the log filter's per-peer limits apply (records carry the peer)."""
    caplog.set_level(logging.INFO)
    (n, ns) = _node("private")
    attacker = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    async with trio.open_nursery() as nursery:
        await nursery.start(n.serve)
        await nursery.start(ns.run, node_context(substrate=n))
        await nursery.start(attacker.serve)
        peer = await attacker.connect(n.addrs()[0])
        bad = attacker.peer_id.to_base58()
        sent = 0
        for _ in range(200):
            if n.gate.banned(bad):
                break
            try:
                with trio.fail_after(10):
                    stream = await attacker.open_stream(peer, circuit.STOP_PROTOCOL)
                    await stream.write(b"\x05junk!" * 8)
                    await stream.read(1024)  # the refusal, or the reset
            except Exception:
                pass
            sent += 1
        await await_until(lambda: n.gate.banned(bad), 30, "the ban")
        assert sent <= 10, sent  # 20 points per garbage stream: banned at its fifth
        assert n.gate.misbehaviour["invalid"] >= 5
        stop_errors = [r for r in caplog.records if r.levelno >= logging.ERROR
                       and r.name.startswith("libp2p.relay")]
        assert not stop_errors, [r.getMessage() for r in stop_errors]
        # (the ban's disconnect makes each side's muxer log a line or two)
        assert sum(r.levelno >= logging.ERROR for r in caplog.records) <= 6
        about = [r for r in caplog.records if bad in r.getMessage()
                 and r.name.startswith(("p2p", "node"))]  # ours, not py-libp2p's muxer
        assert all(getattr(r, "peer", None) for r in about)  # the flood filter can see them
        assert len(about) <= 2 * sent + 2
        nursery.cancel_scope.cancel()
