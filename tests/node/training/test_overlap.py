"""Rounds that never wait (issue 29 item 3): the late outer step's rule by hand, the span
policy, and the training service spanning several base rounds with one exchange."""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from node.ml.optim.noloco import NoLoCo, NoLoCoConfig
from node.ml.optim.overlap import apply_late
from node.ml.trainer.loop import TrainConfig, Trainer
from node.ml.trainer.tasks import TaskConfig, build_task
from node.training.rounds import MAX_SPAN, Outcome, TrainingStats, span_for, swarm_span
from node.training.service import TrainingService
from tests.conftest import await_until


def test_two_overlapped_noloco_rounds_match_the_hand_computed_values():
    """η = μ = 0.5, φ0 = 0. Each exchange lands after the trainer moved on; the progress
    made meanwhile survives the outer step (docs/training.md, "Spans")."""
    outer = NoLoCo(torch.zeros(2), NoLoCoConfig(outer_lr=0.5, momentum=0.5))
    # boundary 1: θ_r = (1, 2), the partner's (3, 0); mean (2, 1)
    # m = 0.5·(2, 1) = (1, 0.5); φ = (1, 0.5)
    snapshot = torch.tensor([1.0, 2.0])
    phi = outer.outer_step(snapshot, [torch.tensor([3.0, 0.0])])
    assert phi.tolist() == [1.0, 0.5]
    # it lands when the live weights are (1.5, 2.5): progress (0.5, 0.5) is kept
    live = apply_late(torch.tensor([1.5, 2.5]), snapshot, phi)
    assert live.tolist() == [1.5, 1.0]
    # boundary 2: θ_r = (2, 1), partner (2, 3); mean (2, 2)
    # m = 0.5·(1, 0.5) + 0.5·((2, 2) − (1, 0.5)) = (1, 1); φ = (2, 1.5)
    snapshot = torch.tensor([2.0, 1.0])
    phi = outer.outer_step(snapshot, [torch.tensor([2.0, 3.0])])
    assert phi.tolist() == [2.0, 1.5] and outer.m.tolist() == [1.0, 1.0]
    # lands at (2.25, 0.75): progress (0.25, −0.25)
    assert apply_late(torch.tensor([2.25, 0.75]), snapshot, phi).tolist() == [2.25, 1.25]


def test_apply_late_refuses_vectors_of_different_sizes():
    with pytest.raises(ValueError, match="shapes differ"):
        apply_late(torch.zeros(3), torch.zeros(3), torch.zeros(4))


def test_the_span_is_the_smallest_power_of_two_that_holds_the_exchange():
    # an 86M bf16 exchange at 100 Mbit/s (14 s) behind 50 H100 steps (1.8 s): 16 rounds
    assert span_for(14.0, 1.79) == 16
    assert span_for(0.3, 1.79) == 1  # a compressed exchange fits one round
    assert span_for(1.0, 1.0) == 2  # 75% of a round at most
    assert span_for(1e6, 1.0) == MAX_SPAN
    # hysteresis: from 8 it shrinks only once the smaller span holds it with 20% to spare
    assert span_for(2.5, 1.0, current=8) == 8  # wants 4, but 2.5 > 0.8·0.75·4
    assert span_for(2.3, 1.0, current=8) == 4
    with pytest.raises(ValueError):
        span_for(1.0, 0.0)


def test_the_swarm_span_is_the_peers_median_or_our_own():
    assert swarm_span(1, [None, 8, 4, 4]) == 4  # upper median of 4, 4, 8
    assert swarm_span(2, [1, 1, 1]) == 2  # our own link needs more: kept
    assert swarm_span(1, []) == 1
    assert swarm_span(4, [3, -8, 2 * MAX_SPAN, "16", 8.0, True]) == 4  # junk ignored


def test_one_hostile_heartbeat_cannot_set_the_swarms_span():
    assert swarm_span(1, [1, 1, MAX_SPAN]) == 1
    assert swarm_span(1, [1, MAX_SPAN, MAX_SPAN]) == MAX_SPAN  # a majority can


H = 5


async def test_one_exchange_spans_several_rounds_and_lands_late_without_a_wait():
    """Span 4: exchanges start only at rounds 4, 8, 12; round 4's partner answers only once
    the trainer is two base rounds further (it never waited for it), and the outcome is
    still applied, not closed locally."""
    token = trio.lowlevel.current_trio_token()
    answered = {4: threading.Event(), 8: threading.Event()}
    gates = {38: answered[4], 58: answered[8]}  # step count before which the answer is in

    def make():
        trainer = Trainer(build_task(TaskConfig(name="digits-mlp")),
                          TrainConfig(batch_size=16, eval_every=0, seed=0, warmup_steps=1))
        step = trainer.step

        def gated():
            # Without this, "lands before round 8" would race the trio thread on a loaded
            # machine; the wait is the test's, after the trainer already ran ahead.
            if (event := gates.get(trainer.step_count)) is not None:
                assert event.wait(60), f"no answer before step {trainer.step_count + 1}"
                trio.from_thread.run_sync(lambda: None, trio_token=token)
            return step()

        trainer.step = gated
        return trainer, NoLoCo(trainer.parameters_vector(), NoLoCoConfig()), H

    seen: list[int] = []
    late_by: dict[int, int] = {}

    async def exchange(r: int, snapshot: torch.Tensor) -> Outcome:
        seen.append(r)
        if r == 4:
            await await_until(lambda: service.stats.step >= 30, 60, "two more base rounds")
        if r in answered:
            late_by[r] = service.stats.step - r * H
            answered[r].set()
            return Outcome(r, [snapshot + 1.0], partner="peer-a", peers=("peer-a",))
        await trio.sleep_forever()  # round 12: still out when training stops

    service = TrainingService(make, exchange, max_steps=60, span=4)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.run)
            await await_until(lambda: service.stats.phase == "done", 60, "training to end")
            nursery.cancel_scope.cancel()
    st = service.stats
    assert seen == [4, 8, 12]
    assert late_by[4] >= 2 * H  # the trainer ran on while round 4's exchange was out
    assert st.rounds_averaged == 2 and st.rounds_local == 0
    assert st.step == 60


def test_the_averager_estimates_an_exchange_from_its_codec_then_measures_it():
    from libp2p.crypto.ed25519 import create_new_key_pair

    from node.averaging.estimates import PRIOR_WIRE_BYTES_PER_S
    from node.averaging.service import Averager
    from p2p.host import Substrate

    sub = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    avg = Averager(sub, "run", sub.peer_id.to_base58(), list, codecs=["bf16", "fp32"],
                   lanes=False)
    n = 86_000_000
    assert avg.expected_exchange_s(n) == pytest.approx(2 * 2 * n / PRIOR_WIRE_BYTES_PER_S)
    avg.estimates.record("peer", 8 * n, 10.0, ok=True)
    avg.estimates.record("peer", 8 * n, 20.0, ok=True)
    assert avg.expected_exchange_s(n) == pytest.approx(0.7 * 10.0 + 0.3 * 20.0)


def test_step_time_counts_the_steps_this_process_ran():
    st = TrainingStats(step=99, compute_s=0.0)  # resumed at 40, jumped to the swarm's 99
    assert st.step_time() == 0.2  # the prior, not 0 s
    st.steps_run, st.compute_s = 4, 2.0
    assert st.step_time() == 0.5
