"""Hole punching (node/reach/punch.py) and path kinds (node/reach/paths.py).

In-process: the punch schedule's backoff on trio's autojump clock (no waiting); a relayed
connection between two private nodes on loopback upgraded by the driving side only, then
labelled `punched` with an RTT; garbage and bad sessions on `/libp2p/dcutr` answered with a
log line and a counter while the host runs on. Through real NATs (namespaces, root): see
tests/swarm/test_nat_punch.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
from libp2p.relay.circuit_v2.utils import write_delimited_msg
from multiaddr import Multiaddr

from node.reach.paths import PathService, ping
from node.reach.punch import PROTOCOL_ID, Backoff, HolePunchService, PunchError, _dialable
from node.reach.relays import RelayService
from p2p.addrs import Network
from p2p.host import Substrate
from tests.conftest import await_until, node_context

# -- the schedule, on the autojump clock --------------------------------------------------


def _drive(backoff: Backoff, relayed, punch, until: float) -> HolePunchService:
    svc = HolePunchService(lambda: "private", backoff=backoff, tick_s=1.0)

    async def main() -> None:
        with trio.move_on_after(until):
            await svc.drive(relayed, punch)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return svc


def test_a_failing_punch_is_retried_with_doubling_waits_then_given_up():
    tries: list[float] = []

    async def punch(peer: str) -> None:
        tries.append(trio.current_time())
        await trio.sleep(5)  # a session that takes a while, then fails
        raise PunchError("no dial got through")

    svc = _drive(Backoff(first_s=30, max_s=100, attempts=4), lambda: {"B": True}, punch,
                 until=3600)
    # at once; then 30 s after the first failure (t=5), 60 after the second, 100 (capped)
    assert [round(t) for t in tries] == [0, 35, 100, 205]
    p = svc.schedule.peers["B"]
    assert p.state == "gave up" and p.failures == 4 and p.error == "no dial got through"
    assert svc.counts["attempts"] == 4 and svc.counts["failed"] == 4
    assert svc.statistics()["peers"]["B"]["state"] == "gave up"


def test_a_punch_that_succeeds_is_not_repeated_and_a_reconnect_starts_afresh():
    tries: list[float] = []
    connected = {"B": True}

    async def punch(peer: str) -> None:
        tries.append(trio.current_time())
        if len(tries) == 1:
            raise PunchError("first round lost")

    def relayed() -> dict[str, bool]:
        # B disconnects at t=100 and is relayed again from t=110 on
        now = trio.current_time()
        return {} if 100 <= now < 110 else dict(connected)

    svc = _drive(Backoff(first_s=20, attempts=3), relayed, punch, until=300)
    # failed at 0, retried at 20 and punched; B drops at 100: relayed again at 110, a
    # fresh budget: punched at once
    assert [round(t) for t in tries] == [0, 20, 110]
    assert svc.schedule.peers["B"].state == "punched"
    assert svc.schedule.peers["B"].attempts == 1


def test_the_side_that_does_not_drive_never_punches():
    tries: list[float] = []

    async def punch(peer: str) -> None:
        tries.append(trio.current_time())

    svc = _drive(Backoff(), lambda: {"A": False}, punch, until=600)
    assert tries == [] and svc.counts["attempts"] == 0


def test_only_tcp_addresses_are_dialed_and_no_more_than_eight():
    raw = [Multiaddr(f"/ip4/198.18.1.{i}/tcp/4001").to_bytes() for i in range(20)]
    raw += [b"\xff garbage", Multiaddr("/ip4/1.2.3.4/udp/1/quic-v1").to_bytes(),
            Multiaddr("/ip4/1.2.3.4/tcp/1/p2p-circuit").to_bytes()]
    got = _dialable(raw[-3:] + raw[:20], Network.of(["/ip4/198.18.9.2/tcp/4001"], []))
    assert [str(a) for a in got] == [f"/ip4/198.18.1.{i}/tcp/4001" for i in range(8)]


# -- real hosts on loopback --------------------------------------------------------------


def _ctx(sub: Substrate) -> SimpleNamespace:
    return node_context(substrate=sub)


def _refuse_dial_peer(sub: Substrate, peer) -> None:
    network = sub.host.get_network()
    dial_peer = network.dial_peer

    async def refusing(peer_id, *args, **kwargs):
        if peer_id == peer:
            raise ConnectionRefusedError("behind a NAT (emulated)")
        return await dial_peer(peer_id, *args, **kwargs)

    network.dial_peer = refusing


def _other_dials_first(punch: HolePunchService, driver: Substrate) -> None:
    """The driver's punch dials once the other side's dial is in. Through a NAT that drops
    unsolicited packets (tests/swarm/test_nat_punch.py) the first SYN dies at the NAT and the
    SYNs that cross make one connection. On loopback nothing drops it: the driver's dial
    (upgraded as the responder, as DCUtR's driver is) could reach the other side's
    listener, a responder too; the handshake failed, and the failed connection's TIME_WAIT
    held the same 4-tuple for 60 s, so every retry failed with EADDRNOTAVAIL (ci71 of
    2026-11-26). The driver's own dial then fails at once, and the punch counts the other
    side's connection (`_mark`), as it does when the peer's SYN gets in first."""
    dcutr = punch._protocol(driver)
    dial = dcutr._perform_hole_punch

    async def after_the_other(pid, addrs, as_responder=False):
        await await_until(lambda: HolePunchService._direct_conns(driver, pid), 20,
                          "the other side's punch dial")
        return await dial(pid, addrs, as_responder=as_responder)

    dcutr._perform_hole_punch = after_the_other


@pytest.fixture
def punch_logs(caplog):
    caplog.set_level(logging.INFO, logger="node.punch")
    return caplog


async def test_a_relayed_pair_is_punched_by_one_side_and_shown_as_punched(punch_logs):
    # r relays; a and b are private (they say so) and hold a reservation on r; a dials b
    # through r. The lower peer id drives; on loopback the punch's dials get through.
    r = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    a = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    b = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    relays = {r: RelayService(lambda: "public", want=1, tick_s=0.2, direct=False),
              a: RelayService(lambda: "private", want=1, tick_s=0.2, direct=False),
              b: RelayService(lambda: "private", want=1, tick_s=0.2, direct=False)}
    punches = {s: HolePunchService(lambda: "private", tick_s=0.2, close_relayed_after_s=0.5,
                                   backoff=Backoff(first_s=0.5, max_s=0.5, attempts=6))
               for s in (a, b)}
    paths = {s: PathService([punches[s].label], every_s=0.2) for s in (a, b)}
    async with trio.open_nursery() as nursery:
        for sub in (r, a, b):
            await nursery.start(sub.serve)
            for svc in (relays.get(sub), punches.get(sub), paths.get(sub)):
                if svc is not None:
                    await nursery.start(svc.run, _ctx(sub))
        # On loopback a and b could dial each other's listen address: a lookup of the
        # DHT did, now and then, and the pair was direct before any punch. Behind NATs
        # they could not; here py-libp2p's dial_peer (what the DHT and connect use) is
        # refused between them. The punch dials with dial_addr, as it does through NATs.
        for me, them in ((a, b), (b, a)):
            _refuse_dial_peer(me, them.peer_id)
        await b.connect(r.addrs()[0])
        await a.connect(r.addrs()[0])
        await await_until(lambda: relays[a].held and relays[b].held, 20, "the reservations")
        driver, other = (a, b) if a.peer_id.to_base58() < b.peer_id.to_base58() else (b, a)
        _other_dials_first(punches[driver], driver)
        # a knows b only by its relayed address (b's LAN addresses would answer here)
        relayed = f"{r.addrs()[0]}/p2p-circuit/p2p/{b.peer_id.to_base58()}"
        await a.connect(relayed)
        await await_until(lambda: punches[driver].counts["punched"] == 1, 60, "the punch")
        peer_of = {a: b, b: a}
        for s in (a, b):
            await await_until(lambda s=s: paths[s].paths().get(
                peer_of[s].peer_id.to_base58()) == "punched", 10, "the punched path")
        assert punches[other].counts["attempts"] == 0  # it only answered
        assert punches[other].counts["answered"] >= 1
        # the relayed connection closes after its grace; the punched one carries on
        await await_until(lambda: all(p.startswith("/ip4/") for c in
                          driver.host.get_network().get_connections(peer_of[driver].peer_id)
                          for p in map(str, c.get_transport_addresses())), 10,
                          "the relayed connection to close")
        await paths[driver].measure(driver)
        st = paths[driver].statistics()
        peer = st["peers"][peer_of[driver].peer_id.to_base58()]
        assert peer["path"] == "punched" and peer["rtt_ms"] is not None
        assert st["by_kind"]["punched"] == 1
        assert "punch: direct connection to" in punch_logs.text
        nursery.cancel_scope.cancel()


async def test_garbage_and_bad_sessions_on_dcutr_are_a_log_line_and_a_counter(punch_logs):
    a = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    b = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    svc = HolePunchService(lambda: "private", tick_s=0.2, message_timeout_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.serve)
        await nursery.start(b.serve)
        await nursery.start(svc.run, _ctx(a))
        await b.connect(a.addrs()[0])

        async def session(payload: bytes | None = None, msg: HolePunch | None = None) -> None:
            stream = await b.host.new_stream(a.peer_id, [TProtocol(PROTOCOL_ID)])
            if payload is not None:
                await stream.write(payload)
            if msg is not None:
                await write_delimited_msg(stream, msg)
            n = svc.counts["protocol_errors"]
            await await_until(lambda: svc.counts["protocol_errors"] > n, 10, "the error")
            await stream.reset()

        # b is directly connected here; the handler would stop at once. Pretend it is not.
        svc._direct_conns = lambda sub, pid: []  # type: ignore[method-assign]
        await session(payload=b"\x05hello")  # not protobuf
        assert "bad DCUtR message" in svc.last_error
        await session(payload=b"\xff\xff\xff\x7f")  # a 256 MiB length prefix: refused unread
        await session(msg=HolePunch(type=HolePunch.SYNC))  # SYNC before CONNECT
        assert "expected CONNECT, got type 300" in svc.last_error
        bogus = HolePunch(type=HolePunch.CONNECT)
        bogus.ObsAddrs.extend([b"\x00garbage", Multiaddr("/ip4/1.2.3.4/udp/9").to_bytes()])
        # a CONNECT whose addresses we would not dial; b sends no SYNC: the timeout
        await session(msg=bogus)
        await session(payload=b"")  # nothing at all: the 1 s message timeout
        assert "no message within 1 s" in svc.last_error
        assert svc.counts["protocol_errors"] == 5
        assert punch_logs.text.count("punch: a DCUtR session from") == 5
        # the host lives on: a ping still answers
        assert await ping(b, a.peer_id) < 5
        nursery.cancel_scope.cancel()
