"""`outer.codec = "topk"` on the wire: two real hosts on loopback swap encoded sparse frames
(protocols/averaging.py, codec "topk"), each receives the other's frame decoded exactly, a
hostile frame (too dense, indices out of range or unsorted) costs the round and nothing
else, a partner that answers in a dense codec gets a local round (logged once), and
DiLoCo's all-reduce gathers every worker's frame."""

from __future__ import annotations

import logging

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.averaging.service import Averager
from node.ml.optim.compress import CompressedNoLoCo, TopKConfig
from node.training.rounds import Compressed
from p2p.host import Substrate
from protocols import sparse
from tests.conftest import averager_pair, exchange_both

NUMEL = 3 * 4096 + 100  # a partial last chunk
BOUNDS = sparse.Bounds()  # the manifest's defaults: density <= 1/16, 4-bit values, 8-bit anchors


def frame_of(seed: int, topk: TopKConfig | None = None) -> tuple[sparse.Frame, bytes]:
    g = torch.Generator().manual_seed(seed)
    opt = CompressedNoLoCo(torch.randn(NUMEL, generator=g), topk=topk)
    frame = opt.prepare(opt.phi + 0.01 * torch.randn(NUMEL, generator=g))
    return frame, sparse.encode(frame)


def same(a: sparse.Frame, b: sparse.Frame) -> None:
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    assert (a.anchor_codes == b.anchor_codes).all() and (a.eps == b.eps).all()


async def connected(subs: list[Substrate], nursery: trio.Nursery) -> None:
    for s in subs:
        await nursery.start(s.serve)
    for i in range(len(subs)):
        for j in range(i + 1, len(subs)):
            await subs[i].connect(subs[j].addrs()[0])


@pytest.mark.parametrize("lanes", [False, True])
async def test_two_hosts_swap_topk_frames_and_each_decodes_the_others_exactly(lanes):
    subs, ids, avgs, _ = averager_pair(codecs=["topk"], lanes=lanes,
                                       topk_bounds=BOUNDS)
    frames = [frame_of(i) for i in range(2)]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await connected(subs, nursery)
            outcomes = await exchange_both(
                avgs, 3, [Compressed((data,), NUMEL) for _, data in frames])
            nursery.cancel_scope.cancel()
    for i, outcome in enumerate(outcomes):
        assert outcome.peers == (ids[1 - i],) and len(outcome.partner_thetas) == 1
        same(outcome.partner_thetas[0], frames[1 - i][0])
        st = avgs[i].partners[ids[1 - i]]
        assert st.last_codec == "topk"
        sent = sum(st.sent.values())
        # the frame's bytes and ~100 B of framing per piece: a 40th of fp32's
        assert len(frames[i][1]) <= sent < len(frames[i][1]) + 400 < 4 * NUMEL / 40


def hostile_frames() -> dict[str, bytes]:
    """Frames a peer could send, each refused by a receiver with the default bounds."""
    dense, _ = frame_of(7, TopKConfig(density=1 / 8))  # 512 of 4096: over 1/16
    good, _ = frame_of(8)
    k, chunk = good.k, good.chunk
    idx = good.indices.clone()
    idx[1], idx[2] = idx[2].item(), idx[1].item()  # unsorted within chunk 0
    unsorted = sparse.make_frame(NUMEL, chunk, k, idx, good.values, good.value_bits)
    idx = good.indices.clone()
    idx[-1] = NUMEL + 50  # in the last chunk's slot, past numel
    outside = sparse.make_frame(NUMEL, chunk, k, idx, good.values, good.value_bits)
    truncated = sparse.encode(good)[:-1]
    return {"too dense": sparse.encode(dense), "unsorted": sparse.encode(unsorted),
            "out of range": sparse.encode(outside), "truncated": truncated}


@pytest.mark.parametrize("honest_initiates", [False, True])
@pytest.mark.parametrize("kind", sorted(hostile_frames()))
async def test_a_hostile_frame_costs_the_round_and_raises_nothing(kind, honest_initiates,
                                                                  caplog):
    subs, ids, avgs, initiator = averager_pair(codecs=["topk"], lanes=False,
                                               topk_bounds=BOUNDS)
    honest = avgs.index(initiator) if honest_initiates else 1 - avgs.index(initiator)
    payloads = [b""] * 2
    payloads[honest] = frame_of(1)[1]
    payloads[1 - honest] = hostile_frames()[kind]
    caplog.set_level(logging.INFO, logger="node.averaging")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await connected(subs, nursery)
            outcomes = await exchange_both(
                avgs, 1, [Compressed((p,), NUMEL) for p in payloads])
            nursery.cancel_scope.cancel()
    assert outcomes[honest].partner_thetas == []  # a local step
    assert avgs[honest].partners[ids[1 - honest]].failures == 1
    reason = {"too dense": "over the run's bound", "unsorted": "repeated or unsorted",
              "out of range": "index out of range", "truncated": "bytes"}[kind]
    assert any(reason in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("topk_initiates", [False, True])
async def test_a_partner_without_topk_gets_local_rounds_logged_once(topk_initiates, caplog):
    subs = [Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    ids = [s.peer_id.to_base58() for s in subs]
    if (ids[0] < ids[1]) != topk_initiates:  # the smaller id dials
        subs.reverse()
        ids.reverse()
    # subs[0] runs topk; subs[1] is an older node that speaks only dense codecs
    avgs = [Averager(s, "run", me, (lambda other=other: [other]), codecs=codecs,
                     step_time=lambda: 0.01, inner_steps=1, lanes=False, topk_bounds=BOUNDS)
            for s, me, other, codecs in zip(subs, ids, reversed(ids),
                                            (["topk"], ["bf16", "fp32"]), strict=True)]
    snapshots = [Compressed((frame_of(0)[1],), NUMEL), torch.ones(NUMEL)]
    caplog.set_level(logging.INFO, logger="node.averaging")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await connected(subs, nursery)
            for r in (1, 2):
                outcomes = await exchange_both(avgs, r, snapshots)
                assert [o.partner_thetas for o in outcomes] == [[], []]
            nursery.cancel_scope.cancel()
    warned = [r for r in caplog.records if "does not speak the topk codec" in r.getMessage()
              and r.levelno == logging.WARNING]
    assert len(warned) == 1


async def test_diloco_gathers_every_workers_frame_in_the_same_order_everywhere():
    n = 3  # not a power of two: one worker hands its frame over and takes the bundle back
    subs = [Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(n)]
    ids = [s.peer_id.to_base58() for s in subs]
    avgs = [Averager(s, "run", me, (lambda me=me: [p for p in ids if p != me]),
                     codecs=["topk"], step_time=lambda: 0.01, inner_steps=1, lanes=False,
                     all_reduce=True, topk_bounds=BOUNDS)
            for s, me in zip(subs, ids, strict=True)]
    frames = [frame_of(i) for i in range(n)]
    outcomes: list = [None] * n
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await connected(subs, nursery)

            async def one(i: int) -> None:
                outcomes[i] = await avgs[i].allreduce(4, Compressed((frames[i][1],), NUMEL))

            async with trio.open_nursery() as rounds:
                for i in range(n):
                    rounds.start_soon(one, i)
            nursery.cancel_scope.cancel()
    want = [f for f, data in sorted(frames, key=lambda fd: fd[1])]
    for outcome in outcomes:
        assert len(outcome.partner_thetas) == n
        for got, expected in zip(outcome.partner_thetas, want, strict=True):
            same(got, expected)
