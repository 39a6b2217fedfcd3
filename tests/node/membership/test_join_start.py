"""A joiner's start, timer logic only (trio's autojump clock): its first heartbeats come
0.25 s apart, then every interval; the background torch import waits for its bound."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import trio
import trio.testing

from node.membership import heartbeats
from node.membership.heartbeats import HeartbeatService
from tests.conftest import node_context


def test_a_new_nodes_first_heartbeats_come_sooner_then_every_interval():
    sent: list[float] = []
    ctx = node_context(
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


def test_a_joiner_waits_for_the_run_documents_first_sync_while_members_are_heard():
    """A joiner learns the run's newest checkpoint from its first run-document sync. Once
    torch is in, a joiner that had heard nobody (a run's first node) stops waiting after
    SYNC_WAIT_S; one that hears training members waits for the sync, up to
    SYNC_WAIT_LOADING_S: giving up after 6 s under load made it train from scratch."""
    from node.checkpoints import service as ckpt

    def ended_after(heard: bool, synced_at: float | None) -> float:
        ctx = node_context(run=SimpleNamespace(  # no checkpoint listed
            document=SimpleNamespace(entries=lambda: [])))

        async def main() -> float:
            synced = trio.Event()
            service = ckpt.CheckpointService(publish=lambda delta: None, synced=synced,
                                             members_heard=lambda: heard)
            async with trio.open_nursery() as nursery:
                if synced_at is not None:
                    async def sync_then() -> None:
                        await trio.sleep(synced_at)
                        synced.set()
                    nursery.start_soon(sync_then)
                assert await service._pull_newest(ctx) is None
                return trio.current_time()

        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    assert ended_after(heard=False, synced_at=None) == ckpt.SYNC_WAIT_S
    assert ended_after(heard=True, synced_at=None) == ckpt.SYNC_WAIT_LOADING_S
    assert ended_after(heard=True, synced_at=12.0) == 12.0
