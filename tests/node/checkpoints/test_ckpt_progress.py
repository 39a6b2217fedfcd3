"""A checkpoint claims only the progress its weights have (issue 26, item 2): a joiner whose
pull failed follows the swarm's round clock but its checkpoints claim the steps it trained;
a joiner checks a pulled checkpoint's claim (its validation loss against the swarm's) and
takes the next one when the claim fails. Real libp2p hosts on loopback, real trainers."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.checkpoints import exchange as ckpt_sync
from node.checkpoints import service as ckpt_service
from node.checkpoints.store import CheckpointStore
from node.membership.view import Membership
from node.ml.optim.noloco import NoLoCo, NoLoCoConfig
from node.ml.trainer.loop import TrainConfig, Trainer
from node.ml.trainer.tasks import TaskConfig, build_task
from node.training.rounds import Outcome, TrainingStats
from node.training.service import TrainingService
from node.training.state import checkpoint_tensors
from node.transport.transports import Transports
from p2p.host import Substrate
from protocols import ckpt_exchange as cx
from protocols import keys, rundoc
from protocols.heartbeat import Heartbeat
from tests.conftest import await_until, node_context

RUN = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
H = 5
SWARM_STEP = 1187  # the swarm's step in the log


def trainer() -> Trainer:
    return Trainer(build_task(TaskConfig(name="digits-mlp")),
                   TrainConfig(batch_size=16, eval_every=0, seed=0, warmup_steps=1))


def host() -> tuple[Substrate, keys.Signer]:
    kp = create_new_key_pair()
    return Substrate(kp, [LOOPBACK]), keys.Signer(kp.private_key.to_bytes()[:32])


def node_ctx(me: Substrate, signer: keys.Signer, doc: rundoc.RunDocument, state: Path,
             membership: Membership | None = None) -> SimpleNamespace:
    """What the checkpoint service reads of a node: its run, host, store, membership."""
    run = SimpleNamespace(run_id=RUN, document=doc, progress=TrainingStats(),
                          manifest=SimpleNamespace(checkpoint=SimpleNamespace(keep=3)))
    return node_context(run=run, substrate=me, peer_id=signer.peer_id,
                        transports=Transports(me), checkpoints=CheckpointStore(state),
                        membership=membership or Membership(signer.peer_id, 60.0))


def listed(doc: rundoc.RunDocument, writer: keys.Signer, cid: str, step: int) -> None:
    """`writer`'s announcement of `cid` at `step`, merged into `doc` (a replica of ours)."""
    theirs = rundoc.RunDocument(RUN, writer, [])
    doc.merge(theirs.set(rundoc.ckpt_key(writer.peer_id, cid),
                         {"hash": cid, "step": step, "size": 1}, time.time_ns() // 10**6),
              time.time_ns() // 10**6)


async def test_a_joiner_whose_pull_failed_writes_no_checkpoint_claiming_the_swarm_s_step(
        tmp_path: Path, monkeypatch):
    """The issue's log: three pulls fail, the joiner trains from the initial weights, jumps
    to the swarm's round ("continuing from step 1179") and saved "checkpoint at step 1180"
    into the run document, where the next joiner took it as the newest. Its round clock
    still follows the swarm (pairing needs it); its checkpoints claim what it trained."""
    monkeypatch.setattr(ckpt_service, "PULL_RETRY_S", 0.05)
    monkeypatch.setattr(ckpt_service, "PROVIDER_LOOKUP_S", 0.2)
    (writer_host, writer), (me, signer) = host(), host()
    # The writer is up and serves checkpoints, but no longer holds the one it announced.
    writer_host.set_handler(cx.PROTOCOL_ID, ckpt_sync.CheckpointServer(
        CheckpointStore(tmp_path / "writer")).handle)
    doc = rundoc.RunDocument(RUN, signer, [])
    gone = "QmTfNwBtXU2GLyWAnYf3Sv7XjEUGArFL3QjRoW2rMunVhh"
    listed(doc, writer, gone, SWARM_STEP - 7)
    ctx = node_ctx(me, signer, doc, tmp_path / "me")
    checkpoints = ckpt_service.CheckpointService(publish=lambda delta: None,
                                                 synced=trio.Event())
    checkpoints._synced.set()
    training = TrainingService(lambda: (lambda t: (t, NoLoCo(t.parameters_vector(),
                                                             NoLoCoConfig()), H))(trainer()),
                               exchange=None, checkpoint_every=10,
                               on_snapshot=checkpoints.save)
    training.swarm_step = SWARM_STEP
    async with trio.open_nursery() as nursery:
        for s in (writer_host, me):
            await nursery.start(s.serve)
        await me.connect(writer_host.addrs()[0])
        with trio.fail_after(60):
            await nursery.start(checkpoints.run, ctx)
            assert checkpoints.resume_from is None  # every pull failed: from scratch
            nursery.start_soon(training.run)
            await await_until(lambda: checkpoints.saved >= 3, 60, "three checkpoints")
        nursery.cancel_scope.cancel()
    assert training.stats.step > SWARM_STEP - H  # the round clock is the swarm's
    computed = training.stats.step - (SWARM_STEP // H * H - 1)
    mine = [(m.step, m.meta) for _, m in ctx.checkpoints.list(RUN)]
    assert mine and all(step <= computed for step, _ in mine), mine
    assert all(meta["clock"] > SWARM_STEP - H and meta["parent"] == "" for _, meta in mine)
    index = rundoc.checkpoint_index(doc)
    ours = [step for step, _, w in index if w == signer.peer_id]
    assert ours and all(step <= computed for step in ours), ours
    assert index[-1][1] == gone  # the newest listed is still the swarm's


def test_an_averaged_round_credits_the_group_s_mean_never_past_the_clock():
    """The weights of an averaged round move toward the group's mean, and so does what
    they claim: half the gap with one partner; a partner's inflated claim is capped by our
    clock; an unknown partner count changes nothing; a count never goes down."""
    service = TrainingService(lambda: None, exchange=None)
    st = service.stats
    st.step, st.trained = 1200, 20
    service._credit_averaging(Outcome(240, [torch.zeros(1)], peers=("a",),
                                      partner_trained=(1180,)))
    assert st.trained == 600
    service._credit_averaging(Outcome(241, [torch.zeros(1)], peers=("a",),
                                      partner_trained=(10**9,)))
    assert st.trained == 900  # (600 + 1200) / 2: the partner's claim capped at our clock
    service._credit_averaging(Outcome(242, [torch.zeros(1)], peers=("b",)))
    service._credit_averaging(Outcome(243, [torch.zeros(1)], peers=("c",),
                                      partner_trained=(0,)))
    assert st.trained == 900


def test_progress_refusal_needs_half_the_swarm_s_gain():
    from protocols.checkpoint import progress_refusal

    # the issue: initial weights ~ln(256), swarm at 2.0, a checkpoint at 5.395
    assert "5.395" in progress_refusal(5.395, 5.55, 2.0)
    assert progress_refusal(3.5, 5.55, 2.0) is None  # behind the swarm, but of it
    assert progress_refusal(float("nan"), 5.55, 2.0) is not None
    assert progress_refusal(5.6, 5.55, 5.6) is None  # nothing learnt yet: nothing to check


def heard(membership: Membership, peer: str, val: float, seq: int = 1) -> None:
    membership.heard(Heartbeat(peer, seq, (), "node", "cpu", {"step": SWARM_STEP, "val": val}))


async def test_a_joiner_does_not_take_a_checkpoint_whose_claim_fails_the_check(
        tmp_path: Path):
    """The newest listed checkpoint claims step 1180 and holds the run's initial weights;
    an older one holds trained weights. The joiner pulls the newest, measures it against
    the validation loss the live peers report, refuses it (dropped from its store: never
    resumed, never served) and takes the older one."""
    from node.checkpoints.vet import CheckpointVet

    trained = trainer()
    for _ in range(150):
        trained.step()
    swarm = trained.evaluate()
    fresh = trainer()
    assert fresh.evaluate() - swarm > 0.5  # the swarm has learnt something to check against
    (writer_host, writer), (me, signer) = host(), host()
    held = CheckpointStore(tmp_path / "writer")
    untrained = held.save(RUN, 1180, checkpoint_tensors(fresh, None))
    good = held.save(RUN, 1150, checkpoint_tensors(trained, None))
    writer_host.set_handler(cx.PROTOCOL_ID, ckpt_sync.CheckpointServer(held).handle)
    doc = rundoc.RunDocument(RUN, signer, [])
    listed(doc, writer, good, 1150)
    listed(doc, writer, untrained, 1180)
    membership = Membership(signer.peer_id, 60.0)
    for i, peer in enumerate(("peer-a", "peer-b", "peer-c")):
        heard(membership, peer, swarm + 0.01 * i)
    heard(membership, writer.peer_id, 9.0)  # the writer's own word is not asked
    ctx = node_ctx(me, signer, doc, tmp_path / "me", membership)
    vet = CheckpointVet(ctx, lambda: (fresh, None, H))
    checkpoints = ckpt_service.CheckpointService(publish=lambda delta: None,
                                                 synced=trio.Event(), vet=vet)
    checkpoints._synced.set()
    before = fresh.parameters_vector()
    async with trio.open_nursery() as nursery:
        for s in (writer_host, me):
            await nursery.start(s.serve)
        await me.connect(writer_host.addrs()[0])
        with trio.fail_after(60):
            assert await checkpoints._pull_newest(ctx) == good
        nursery.cancel_scope.cancel()
    assert list(checkpoints.refused) == [untrained]
    assert [c for c, _ in ctx.checkpoints.list(RUN)] == [good]
    assert vet.last is not None and vet.last["cid"] == good
    assert vet.last["swarm"] == pytest.approx(swarm + 0.01, abs=1e-4)
    # the check leaves the trainer as it was: resume_newest loads the accepted one
    assert torch.equal(fresh.parameters_vector(), before) and fresh.step_count == 0


async def test_snapshots_saved_at_once_never_stop_the_trainer(tmp_path: Path):
    """A fast trainer posts snapshots faster than they are written: each save ran its
    retention while another was half done, and read back a manifest the other had just
    dropped (a CheckpointError out of the snapshot task, which stops the trainer). What
    the run document lists is what the store holds."""
    from node.training.rounds import Snapshot

    signer = keys.Signer.generate()
    doc = rundoc.RunDocument(RUN, signer, [])
    ctx = node_ctx(SimpleNamespace(dht=None), signer, doc, tmp_path / "me")
    ctx.the_run().manifest.checkpoint.keep = 1
    checkpoints = ckpt_service.CheckpointService(publish=lambda delta: None,
                                                 synced=trio.Event())
    checkpoints._ctx = ctx
    state = checkpoint_tensors(trainer(), None)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for step in range(10, 170, 10):
                nursery.start_soon(checkpoints.save, Snapshot(step, state))
    assert checkpoints.saved == 16 and checkpoints.failed == 0
    held = [(m.step, c) for c, m in ctx.checkpoints.list(RUN)]
    assert held == [(160, held[0][1])]
    assert [(s, c) for s, c, _ in rundoc.checkpoint_index(doc)] == held
