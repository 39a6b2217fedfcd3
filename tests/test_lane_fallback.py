"""The averaging adapter between two real hosts when the bulk lane cannot be reached (a
firewall in front of the lane's port): that round is a local step, the next rounds go over
the libp2p stream, and after LANE_RETRY_S the lane is offered again."""

from __future__ import annotations

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.averaging import service as averaging
from node.averaging.service import Averager
from node.lane import connect_lane
from p2p.host import Substrate

NUMEL = 50_000


def _pair() -> tuple[list[Substrate], list[str], list[Averager], Averager]:
    """Two hosts on loopback, each averaging with the other; the initiator is the smaller
    id (it dials and connects the lane)."""
    subs = [Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    ids = [s.peer_id.to_base58() for s in subs]
    avgs = [Averager(s, "run", me, (lambda other=other: [other]), codecs=["fp32"],
                     step_time=lambda: 0.01, inner_steps=1)
            for s, me, other in zip(subs, ids, reversed(ids), strict=True)]
    return subs, ids, avgs, avgs[ids.index(min(ids))]


async def test_an_unreachable_lane_costs_one_round_then_the_stream_carries_on(monkeypatch):
    refused: list[int] = []

    async def firewalled(host: str, port: int, key: bytes, timeout: float):
        if len(refused) < 1:  # the first lane dial fails, as behind a firewall
            refused.append(port)
            raise OSError(111, "Connection refused")
        return await connect_lane(host, port, key, timeout=timeout)

    monkeypatch.setattr(averaging, "connect_lane", firewalled)
    subs, ids, avgs, initiator = _pair()
    vectors = [torch.full((NUMEL,), float(i)) for i in range(2)]

    async def both(r: int) -> list:
        outcomes: list = [None, None]

        async def one(i: int) -> None:
            outcomes[i] = await avgs[i].exchange(r, vectors[i])

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, i)
        return outcomes

    async with trio.open_nursery() as nursery:
        for s in subs:
            await nursery.start(s.serve)
        await subs[0].connect(subs[1].addrs()[0])

        first = await both(1)
        assert [o.partner_thetas for o in first] == [[], []]  # a local step on both sides
        assert refused and set(initiator.lane_failed) == {ids[1 - avgs.index(initiator)]}

        second = await both(2)  # the libp2p stream: the lane is not even offered
        for i, o in enumerate(second):
            assert torch.equal(o.partner_thetas[0], vectors[1 - i])
        assert len(refused) == 1

        monkeypatch.setattr(averaging, "LANE_RETRY_S", 0.0)  # the retry window has passed
        third = await both(3)
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
    subs, ids, avgs, initiator = _pair()
    vectors = [torch.full((NUMEL,), float(i)) for i in range(2)]
    async with trio.open_nursery() as nursery:
        for s in subs:
            await nursery.start(s.serve)
        await subs[0].connect(subs[1].addrs()[0])
        async with trio.open_nursery() as both:
            for i in range(2):
                both.start_soon(avgs[i].exchange, 1, vectors[i])
        assert set(initiator.lane_failed) == {ids[1 - avgs.index(initiator)]}
        nursery.cancel_scope.cancel()


def test_only_a_direct_path_is_offered_a_lane():
    # A lane is a new TCP dial to the partner's address: through a punched NAT (only the
    # punched port is open), a relay or a data channel it cannot connect.
    sub = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    kinds = {"a": "direct", "b": "punched", "c": "upnp", "d": "relayed via X"}
    avg = Averager(sub, "run", "me", lambda: list(kinds), codecs=["fp32"],
                   path_of=lambda peer: kinds[peer])
    assert [p for p in kinds if avg._lane_for(p)] == ["a"]
