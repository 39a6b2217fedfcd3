"""DiLoCo's all-reduce over real libp2p hosts on loopback (Averager.allreduce): every
worker of 3 (not a power of two: one hands its vector over and takes the mean back) ends
the round with the exact mean of the three; a worker that never comes costs the round
(an empty outcome, a local step), never an exception."""

from __future__ import annotations

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.averaging.service import Averager
from p2p.host import Substrate


def workers(n: int) -> tuple[list[Substrate], list[Averager]]:
    subs = [Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(n)]
    ids = [s.peer_id.to_base58() for s in subs]
    avgs = [Averager(s, "run", me, (lambda me=me: [p for p in ids if p != me]),
                     codecs=["fp32"], step_time=lambda: 0.01, inner_steps=1, lanes=False,
                     all_reduce=True)
            for s, me in zip(subs, ids, strict=True)]
    return subs, avgs


async def test_three_workers_end_the_round_with_the_exact_mean():
    subs, avgs = workers(3)
    vectors = [torch.randn(10_000, generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    outcomes: list = [None] * 3
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for s in subs:
                await nursery.start(s.serve)
            for i in range(3):
                for j in range(i + 1, 3):
                    await subs[i].connect(subs[j].addrs()[0])

            async def one(i: int) -> None:
                outcomes[i] = await avgs[i].allreduce(5, vectors[i])

            async with trio.open_nursery() as rounds:
                for i in range(3):
                    rounds.start_soon(one, i)
            nursery.cancel_scope.cancel()
    mean = torch.stack(vectors).mean(0)
    for outcome in outcomes:
        assert outcome.round == 5 and len(outcome.partner_thetas) == 1
        torch.testing.assert_close(outcome.partner_thetas[0], mean)  # fp32 on the wire


async def test_a_worker_that_never_comes_costs_the_round_not_an_exception():
    subs, avgs = workers(2)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for s in subs:
                await nursery.start(s.serve)
            await subs[0].connect(subs[1].addrs()[0])
            outcome = await avgs[0].allreduce(1, torch.ones(100))  # avgs[1] never arrives
            assert outcome.partner_thetas == []
            nursery.cancel_scope.cancel()
