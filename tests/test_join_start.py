"""A joiner's start, timer logic only (trio's autojump clock): its first heartbeats come
0.25 s apart, then every interval; the background torch import waits for its bound."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import trio
import trio.testing

from node.membership import heartbeats
from node.membership.heartbeats import HeartbeatService


def test_a_new_nodes_first_heartbeats_come_sooner_then_every_interval():
    sent: list[float] = []
    ctx = SimpleNamespace(
        peer_id="12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo", device="cpu",
        substrate=SimpleNamespace(addrs=lambda: ["/ip4/127.0.0.1/tcp/1"]),
        own_stats=lambda: {"step": 0},
        publisher=SimpleNamespace(publish_nowait=lambda topic, data: sent.append(
            trio.current_time())))

    async def main():
        service = HeartbeatService(["run"], publish=True, interval_s=1.0)
        with trio.move_on_after(3.9):
            await service._publish(ctx, "run")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(sent)]
    first = heartbeats.FIRST_BEATS
    assert gaps[:first] == [heartbeats.FIRST_BEATS_S] * first
    assert gaps[first:] == [1.0] * (len(gaps) - first) and len(gaps) > first
