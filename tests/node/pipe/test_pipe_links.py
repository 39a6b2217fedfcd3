"""The pipeline's stream adapter and stage worker (node/pipe/links.py, worker.py), in one
process: hostile input on an inbound stream, lost peers on the outbound side, and stage
workers wired to each other's inboxes training a small GPT (the real-process run is
tests/swarm/test_pipeline_live.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import pytest
import torch
import trio
import trio.testing

from node.pipe.links import Inbox, Lost, Message, Outbox, Outgoing, serve_stream
from node.pipe.worker import StageWorker
from node.training.rounds import TrainingStats
from protocols import pipeline as pipe
from protocols.errors import RemoteProtocolError
from tests.conftest import wait_until

RUN = "QmbJita7vMGEyqez8hwZgqt4fSbGk5bKTtbDPt9xfmR8G5"
EXPECT = pipe.Expect(RUN, 2, 8, 4, 16, 4)  # an interior stage: act from 1, grad from 3


class FakeStream:
    """A libp2p-shaped stream (read / write / close) over a trio memory stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.s = stream

    async def read(self, n: int = -1) -> bytes:
        return await self.s.receive_some(n if n > 0 else None)

    async def write(self, data: bytes) -> None:
        await self.s.send_all(data)

    async def close(self) -> None:
        await self.s.aclose()


def claims(hosts: dict[str, int], stage: int = 2):
    """claim() as the service computes it, from a fixed stage map."""
    def claim(peer: str, h: pipe.MessageHeader) -> str | None:
        sender = {"act": stage - 1, "grad": stage + 1}.get(h.kind, -1)
        return None if hosts.get(peer) == sender else f"{peer} does not host stage {sender}"
    return claim


def msg(kind="act", step=3, mb=0, shape=(2, 16, 8), fill=None, stage=2) -> bytes:
    t = torch.randn(shape) if fill is None else torch.full(shape, fill)
    return b"".join(bytes(p) for p in pipe.encode(kind, RUN, stage, step, mb, t))


async def feed(data: list[bytes], peer: str = "p1", inbox: Inbox | None = None,
               hosts: dict[str, int] | None = None) -> tuple[Inbox, Counter]:
    inbox = inbox or Inbox(16)
    counters: Counter[str] = Counter()
    a, b = trio.testing.memory_stream_pair()  # unbounded: everything is written first
    for d in data:
        await a.send_all(d)
    await a.aclose()
    await serve_stream(FakeStream(b), peer, EXPECT, claims(hosts or {"p1": 1, "p3": 3}),
                       inbox, counters)
    return inbox, counters


def drain(inbox: Inbox) -> list:
    out = []
    while (item := inbox.get(0)) is not None:
        out.append(item)
    return out


async def test_good_messages_reach_the_inbox_with_their_sender():
    inbox, counters = await feed([msg(mb=0), msg(mb=1)])
    items = drain(inbox)
    assert [(i.kind, i.step, i.mb, i.sender) for i in items] == [
        ("act", 3, 0, "p1"), ("act", 3, 1, "p1")]
    assert counters["received act"] == 2 and counters["received bytes act"] == 2 * 2 * 16 * 8 * 2


@pytest.mark.parametrize(("data", "match"), [
    (msg(shape=(2, 16, 9)), "d_model 9"),  # a wrong shape
    (msg(shape=(5, 16, 8)), "batch must be"),  # more sequences than a micro-batch holds
    (msg(stage=1), "sent to stage 2"),  # for another stage
], ids=["shape", "batch", "stage"])  # the data holds random tensors: ids must not
async def test_a_wrong_shape_or_stage_closes_the_stream_with_the_reason(data, match):
    with pytest.raises(RemoteProtocolError, match=match):
        await feed([data])


async def test_a_wrong_dtype_closes_the_stream():
    header = pipe.encode("act", RUN, 2, 3, 0, torch.randn(2, 16, 8))
    env = bytes(header[0]).replace(b"bfloat16", b"float16\x00")  # same length, wrong dtype
    with pytest.raises(RemoteProtocolError):
        await feed([env + b"".join(bytes(p) for p in header[1:])])


async def test_nan_costs_that_micro_batch_only_and_the_stream_goes_on(caplog):
    with caplog.at_level(logging.WARNING, "node.pipeline"):
        inbox, counters = await feed([msg(mb=0, fill=float("nan")), msg(mb=1)])
    lost, good = drain(inbox)
    assert isinstance(lost, Lost) and lost.mb == 0 and "NaN" in lost.reason
    assert isinstance(good, Message) and good.mb == 1
    assert counters["refused: values"] == 1
    assert any("NaN" in r.getMessage() for r in caplog.records)


async def test_a_peer_claiming_a_stage_it_does_not_host_is_refused():
    # p3 hosts stage 3: it may send gradients here, never activations (stage 1's)
    inbox, _ = await feed([msg(kind="grad")], peer="p3")
    assert len(drain(inbox)) == 1
    with pytest.raises(RemoteProtocolError, match="does not host stage 1"):
        await feed([msg(kind="act")], peer="p3")
    with pytest.raises(RemoteProtocolError, match="does not host"):
        await feed([msg()], peer="stranger")


async def test_a_flood_is_refused_past_the_queue_s_bound_with_a_logged_reason(caplog):
    inbox = Inbox(3)
    with caplog.at_level(logging.WARNING, "node.pipeline"):
        await feed([msg(step=s, mb=k) for s in range(3) for k in range(4)], inbox=inbox)
    assert inbox.qsize() == 3  # bounded memory: the rest never queued
    assert inbox.refused["queue full"] == 9
    assert sum("queue holds 3" in r.getMessage() for r in caplog.records) == 9


class DeadSubstrate:
    async def open_stream(self, peer, protocol):
        raise OSError("connection refused")


async def test_a_dead_next_peer_loses_its_micro_batches_at_once():
    lost: list[tuple[int, str]] = []
    box = Outbox(DeadSubstrate(), RUN, capacity=8, on_lost=lambda m, why: lost.append((m.mb, why)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(box.run)
        await trio.testing.wait_all_tasks_blocked()
        peer = "12D3KooWLAjc6hm91o73Nm6xocXg4ahngMxYkq6GNhjaawfeGKUu"
        for k in range(3):
            box.send(peer, Outgoing("act", 2, 0, k, torch.zeros(1, 2, 8)))
        with trio.fail_after(10):
            while len(lost) < 3:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert sorted(mb for mb, _ in lost) == [0, 1, 2]
    assert all("connection refused" in why or "failed" in why for _, why in lost)
    assert box.failures[peer] >= 1


@pytest.mark.parametrize("offers", [True, False], ids=["lane", "no lane"])
async def test_on_a_direct_path_the_messages_take_a_bulk_lane_else_the_stream(offers):
    """Two real hosts on loopback: the sender asks for a lane on its first message's
    stream; the receiver offers one (messages then come over it, still as the sender's)
    or declines (they come over the stream). Either way every message arrives."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p.host import Substrate

    sender, receiver = (Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
                        for _ in range(2))
    me = sender.peer_id.to_base58()
    inbox, counters = Inbox(16), Counter()

    async def handle(stream):
        await serve_stream(stream, stream.muxed_conn.peer_id.to_base58(), EXPECT,
                           claims({me: 1}), inbox, counters,
                           lane_host="127.0.0.1" if offers else None)

    receiver.set_handler(pipe.PROTOCOL_ID, handle)
    lost: list = []
    box = Outbox(sender, RUN, capacity=8, on_lost=lambda m, why: lost.append(why))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for s in (sender, receiver):
                await nursery.start(s.serve)
            peer = await sender.connect(receiver.addrs()[0])
            nursery.start_soon(box.run)
            await trio.testing.wait_all_tasks_blocked()
            for k in range(3):
                box.send(peer.to_base58(), Outgoing("act", 2, 5, k, torch.randn(2, 16, 8)))
            while inbox.qsize() < 3:
                await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
    assert [(m.mb, m.sender) for m in drain(inbox)] == [(k, me) for k in range(3)]
    assert not lost
    assert box.paths[peer.to_base58()] == ("lane" if offers else "stream")
    assert counters["lanes accepted"] == (1 if offers else 0)


async def test_a_lane_is_asked_for_first_or_never():
    with pytest.raises(RemoteProtocolError, match="first message"):
        await feed([msg(mb=0), pipe.encode_lane_request(RUN)])
    with pytest.raises(RemoteProtocolError, match="another run"):
        await feed([pipe.encode_lane_request("QmOther")])


# -- stage workers wired to each other, in threads -----------------------------------------

def wire_pipeline(stages: int, d_model: int = 16, micro_batches: int = 2, dead: int | None = None,
                  steps: int = 30, swap: bool = False, sent: list | None = None):
    """`stages` workers, one thread each; `post` hands a message straight to the receiving
    worker's inbox (stage `dead`, if given, never answers: its messages are lost).
    `swap`: CheckFree+'s execution order (odd micro-batches visit the edge stages twice).
    `sent`: a list to record (from, kind, to, mb, hop) of every message in."""
    from node.ml.pipeline.runner import StageOptim, StageRunner
    from node.ml.pipeline.stages import build_stages
    from node.ml.trainer.models import GPTConfig

    config = GPTConfig(d_model=d_model, n_layers=stages, n_heads=2, context=16)
    built = build_stages(config, [1] * stages, seed=0)
    built[-1].set_tied(built[0].wte.weight)
    inboxes = [Inbox(64) for _ in range(stages)]
    stop = threading.Event()
    text = torch.tensor(list(b"abcabcabcabcabcabcabcabc" * 40))
    gen = torch.Generator().manual_seed(0)

    def batches():
        ix = torch.randint(0, len(text) - 17, (4,), generator=gen)
        w = torch.stack([text[i:i + 17] for i in ix])
        return w[:, :-1], w[:, 1:]

    progress = [TrainingStats() for _ in range(stages)]
    workers: list[StageWorker] = []
    sent = sent if sent is not None else []

    def post_from(src: int):
        def post(to, kind, stage, step, mb, hop, tensor, origin):
            sent.append((src, kind, stage, mb, hop))
            dest = stage  # one host per stage: the receiver's stage names it
            if to[0] == "peer":
                assert int(to[1]) == stage  # gradients go back to whoever sent the input
            if dest == dead:
                if kind in ("act", "tgt"):
                    inboxes[src].offer(Lost(kind, step, mb, f"stage {dead} is dead", origin))
                return
            inboxes[dest].offer(Message(kind, step, mb, tensor.detach().clone(), str(src), hop,
                                        origin))
        return post

    for s in range(stages):
        runner = StageRunner(built[s], StageOptim(lr=3e-3), max_in_flight=8)
        workers.append(StageWorker(runner, stages, micro_batches, inboxes[s], post_from(s),
                                   stop, progress=progress[s],
                                   batches=batches if s == 0 else None, first_wait_s=10.0,
                                   layers=[1] * stages, swap=swap))
    return workers, progress, stop


def run_until(workers, stop, done, timeout=120):
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        deadline = threading.Event()
        for _ in range(int(timeout * 10)):
            if done():
                break
            deadline.wait(0.1)
        else:
            raise AssertionError("the pipeline did not get there in time")
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def train_losses(workers, progress, stop, steps: int = 40) -> list[float]:
    """Run the wired workers for `steps` steps; the last stage's losses as they changed."""
    losses: list[float] = []

    def done():
        loss = progress[-1].loss
        if loss is not None and (not losses or losses[-1] != loss):
            losses.append(loss)
        return progress[0].step >= steps
    run_until(workers, stop, done)
    return losses


def test_stage_workers_train_a_gpt_across_four_stages_and_its_loss_falls():
    workers, progress, stop = wire_pipeline(4)
    losses = train_losses(workers, progress, stop)
    assert losses[-1] < losses[0] - 0.5, losses
    # (no drop count here: a loaded machine may push a step past its deadline)
    # the tied matrix went back and forth: the last stage's copy is the owner's
    torch.testing.assert_close(workers[-1].runner.stage.tied.detach().to(torch.bfloat16).float(),
                               workers[0].runner.stage.wte.weight.detach().to(
                                   torch.bfloat16).float(), atol=0.02, rtol=0.02)


def test_with_checkfree_plus_odd_micro_batches_visit_the_edge_stages_in_swapped_order():
    """CheckFree+ live: micro-batch 1 goes embedding (0) -> blocks of 1, 0, 3, 2 -> head (3)
    and its gradients back the same way; the loss still falls and every stage steps."""
    sent: list[tuple] = []
    workers, progress, stop = wire_pipeline(4, swap=True, sent=sent)
    losses = train_losses(workers, progress, stop)
    assert losses[-1] < losses[0] - 0.5, losses
    acts = {(src, to, hop) for src, kind, to, mb, hop in sent
            if kind == "act" and mb == 1}
    assert acts == {(0, 1, 1), (1, 0, 2), (0, 3, 3), (3, 2, 4), (2, 3, 5)}
    grads = {(src, to, hop) for src, kind, to, mb, hop in sent
             if kind == "grad" and mb == 1}
    assert grads == {(3, 2, 4), (2, 3, 3), (3, 0, 2), (0, 1, 1), (1, 0, 0)}
    assert {(src, to) for src, kind, to, mb, _ in sent
            if kind == "act" and mb == 0} == {(0, 1), (1, 2), (2, 3)}
    assert all(w.stats.steps >= 30 for w in workers[1:])


def test_a_dead_stage_costs_micro_batches_never_a_stall_and_its_steps_are_paced():
    """Every micro-batch lost at once (the next stage is dead): the driver goes on, but
    begins its next step no sooner than MIN_WAIT_S after the last one began. Unpaced, a
    first stage's counter ran from 251 to 7055 in 3 minutes and the other stages jumped
    to it (issue 27)."""
    from node.pipe.deadlines import MIN_WAIT_S

    workers, progress, stop = wire_pipeline(3, dead=1)
    t0 = time.monotonic()
    run_until(workers, stop, lambda: progress[0].step >= 2)
    assert time.monotonic() - t0 >= MIN_WAIT_S  # the second step began MIN_WAIT_S later
    assert workers[0].stats.dropped >= 2 * 2  # every micro-batch of those steps lost
    assert workers[0].stats.micro_batches == 0


def test_a_gradient_that_does_not_fit_its_micro_batch_costs_that_micro_batch_only():
    """Stage 2 sends stage 1 gradients of the wrong batch for micro-batch 0: the wire's
    bounds allow the shape, the saved activations do not; stage 1 drops it and goes on."""
    workers, progress, stop = wire_pipeline(3)
    post = workers[2].post

    def corrupt(to, kind, stage, step, mb, hop, tensor, origin):
        if kind == "grad" and mb == 0:
            tensor = tensor[:1]
        post(to, kind, stage, step, mb, hop, tensor, origin)
    workers[2].post = corrupt
    run_until(workers, stop, lambda: progress[0].step >= 3)
    assert workers[1].stats.dropped >= 3 and "refused" in workers[1].stats.last_reason
    assert workers[1].stats.micro_batches >= 3  # micro-batch 1 of every step went through


def test_a_first_stage_behind_the_swarm_gives_its_step_up_at_once():
    """A head gradient for step 5 reaches a first-stage replica still at step 0: the last
    stage has finished step 5, so our step-0 micro-batches were refused there as stale.
    The replica drops them at once (not after its deadline) and goes on at step 6, the
    tied matrix it sends marked for step 6: two replicas a step apart otherwise lost
    every step, each a deadline long (tests/swarm/test_pipeline_replicas.py, stop 27's CI)."""
    workers, _, _ = wire_pipeline(2)
    driver = workers[0]
    driver.first_wait_s = 60.0  # waiting it out would leave the step at 1
    tied_steps = []
    post = driver.post

    def record(to, kind, stage, step, mb, hop, tensor, origin):
        if kind == "tied":
            tied_steps.append(step)
        post(to, kind, stage, step, mb, hop, tensor, origin)
    driver.post = record
    wte = driver.runner.stage.wte.weight
    driver.inbox.offer(Message("tgrad", 5, 0, torch.zeros_like(wte), "1", 0))
    driver.drive_step()
    assert driver.step == 6 and tied_steps == [6]
    assert driver.stats.dropped == 2 and "the swarm is at step 6" in driver.stats.last_reason


def test_a_first_stage_waits_for_the_head_gradient_of_every_last_stage_host():
    """With two last-stage hosts a first-stage replica takes its step once both have sent
    their head gradient, each added once: on the first alone, its next micro-batches could
    overtake another replica's last one at the other host, which refused that one as
    stale (a lost micro-batch, then a deadline for every host)."""
    workers, _, _ = wire_pipeline(2)
    driver = workers[0]
    driver.first_wait_s = 60.0
    driver.last_hosts = lambda step: 2
    wte = driver.runner.stage.wte.weight
    added = []
    add = driver.runner.stage.add_tied_grad
    driver.runner.stage.add_tied_grad = lambda g: (added.append(float(g[0, 0])), add(g))

    def last_stage(to, kind, stage, step, mb, hop, tensor, origin):  # answers at once
        if kind == "act":
            driver.inbox.offer(Message("grad", step, mb, torch.ones_like(tensor), "1", 0))
            if mb == driver.M - 1:  # both hosts finish the step; X's gradient comes twice
                for sender, g in (("X", 1.0), ("X", 1.0), ("Y", 2.0)):
                    driver.inbox.offer(Message("tgrad", step, 0, torch.full_like(wte, g),
                                               sender, 0))
    driver.post = last_stage
    driver.drive_step()
    assert driver.step == 1 and sorted(added) == [1.0, 2.0]
    assert driver.inbox.qsize() == 0 and driver.stats.dropped == 0


@pytest.mark.parametrize("norm", [-1.0, float("inf"), float("nan"), 1e9, "0.5"])
def test_an_absurd_gossiped_gradient_norm_refuses_the_rebuild(norm):
    from node.ml.recovery.checkfree import BadGradNorm, plan

    workers, _, _ = wire_pipeline(3)
    mid = workers[1]
    before = {k: v.clone() for k, v in mid.runner.stage.blocks_state().items()}
    blocks = {0: workers[0].runner.stage.blocks_state(), 2: workers[2].runner.stage.blocks_state()}
    with pytest.raises(BadGradNorm):
        mid.rebuild(plan(1, [1, 1, 1], "checkfree"), blocks, {0: norm, 2: 0.5}, 1.0, 1.1)
    after = mid.runner.stage.blocks_state()
    assert all(torch.equal(before[k], after[k]) for k in before)  # untouched


def test_a_rebuild_weighs_the_neighbours_by_their_norms_with_a_fresh_boosted_adam():
    from node.ml.recovery.checkfree import plan

    workers, _, _ = wire_pipeline(3)
    mid = workers[1]
    prev, nxt = workers[0].runner.stage.blocks_state(), workers[2].runner.stage.blocks_state()
    mid.rebuild(plan(1, [1, 1, 1], "checkfree"), {0: prev, 2: nxt}, {0: 0.3, 2: 0.1}, 1.0, 1.1)
    w0, w2 = (0.3 + 1e-4) / (0.4 + 2e-4), (0.1 + 1e-4) / (0.4 + 2e-4)
    got = mid.runner.stage.blocks_state()
    for k in got:
        torch.testing.assert_close(got[k], w0 * prev[k] + w2 * nxt[k])
    assert mid.runner.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 1.1)
    assert not mid.runner.optimizer.state  # fresh moments


# -- micro-batches named by their origin --------------------------------------------------

def serve_two_origins(worker, messages, grads_for=None):
    """Run `worker` (a serving stage told that a step brings it both first-stage
    replicas' micro-batches) on `messages`, answering each activation it forwards with a
    gradient from `grads_for`'s sender; what it posted."""
    posted: list[tuple] = []

    def post(to, kind, stage, step, mb, hop, tensor, origin):
        posted.append((to, kind, step, mb, hop, origin))
        if kind == "act" and grads_for is not None:
            worker.inbox.offer(Message("grad", step, mb, torch.ones_like(tensor), grads_for,
                                       hop - 1, origin))
    worker.post = post
    worker.arrivals = lambda step: 2 * worker.M
    for m in messages:
        worker.inbox.offer(m)
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        wait_until(lambda: worker.stats.steps >= 1, 60, "the stage's step")
    finally:
        worker.stop.set()
        thread.join(30)
    return posted


def test_micro_batches_of_one_index_from_two_first_stage_replicas_both_go_through():
    """Two first-stage replicas, one host left at stage 1: it gets micro-batch 0 of step 0
    from both. Keyed by (micro-batch, visit) the second was a duplicate, refused as stale
    every step (issue 27: 2.2 -> 0.2 steps/s after one replica of a 3x2 pipeline died);
    keyed by origin both are served, each gradient goes back to its own sender, and the
    stage steps once all four are back, not after its deadline."""
    workers, _, _ = wire_pipeline(3)
    mid = workers[1]
    x = torch.randn(2, 16, 16)
    acts = [Message("act", 0, mb, x + i, sender, 1, origin)
            for i, (sender, origin) in enumerate((("pa", "A"), ("pb", "B")))
            for mb in range(2)]
    posted = serve_two_origins(mid, acts, grads_for="p2")
    assert sorted((to[1], mb, origin) for to, kind, _, mb, _, origin in posted
                  if kind == "grad") == [("pa", 0, "A"), ("pa", 1, "A"), ("pb", 0, "B"),
                                         ("pb", 1, "B")]
    assert sorted((mb, origin) for _, kind, _, mb, _, origin in posted
                  if kind == "act") == [(0, "A"), (0, "B"), (1, "A"), (1, "B")]
    assert (mid.stats.micro_batches, mid.stats.stale, mid.stats.dropped) == (4, 0, 0)
    assert mid.runner.in_flight == 0


def test_the_last_stage_pairs_activations_and_targets_of_the_same_origin():
    workers, _, _ = wire_pipeline(2)
    last = workers[1]
    x, y = torch.randn(2, 16, 16), torch.randint(0, 256, (2, 16))
    msgs = []
    for sender, origin in (("pa", "A"), ("pb", "B")):
        for mb in range(2):
            msgs += [Message("act", 0, mb, x, sender, 1, origin),
                     Message("tgt", 0, mb, y, sender, 1, origin)]
    posted = serve_two_origins(last, msgs)
    assert sorted((to[1], mb, origin) for to, kind, _, mb, _, origin in posted
                  if kind == "grad") == [("pa", 0, "A"), ("pa", 1, "A"), ("pb", 0, "B"),
                                         ("pb", 1, "B")]
    assert (last.stats.micro_batches, last.stats.stale) == (4, 0)
    assert [kind for _, kind, *_ in posted].count("tgrad") == 1


def wire_replicas(counts: list[int], micro_batches: int = 4, seed: int = 0):
    """Workers for `counts[s]` replicas of each stage, one thread each, their messages
    routed as the service routes them (placement: next_replica, last_replica, the tied
    matrix from first-stage replica r to the last replicas q with q % R0 == r), each
    serving stage told its step's arrivals (placement.arrivals)."""
    from node.ml.pipeline.runner import StageOptim, StageRunner
    from node.ml.pipeline.stages import build_stages
    from node.ml.trainer.models import GPTConfig
    from node.pipe import placement

    n, M = len(counts), micro_batches
    smap = [[f"s{s}r{r}" for r in range(c)] for s, c in enumerate(counts)]
    config = GPTConfig(d_model=16, n_layers=n, n_heads=2, context=16)
    inboxes = {p: Inbox(4 * M + 8) for row in smap for p in row}
    stop = threading.Event()
    text = torch.tensor(list(b"abcabcabcabcabcabcabcabc" * 40))
    paths = [list(range(n))] * M
    workers: dict[str, StageWorker] = {}

    def post_from(me: str, s: int, r: int):
        def post(to, kind, stage, step, mb, hop, tensor, origin):
            if to[0] == "peer":
                peers = [to[1]]
            elif to[0] == "next":
                h = to[3]
                q = placement.next_replica(seed, step, mb, h, r, counts[h], counts[h + 1],
                                           "random")
                peers = [smap[h + 1][q]]
            elif to[0] == "last":
                peers = [smap[-1][placement.last_replica(seed, step, mb, r, counts, "random")]]
            elif kind == "tied":
                peers = [q for i, q in enumerate(smap[-1]) if i % counts[0] == r]
            else:
                peers = list(smap[to[1]])
            for p in peers:
                inboxes[p].offer(Message(kind, step, mb, tensor.detach().clone(), me, hop,
                                         origin))
        return post

    for s, row in enumerate(smap):
        for r, me in enumerate(row):
            built = build_stages(config, [1] * n, seed=0)
            built[-1].set_tied(built[0].wte.weight)
            gen = torch.Generator().manual_seed(r)

            def batches(gen=gen):
                ix = torch.randint(0, len(text) - 17, (4,), generator=gen)
                w = torch.stack([text[i:i + 17] for i in ix])
                return w[:, :-1], w[:, 1:]

            workers[me] = StageWorker(
                StageRunner(built[s], StageOptim(lr=3e-3), max_in_flight=4 * M + 8), n, M,
                inboxes[me], post_from(me, s, r), stop, progress=TrainingStats(),
                batches=batches if s == 0 else None, first_wait_s=30.0, layers=[1] * n,
                origin=me, last_hosts=lambda step: len({
                    placement.last_replica(seed, step, k, q, counts, "random")
                    for k in range(M) for q in range(counts[0])}),
                arrivals=lambda step, s=s, r=r: placement.arrivals(
                    seed, step, paths, counts, "random", s, r),
                leader_step=lambda: max(workers[p].step for p in smap[0]))
    return workers, stop


def test_a_stage_left_with_one_of_two_replicas_serves_both_and_feeds_both_next():
    """3 stages, 2 replicas of the first and the last, one of stage 1 (its other host
    lost). The survivor serves both first-stage replicas' micro-batches (keyed by
    (micro-batch, visit) the second of each index was stale: 2.2 -> 0.2 steps/s, issue 27)
    and hands them on to both last-stage replicas (as `r % R_next` one got nothing and
    froze). Every worker trains."""
    workers, stop = wire_replicas([2, 1, 2])
    first = [workers["s0r0"], workers["s0r1"]]
    run_until(list(workers.values()), stop, lambda: min(w.step for w in first) >= 8)
    lone = workers["s1r0"]
    assert lone.stats.micro_batches > max(w.stats.micro_batches for w in first)
    assert all(workers[p].stats.micro_batches > 0 for p in ("s2r0", "s2r1"))
    assert lone.stats.stale <= 2  # a late message under load, never one per step
