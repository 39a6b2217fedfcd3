"""The training service's delayed-application rule, with a real (tiny) trainer in its thread."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import trio

from node.ml.optim.noloco import NoLoCo, NoLoCoConfig
from node.ml.trainer.loop import TrainConfig, Trainer
from node.ml.trainer.tasks import TaskConfig, build_task
from node.process.priority import TRAINER_NICE
from node.training.outer_rounds import OuterRounds
from node.training.rounds import Outcome, TrainingStats
from node.training.service import TrainingService
from tests.conftest import await_until

H = 5


def build(seed: int = 0):
    def make():
        trainer = Trainer(build_task(TaskConfig(name="digits-mlp")),
                          TrainConfig(batch_size=16, eval_every=0, seed=seed, warmup_steps=1))
        return trainer, NoLoCo(trainer.parameters_vector(), NoLoCoConfig()), H
    return make


def gated(make, answered: dict[int, threading.Event], token: trio.lowlevel.TrioToken):
    """`make` with a trainer that, before the last step of an answered round r, waits until
    round r's outcome is queued. Without it "answers at once" is a race: the trio thread
    must run the exchange before the trainer thread does H more (millisecond) steps, and on
    a loaded machine it sometimes did not (the round was then closed locally)."""

    def build_gated():
        trainer, outer, h = make()
        step = trainer.step

        def gated_step():
            r = (trainer.step_count + 2) // h - 1  # the next step is round r + 1's last but one
            if (trainer.step_count + 2) % h == 0 and r in answered:
                assert answered[r].wait(60), f"round {r}'s exchange never ran"
                # The exchange set the event in the same trio task step that queued its
                # outcome: once the trio loop runs anything else, the outcome is queued.
                trio.from_thread.run_sync(lambda: None, trio_token=token)
            return step()

        trainer.step = gated_step
        return trainer, outer, h

    return build_gated


async def train_to_the_end(service: TrainingService) -> None:
    """Run the service until its trainer reaches max_steps (bounded)."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.run)
            await await_until(lambda: service.stats.phase == "done", 60, "training to end")
            nursery.cancel_scope.cancel()


async def test_outcomes_are_applied_and_late_rounds_fall_back_to_local_steps():
    seen: list[int] = []
    answered = {r: threading.Event() for r in (1, 3, 5)}

    async def exchange(r: int, snapshot: torch.Tensor) -> Outcome:
        seen.append(r)
        if r % 2:  # odd rounds: a partner that answers at once
            answered[r].set()
            return Outcome(r, [snapshot + 1.0], partner="peer-a")
        await trio.sleep_forever()  # even rounds: a partner that never answers

    service = TrainingService(gated(build(), answered, trio.lowlevel.current_trio_token()),
                              exchange, max_steps=6 * H)
    await train_to_the_end(service)
    st = service.stats
    assert st.step == 6 * H
    assert seen == [1, 2, 3, 4, 5, 6]
    # Odd rounds were averaged; even rounds were closed locally one round later, except the
    # last round, which was still pending when training stopped.
    assert st.rounds_averaged == 3 and st.last_partner == "peer-a"
    assert st.rounds_local == 2
    assert st.compute_s > 0 and 0 < st.snapshot()["compute_fraction"] <= 1


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not hasattr(os, "getpriority") or sys.platform != "linux",
                    reason="per-thread nice is Linux's")
@pytest.mark.parametrize("threads", [1, 2])
async def test_the_build_and_a_one_thread_first_step_run_at_the_node_priority(threads):
    """The end of a join (build, first step) is not niced; the training after it is. A
    trainer of several torch threads is niced before its first step (its worker threads
    keep the nice they start with), and the build runs outside the trainer thread."""
    base = _nice()
    seen: dict[str, object] = {}

    def make():
        seen["build"] = (threading.current_thread().name, _nice())
        trainer = Trainer(build_task(TaskConfig(name="digits-mlp")),
                          TrainConfig(batch_size=16, eval_every=0, threads=threads))
        step = trainer.step

        def recorded_step():
            seen.setdefault("steps", []).append(_nice())
            return step()

        trainer.step = recorded_step
        return trainer, None, H

    service = TrainingService(make, None, max_steps=3)
    await train_to_the_end(service)
    name, build_nice = seen["build"]
    assert name.startswith("peertrain-build") and build_nice == base
    niced = min(base + TRAINER_NICE, 19)
    first = base if threads == 1 else niced
    assert seen["steps"] == [first, niced, niced]


def test_applied_outer_step_keeps_progress_made_since_the_snapshot():
    """θ ← φ + (θ_now − θ_r): an outcome applied late moves the weights by φ − θ_r only;
    one for a round already closed locally is dropped."""
    trainer, outer, _ = build()()
    stats = TrainingStats()
    rounds = OuterRounds(outer, trainer.parameters_vector, trainer.set_parameters_vector, stats)
    snapshot = rounds.open(1)
    trainer.step()
    trainer.step()
    live = trainer.parameters_vector()
    expected_phi = NoLoCo(snapshot.clone(), NoLoCoConfig()).outer_step(snapshot, [snapshot + 2.0])
    rounds.deliver(Outcome(1, [snapshot + 2.0], peers=("a",)))
    rounds.apply()
    assert torch.allclose(trainer.parameters_vector(), expected_phi + (live - snapshot), atol=1e-6)
    assert (stats.rounds_averaged, stats.rounds_local, rounds.pending) == (1, 0, {})
    rounds.open(2)
    rounds.open(3)  # round 2 closed locally: its outcome comes too late
    rounds.deliver(Outcome(2, [snapshot], peers=("a",)))
    rounds.apply()
    assert (stats.rounds_averaged, stats.rounds_local, list(rounds.pending)) == (1, 1, [3])


def test_checkpoint_tensors_restore_the_trainer_and_outer_state_exactly():
    """One state format: the trainer's and NoLoCo's state_dict, through safetensors' flat
    name -> tensor map (node/training/state.py), resume bit for bit."""
    from safetensors.torch import load, save

    from node.training.state import checkpoint_tensors, restore_checkpoint

    trainer, outer, _ = build(seed=3)()
    for _ in range(3):
        trainer.step()
    outer.outer_step(trainer.parameters_vector(), [trainer.parameters_vector() + 1.0])
    tensors = load(save(checkpoint_tensors(trainer, outer)))  # as the store writes them

    resumed, resumed_outer, _ = build(seed=4)()  # other weights, to be overwritten
    restore_checkpoint(resumed, resumed_outer, tensors)
    assert resumed.step_count == trainer.step_count == 3
    assert torch.equal(resumed_outer.phi, outer.phi) and torch.equal(resumed_outer.m, outer.m)
    assert torch.equal(resumed.parameters_vector(), trainer.parameters_vector())
    assert resumed.step().loss == trainer.step().loss  # same data stream, same moments
    assert torch.equal(resumed.parameters_vector(), trainer.parameters_vector())


def test_a_tied_embedding_is_stored_once_and_stays_tied(tmp_path):
    """The byte GPT ties lm_head to wte; safetensors refuses two names for one memory."""
    from node.checkpoints.store import CheckpointStore
    from node.training.state import checkpoint_tensors, restore_checkpoint

    def gpt(seed: int) -> Trainer:
        task = build_task(TaskConfig(name="bytes-gpt", d_model=32, n_layers=1, n_heads=2,
                                     context=32))
        return Trainer(task, TrainConfig(batch_size=2, eval_every=0, seed=seed))

    trainer = gpt(0)
    trainer.step()
    store = CheckpointStore(tmp_path)
    cid = store.save("run", 1, checkpoint_tensors(trainer, None))
    resumed = gpt(1)
    restore_checkpoint(resumed, None, store.load(cid)[1])
    assert resumed.model.lm_head.weight is resumed.model.wte.weight
    assert torch.equal(resumed.parameters_vector(), trainer.parameters_vector())


async def test_a_node_that_jumps_to_the_swarm_round_still_checkpoints():
    """Joining the swarm's round moves the step past a checkpoint step without computing it
    (0 to 19 here); the checkpoint is then written at the next step, not a whole interval
    later (seen under churn: a restarted node went 169 steps without one)."""
    snapshots: list[int] = []

    async def keep(snapshot) -> None:
        snapshots.append(snapshot.step)

    service = TrainingService(build(), exchange=None, max_steps=25, checkpoint_every=10,
                              on_snapshot=keep)
    service.swarm_step = 20  # the swarm is four rounds (H = 5) ahead: jump from 0 to 19
    with trio.fail_after(60):
        await service.run()
    assert service.stats.step == 25
    assert snapshots == [20]  # 10 was jumped over, never computed; 30 is past the end


async def test_a_node_that_jumps_lands_on_the_swarm_boundary_and_exchanges_there():
    """A node behind the swarm continues one step before the swarm's last round boundary,
    so its next step reaches that boundary and it meets the partners waiting there: landing
    on the boundary's step itself skipped that round's exchange."""
    rounds: list[int] = []

    async def exchange(r: int, snapshot) -> Outcome:
        rounds.append(r)
        return Outcome(r, [])

    service = TrainingService(build(), exchange=exchange, max_steps=3 * H + 1)
    service.swarm_step = 2 * H + 2  # past round 2's boundary (step 10), before round 3's
    with trio.fail_after(60):
        await service.run()
    assert rounds[0] == 2  # the swarm's last boundary, not the one after it


async def test_an_attacker_trains_its_poison_then_follows_the_swarm_with_that_model():
    """A testnet sybil trains `poison_steps`, then sends that very model at every round
    boundary the swarm crosses (its identities stay bit-identical without training in
    lockstep); its step follows the swarm's and never leads it."""
    sent: dict[int, torch.Tensor] = {}
    trained: list[int] = []
    follow = trio.Event()

    async def exchange(r: int, snapshot) -> Outcome:
        sent[r] = snapshot
        if r == 2:  # the poison is trained: the swarm is in round 5 by now
            service.swarm_step = 5 * H + 2
        if r == 5:
            follow.set()
        return Outcome(r, [])

    def attacker():
        from node.ml.optim.gossip import GossipLearning, layout_of

        trainer, _, h = build()()
        step = trainer.step

        def counted():
            trained.append(trainer.step_count)
            return step()

        trainer.step = counted
        return trainer, GossipLearning(layout_of(trainer.model), aggregator=None), h

    service = TrainingService(attacker, exchange=exchange, poison_steps=2 * H)
    # A round ahead from the start (an honest node would jump to step 2H - 1): the poison is
    # trained all the same. No further: past 2H, what it follows is set at round 2 above.
    service.swarm_step = 2 * H
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.run)
            await follow.wait()
            nursery.cancel_scope.cancel()
    assert trained == list(range(2 * H))  # no step skipped while poisoning, none after
    assert sorted(sent) == [1, 2, 5]  # the swarm's round, straight from the poison's end
    assert torch.equal(sent[5], sent[2])  # the model sent is the poisoned one, as it is
    assert service.stats.step == 5 * H + 2 == service.swarm_step  # with the swarm, not ahead


async def test_diloco_waits_for_each_all_reduce_and_steps_on_the_mean():
    """DiLoCo's trainer takes no inner step while a round's all-reduce is out: the exchange
    sees the trainer's step frozen at the boundary, and the model is φ after it."""
    from node.ml.optim.diloco import DiLoCoConfig, SwarmDiLoCo

    holder: dict = {}

    def make():
        trainer = Trainer(build_task(TaskConfig(name="digits-mlp")),
                          TrainConfig(batch_size=16, eval_every=0, seed=0, warmup_steps=1))
        holder["trainer"] = trainer
        return trainer, SwarmDiLoCo(trainer.parameters_vector(), DiLoCoConfig()), H

    steps_during: list[int] = []

    async def allreduce(r: int, snapshot: torch.Tensor) -> Outcome:
        before = holder["trainer"].step_count
        await trio.sleep(0.3)  # a slow all-reduce: the trainer must not move meanwhile
        steps_during.append(holder["trainer"].step_count - before)
        return Outcome(r, [snapshot + 0.01], partner="peer-a")

    service = TrainingService(make, allreduce, max_steps=3 * H)
    await train_to_the_end(service)
    st = service.stats
    assert steps_during == [0, 0, 0] and st.rounds_averaged == 3 and st.rounds_local == 0
    assert st.sync_wait_s >= 0.9  # three waits of 0.3 s, apart from compute
    torch.testing.assert_close(holder["trainer"].parameters_vector(), service.outer.phi)


def test_swarm_diloco_steps_on_phi_minus_the_mean_and_alone_on_its_own_delta():
    from node.ml.optim.diloco import DiLoCo, DiLoCoConfig, SwarmDiLoCo

    init = torch.zeros(4)
    thetas = [torch.tensor([1.0, 2, 3, 4]), torch.tensor([3.0, 2, 1, 0])]
    mean = torch.stack(thetas).mean(0)
    ref = DiLoCo(init, DiLoCoConfig())
    ref.outer_step([ref.pseudo_gradient(t) for t in thetas])  # the in-process baseline
    swarm = SwarmDiLoCo(init, DiLoCoConfig())
    torch.testing.assert_close(swarm.outer_step(thetas[0], [mean]), ref.phi)
    alone = SwarmDiLoCo(init, DiLoCoConfig())
    solo = DiLoCo(init, DiLoCoConfig())
    solo.outer_step([solo.pseudo_gradient(thetas[0])])
    torch.testing.assert_close(alone.outer_step(thetas[0], []), solo.phi)
