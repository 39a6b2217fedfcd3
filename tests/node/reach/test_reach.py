"""Reachability without namespaces: the fresh-connection dial-back between two real hosts on
loopback (the false PUBLIC that py-libp2p's reused connection gave is gone), the verdict
rule, the STUN responder miniupnpd's check relies on, and the nat scenario's bad flags."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.reach import autonat
from node.reach import service as reach_service
from node.reach.autonat import Answer, Window
from node.reach.service import ReachabilityService
from node.reach.upnp import Mapping
from p2p.addrs import Network
from p2p.host import DialError, Substrate
from protocols import stun
from testnet import stun as testnet_stun
from tests.conftest import cli, node_context


async def test_dial_back_is_on_a_fresh_connection_and_proves_the_key():
    server, client = (Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
                      for _ in range(2))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        await nursery.start(client.serve)
        server.set_handler(autonat.PROTOCOL_ID, autonat.server_handler(server))
        await client.connect(server.addrs()[0])
        listening = [a.split("/p2p/")[0] for a in client.addrs()]
        with trio.fail_after(30):
            ok = await autonat.ask(client, server.peer_id, listening)
        assert ok.status == "reached" and ok.addr == listening[0]
        # Connected to the server, but advertising a port nobody listens on: py-libp2p's
        # own server "reached" such a requester over the open connection (false PUBLIC).
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}"
        with trio.fail_after(30):
            no = await autonat.ask(client, server.peer_id, [dead])
        assert no.status == "unreachable"
        # an address at another IP than the one the server sees is not dialed at all
        with trio.fail_after(30):
            refused = await autonat.ask(client, server.peer_id, ["/ip4/198.18.9.9/tcp/4001"])
        assert refused.status == "refused"
        # the probe checks who answers: the right address with the wrong key fails
        with pytest.raises(DialError):
            await server.probe(server.peer_id, listening[0], timeout=10)
        nursery.cancel_scope.cancel()


def _vote(ip: str, status: str, local: bool = False) -> Answer:
    return Answer(f"server@{ip}", status, ip=ip, local=local)


def test_a_public_node_whose_first_dial_back_failed_becomes_public():
    # The old rule (3 agreeing answers, else keep the old verdict) left this node private
    # for good: two "reached" against one "unreachable" are not 3 agreeing.
    w = Window()
    w.add(_vote("198.18.1.2", "unreachable"), 0)
    assert w.decide(0) == "private"
    w.add(_vote("198.18.2.2", "reached"), 10)
    assert w.decide(10) == "unknown"  # a tie decides nothing
    w.add(_vote("198.18.3.2", "reached"), 20)
    assert w.decide(20) == "public"
    # and back: the same servers now fail (a firewall went up); their latest answers count
    for ip in ("198.18.2.2", "198.18.3.2"):
        w.add(_vote(ip, "unreachable"), 30)
    assert w.decide(30) == "private" and w.tally(30) == (0, 3)


def test_servers_on_our_machine_do_not_vote_and_one_ip_is_one_voice():
    w = Window()
    w.add(_vote("198.18.1.2", "reached", local=True), 0)  # a bootstrap on our machine
    assert w.decide(0) == "unknown" and w.tally(0) == (0, 0)
    w.add(_vote("198.18.2.2", "unreachable"), 1)
    assert w.decide(1) == "private"
    for _ in range(3):  # several servers behind one IP (or one asked again): one vote
        w.add(_vote("198.18.5.2", "reached"), 2)
    w.add(_vote("198.18.3.2", "refused"), 3)
    assert w.tally(3) == (1, 2) and w.decide(3) == "private"
    w.add(_vote("198.18.4.2", "error"), 4)  # errors do not vote, nor replace a vote
    assert w.tally(4) == (1, 2)


def test_the_window_forgets_old_answers_and_holds_a_bounded_number():
    w = Window(size=3, max_age_s=100)
    w.add(_vote("198.18.1.2", "unreachable"), 0)
    w.add(_vote("198.18.2.2", "reached"), 50)
    assert w.decide(50) == "unknown"
    assert w.decide(120) == "public"  # the unreachable answer aged out
    for i in range(3, 10):
        w.add(_vote(f"198.18.{i}.2", "unreachable"), 130)
    assert len(w.votes) == 3 and w.decide(130) == "private"
    assert w.decide(1000) == "unknown"  # everything aged out: no evidence


def test_stun_answers_from_the_address_the_request_asks_for():
    """The testnet's RFC 5780 responder (testnet/stun.py) answers from the address and port
    a CHANGE-REQUEST names, through protocols/stun.py's codec; what does not parse as a
    Binding Request (junk, an answer) is dropped and the responder keeps serving."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # a free port pair is likely: port+1 checked below
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        try:
            other.bind(("127.0.0.1", port + 1))
        except OSError:
            pytest.skip("no free port pair for the responder")
    threading.Thread(target=testnet_stun.serve, args=("127.0.0.1", "127.0.0.2", port, port + 1),
                     daemon=True).start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
        c.bind(("127.0.0.1", 0))
        c.settimeout(2)
        txid = b"0123456789ab"
        req = stun.encode_request(txid, stun.CHANGE_IP | stun.CHANGE_PORT)
        for _ in range(30):  # the thread may not be bound yet: resend until it answers
            c.sendto(b"junk", ("127.0.0.1", port))  # dropped, before every request
            c.sendto(stun.encode_success(txid, "1.2.3.4", 5), ("127.0.0.1", port))  # dropped
            c.sendto(req, ("127.0.0.1", port))
            try:
                data, source = c.recvfrom(2048)
                break
            except TimeoutError:
                continue
        assert source == ("127.0.0.2", port + 1)
        assert stun.parse_success(data, txid) == ("127.0.0.1", c.getsockname()[1])


@pytest.mark.parametrize(("args", "message"), [
    (["--scenario", "nat", "--kinds", "public,cgnat"], "--kinds public,cgnat: expected"),
    (["--scenario", "nat", "--rate", "fast"], "--rate fast: expected a rate such as 100mbit"),
    (["--kinds", "home"], "--kinds applies to the nat scenario only"),
    (["--rate", "10mbit"], "--rate applies to the partition and nat scenarios"),
    (["--scenario", "nat", "--rtt", "50"], "--rtt 50: expected milliseconds such as 50ms"),
    (["--rtt", "50ms"], "--rtt applies to the partition and nat scenarios"),
])
def test_bad_nat_flags_are_one_line_and_exit_2(args, message, tmp_path):
    r = cli("testnet", "up", "--dir", str(tmp_path / "tn"), *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


class FakeSubstrate:
    """What the reach service uses of a substrate, with no peers to ask: the verdict stays
    as set, so the UPnP timers can be driven alone (the real gateway is in test_nat.py)."""

    peer_id = "me"
    dht_server = True

    def __init__(self, listen: str = "/ip4/198.19.9.2/tcp/4001") -> None:
        self.announced: list[str] = []
        self.listen = [listen]
        self.peers: dict[str, str] = {}  # peer -> its IP (connected directly)

    def set_handler(self, protocol, handler) -> None: ...
    def connected_peers(self) -> list: return list(self.peers)
    def peer_ips(self, peer) -> list[str]: return [self.peers[peer]]
    def network(self) -> Network: return Network.of(self.listen, interfaces=["198.19.9.2"])
    def addrs(self) -> list[str]: return ["/ip4/198.19.9.2/tcp/4001/p2p/me"]
    def observed_ips(self) -> list[str]: return []
    def listen_ports(self) -> list[int]: return [4001]
    def announce(self, addr: str) -> None: self.announced.append(addr)
    def withdraw(self, addr: str) -> None: self.announced.remove(addr)

    async def set_dht_server(self, server: bool) -> None:
        self.dht_server = server


class FakeGateway:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.url = None
        self.fail = fail
        self.maps: list[float] = []
        self.unmapped: list[Mapping] = []

    async def discover(self) -> str:
        self.url = "http://198.19.9.1/ctl"
        return self.url

    async def map(self, port: int, lease_s: int) -> Mapping:
        self.maps.append(trio.current_time())
        if self.fail is not None:
            raise self.fail
        return Mapping("198.18.9.2", port, "198.19.9.2", port, lease_s)

    async def unmap(self, mapping: Mapping) -> None:
        self.unmapped.append(mapping)


async def _run_private(svc: ReachabilityService, sub: FakeSubstrate, seconds: float) -> None:
    svc.state = "private"
    with trio.move_on_after(seconds):
        await svc.run(node_context(substrate=sub))  # type: ignore[arg-type]


async def test_a_mapping_is_announced_renewed_at_half_lease_and_removed_on_stop(
    autojump_clock,
):
    sub, gw = FakeSubstrate(), FakeGateway()
    svc = ReachabilityService(lease_s=100, gateway=gw)  # type: ignore[arg-type]
    start = trio.current_time()
    await _run_private(svc, sub, 160)
    assert [round(t - start) for t in gw.maps] == [0, 50, 100, 150]
    assert svc.renewals == 3
    assert [m.multiaddr for m in gw.unmapped] == ["/ip4/198.18.9.2/tcp/4001"]
    assert sub.announced == [] and svc.mapping is None and svc.upnp_state == "removed"


async def test_a_node_on_loopback_only_never_asks_a_gateway(autojump_clock):
    sub, gw = FakeSubstrate("/ip4/127.0.0.1/tcp/4001"), FakeGateway()
    svc = ReachabilityService(gateway=gw)  # type: ignore[arg-type]
    await _run_private(svc, sub, 700)
    assert gw.maps == [] and gw.url is None and sub.announced == []
    assert svc.statistics()["upnp"]["state"] == "off (loopback only)"


async def test_a_gateway_that_answers_garbage_leaves_the_node_private_and_retrying(
    autojump_clock,
):
    sub, gw = FakeSubstrate(), FakeGateway(fail=ValueError("not XML"))
    svc = ReachabilityService(gateway=gw, upnp_retry_s=600)  # type: ignore[arg-type]
    start = trio.current_time()
    await _run_private(svc, sub, 700)
    st = svc.statistics()
    assert st["reachability"] == "private" and st["dht"] == "client"
    assert st["upnp"]["state"] == "failed"
    assert st["upnp"]["error"] == "the gateway's answer broke miniupnpc (ValueError('not XML'))"
    assert [round(t - start) for t in gw.maps] == [0, 600]  # retried after upnp_retry_s
    assert sub.announced == [] and gw.unmapped == []


async def test_garbage_on_the_autonat_protocol_ends_that_stream_only():
    server, client = (Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
                      for _ in range(2))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        await nursery.start(client.serve)
        server.set_handler(autonat.PROTOCOL_ID, autonat.server_handler(server))
        await client.connect(server.addrs()[0])
        for garbage in (b"\x05hello", b"\xff\xff\xff\xff\x0f" + b"x" * 100, b"\x02\x08\x63"):
            stream = await client.open_stream(server.peer_id, autonat.PROTOCOL_ID)
            await stream.write(garbage)
            with trio.fail_after(30):
                with contextlib.suppress(Exception):
                    await stream.read(1024)  # an error answer or the stream's end
            with contextlib.suppress(Exception):
                await stream.close()
        listening = [a.split("/p2p/")[0] for a in client.addrs()]
        with trio.fail_after(30):
            assert (await autonat.ask(client, server.peer_id, listening)).status == "reached"
        assert server.stats.restarts == 0
        nursery.cancel_scope.cancel()


def test_lanes_are_dialable_unless_behind_a_nat_or_only_through_a_mapping():
    # A bulk lane listens on a fresh port: a NAT forwards none, a UPnP mapping only the
    # libp2p port. Unknown (loopback testnets never learn) counts as dialable.
    svc = ReachabilityService()
    assert svc.lane_dialable()  # unknown
    svc.state = "private"
    assert not svc.lane_dialable()
    svc.state = "public"
    assert svc.lane_dialable()
    svc.mapping = Mapping("198.18.9.2", 4001, "198.19.9.2", 4001, 100)
    assert not svc.lane_dialable()


async def test_the_verdict_and_the_dht_mode_follow_the_answers_both_ways(autojump_clock,
                                                                         monkeypatch):
    # Scripted AutoNAT answers (the dial-backs themselves are tested above and in
    # test_reach_netns.py): A fails to dial us back, B and C reach us, then all fail.
    answers = {"A": "unreachable", "B": "reached", "C": "reached"}

    async def ask(sub, server, addrs):
        return Answer(server, answers[server])

    monkeypatch.setattr(reach_service, "ask", ask)
    sub = FakeSubstrate()
    sub.peers = {"A": "198.18.1.2"}
    svc = ReachabilityService(upnp=False, interval_s=60, retry_s=5)
    seen: list[tuple[str, bool]] = []

    async def watch():
        while True:
            await svc.changed.wait()
            await trio.sleep(0)  # the loop sets the DHT mode right after the check
            seen.append((svc.state, sub.dht_server))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        nursery.start_soon(svc.run, node_context(substrate=sub))
        await trio.sleep(1)
        assert svc.state == "private" and sub.dht_server is False
        sub.peers = {"A": "198.18.1.2", "B": "198.18.2.2", "C": "198.18.3.2"}
        await trio.sleep(200)
        assert svc.state == "public" and sub.dht_server is True
        answers.update(B="unreachable", C="unreachable")
        await trio.sleep(200)
        assert svc.state == "private" and sub.dht_server is False
        nursery.cancel_scope.cancel()
    assert ("public", True) in seen


def test_checks_come_sooner_while_uncertain_doubling_up_to_the_interval():
    svc = ReachabilityService(interval_s=120, retry_s=5)
    assert svc.next_wait() == 120
    waits = []
    for n in range(1, 7):
        svc._uncertain = n
        waits.append(svc.next_wait())
    assert waits == [5, 10, 20, 40, 80, 120]
