"""The averaging adapter between two real hosts when the bulk lane cannot be reached (a
firewall in front of the lane's port): that round is a local step, the next rounds go over
the libp2p stream, and after LANE_RETRY_S the lane is offered again."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.averaging import service as averaging
from node.averaging.service import Averager
from node.transport.lane import connect_lane
from node.transport.transports import Transports
from p2p.host import Substrate
from tests.conftest import averager_pair, exchange_both

NUMEL = 50_000


async def test_an_unreachable_lane_costs_one_round_then_the_stream_carries_on(monkeypatch):
    refused: list[int] = []

    async def firewalled(host: str, port: int, key: bytes, timeout: float):
        if len(refused) < 1:  # the first lane dial fails, as behind a firewall
            refused.append(port)
            raise OSError(111, "Connection refused")
        return await connect_lane(host, port, key, timeout=timeout)

    monkeypatch.setattr(averaging, "connect_lane", firewalled)
    subs, ids, avgs, initiator = averager_pair()
    vectors = [torch.full((NUMEL,), float(i)) for i in range(2)]

    async with trio.open_nursery() as nursery:
        for s in subs:
            await nursery.start(s.serve)
        await subs[0].connect(subs[1].addrs()[0])

        first = await exchange_both(avgs, 1, vectors)
        assert [o.partner_thetas for o in first] == [[], []]  # a local step on both sides
        assert refused and set(initiator.lane_failed) == {ids[1 - avgs.index(initiator)]}

        second = await exchange_both(avgs, 2, vectors)  # the libp2p stream: no lane offered
        for i, o in enumerate(second):
            assert torch.equal(o.partner_thetas[0], vectors[1 - i])
        assert len(refused) == 1

        monkeypatch.setattr(averaging, "LANE_RETRY_S", 0.0)  # the retry window has passed
        third = await exchange_both(avgs, 3, vectors)
        for i, o in enumerate(third):
            assert torch.equal(o.partner_thetas[0], vectors[1 - i])
        assert initiator.lane_failed == {}  # offered again, and this time it connected
        nursery.cancel_scope.cancel()


async def test_a_lane_dial_cut_by_the_round_deadline_counts_as_failed(monkeypatch):
    # Behind a NAT that drops unsolicited SYNs the lane dial hangs until the round's own
    # deadline cancels it; the mark must survive that cancel, or every round dials again.
    async def silent(host: str, port: int, key: bytes, timeout: float):
        await trio.sleep_forever()

    monkeypatch.setattr(averaging, "connect_lane", silent)
    subs, ids, avgs, initiator = averager_pair()
    vectors = [torch.full((NUMEL,), float(i)) for i in range(2)]
    async with trio.open_nursery() as nursery:
        for s in subs:
            await nursery.start(s.serve)
        await subs[0].connect(subs[1].addrs()[0])
        await exchange_both(avgs, 1, vectors)
        assert set(initiator.lane_failed) == {ids[1 - avgs.index(initiator)]}
        nursery.cancel_scope.cancel()


def test_only_a_direct_path_is_offered_a_lane():
    # A lane is a new TCP dial to the partner's address: through a punched NAT (only the
    # punched port is open), a relay or a data channel it cannot connect.
    sub = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    kinds = {"a": "direct", "b": "punched", "c": "upnp", "d": "relayed via X"}
    door = Transports(sub)
    door.attach(kinds=SimpleNamespace(paths=lambda: kinds, rtt_ms={}))
    avg = Averager(sub, "run", "me", lambda: list(kinds), codecs=["fp32"], transports=door)
    assert [p for p in kinds if avg._lane_for(p)] == ["a"]


async def test_a_responder_behind_a_nat_takes_the_round_on_the_stream(monkeypatch):
    # The initiator sees a direct path (the NATed responder dialed it) and offers a lane;
    # the responder knows no one can connect to a fresh port of its own (its reach
    # verdict: Transports.lane_dialable) and answers without one. Measured before this
    # (`node bench paths`): the initiator's lane dial timed out and the round was lost.
    dials: list[int] = []

    async def recorded(host: str, port: int, key: bytes, timeout: float):
        dials.append(port)
        return await connect_lane(host, port, key, timeout=timeout)

    monkeypatch.setattr(averaging, "connect_lane", recorded)
    subs, _ids, avgs, initiator = averager_pair()
    responder = avgs[1 - avgs.index(initiator)]
    responder.transports.attach(lane_dialable=lambda: False)
    vectors = [torch.full((NUMEL,), float(i)) for i in range(2)]
    async with trio.open_nursery() as nursery:
        for s in subs:
            await nursery.start(s.serve)
        await subs[0].connect(subs[1].addrs()[0])
        outcomes = await exchange_both(avgs, 1, vectors)
        for i, o in enumerate(outcomes):
            assert torch.equal(o.partner_thetas[0], vectors[1 - i])
        assert dials == [] and initiator.lane_failed == {}
        partner = initiator.partners[responder.me]
        assert set(partner.sent) == {"stream"}
        nursery.cancel_scope.cancel()
