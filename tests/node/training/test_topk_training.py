"""`outer.codec = "topk"` in the training service: the boundary hands the averager the
encoded frame of the round (not θ), the partners' decoded frames come back, and the outer
steps (averaged, and local for rounds whose exchange never answered) are exactly those of
CompressedNoLoCo replayed by hand on the same snapshots; the manifest and build side."""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from node.ml.optim.compress import CompressedDiLoCo, CompressedNoLoCo, SwarmTopK, TopKConfig
from node.ml.optim.noloco import NoLoCoConfig
from node.ml.trainer.loop import TrainConfig, Trainer
from node.ml.trainer.tasks import TaskConfig, build_task
from node.training.build import build_training, topk_config
from node.training.rounds import Compressed, Outcome
from node.training.service import TrainingService
from protocols import manifest as mf
from protocols import sparse
from tests.node.training.test_training_service import H, gated, train_to_the_end


def partner_frame(numel: int, r: int) -> sparse.Frame:
    """What a partner sends for round r: a frame of its own, through the wire's decoder."""
    g = torch.Generator().manual_seed(100 + r)
    opt = CompressedNoLoCo(torch.randn(numel, generator=g))
    data = sparse.encode(opt.prepare(opt.phi + 0.01 * torch.randn(numel, generator=g)))
    return sparse.decode(data, numel, sparse.Bounds())


async def test_the_service_sends_frames_and_steps_as_compressed_noloco_by_hand():
    snapshots: dict[int, torch.Tensor] = {}
    holder: dict = {}

    def make():
        trainer = Trainer(build_task(TaskConfig(name="digits-mlp")),
                          TrainConfig(batch_size=16, eval_every=0, seed=0, warmup_steps=1))
        holder["init"] = trainer.parameters_vector().clone()
        outer = SwarmTopK(CompressedNoLoCo(trainer.parameters_vector(), NoLoCoConfig()))
        prepare = outer.prepare

        def recording(theta: torch.Tensor, round: int) -> bytes:
            snapshots[round] = theta.clone()
            return prepare(theta, round)

        outer.prepare = recording  # type: ignore[method-assign]
        return trainer, outer, H

    sent: dict[int, Compressed] = {}
    answered = {r: threading.Event() for r in (1, 3, 5)}

    async def exchange(r: int, snapshot: Compressed) -> Outcome:
        sent[r] = snapshot
        if r % 2:  # odd rounds: a partner's frame at once
            answered[r].set()
            return Outcome(r, [partner_frame(snapshot.numel(), r)], partner="peer-a",
                           peers=("peer-a",))
        await trio.sleep_forever()  # even rounds: never answered, closed locally

    service = TrainingService(gated(make, answered, trio.lowlevel.current_trio_token()),
                              exchange, max_steps=6 * H)
    await train_to_the_end(service)
    st = service.stats
    assert sorted(sent) == [1, 2, 3, 4, 5, 6]
    numel = st.params
    size = TopKConfig().frame_bytes(numel, anchor=True)
    assert all(isinstance(c, Compressed) and len(c.frames) == 1 and len(c.frames[0]) == size
               for c in sent.values())
    assert size < 4 * numel / 20  # the boundary hands over a 20th of fp32's bytes, or less
    assert st.rounds_averaged == 3 and st.rounds_local == 2  # round 6 still pending

    # By hand: rounds 1..5 in order, each frame from that round's snapshot, averaged with
    # the partner's frame on odd rounds and alone on even ones.
    ref = CompressedNoLoCo(holder["init"], NoLoCoConfig())
    for r in range(1, 6):
        own = ref.prepare(snapshots[r])
        assert sparse.encode(own) == sent[r].frames[0]
        ref.outer_step(own, [partner_frame(numel, r)] if r % 2 else [])
    assert torch.equal(ref.phi, service.outer.phi) and torch.equal(ref.m, service.outer.inner.m)
    own6 = ref.prepare(snapshots[6])  # and round 6's frame was the next one in order
    assert sparse.encode(own6) == sent[6].frames[0]


def test_swarm_topk_pairs_each_round_with_its_own_frame_and_checkpoints_its_state():
    g = torch.Generator().manual_seed(0)
    init, theta = torch.randn(5000, generator=g), torch.randn(5000, generator=g)
    outer, ref = SwarmTopK(CompressedNoLoCo(init)), CompressedNoLoCo(init)
    outer.prepare(theta, 7)
    frame = partner_frame(5000, 7)
    with pytest.raises(TypeError):  # a dense vector is no frame
        outer.outer_step(theta, [torch.zeros(5000)], round=7)
    got = outer.outer_step(theta, [frame], round=7)
    want = ref.outer_step(ref.prepare(theta), [frame])
    assert torch.equal(got, want)
    copy = SwarmTopK(CompressedNoLoCo(torch.zeros(5000)))
    copy.load_state_dict(outer.state_dict())
    assert torch.equal(copy.phi, outer.phi) and torch.equal(copy.inner.ef.e, outer.inner.ef.e)
    assert copy.rounds == 1
    # DiLoCo: a round without the all-gather steps on this worker's own frame alone
    dl, dref = SwarmTopK(CompressedDiLoCo(init)), CompressedDiLoCo(init)
    assert dl.synchronous
    dl.prepare(theta, 1)
    assert torch.equal(dl.outer_step(theta, [], round=1), dref.outer_step([dref.prepare(theta)]))


def test_a_topk_manifest_builds_the_compressed_outer_step_within_its_bounds():
    def manifest(extra: str) -> mf.Manifest:
        return mf.parse_manifest('[run]\nname = "a"\n[model]\ntask = "digits-mlp"\n'
                                 f'[outer]\ncodec = "topk"\n{extra}')

    _, outer, _ = build_training(manifest(""), "peer", "cpu")
    assert isinstance(outer, SwarmTopK) and isinstance(outer.inner, CompressedNoLoCo)
    _, outer, _ = build_training(manifest('algorithm = "diloco"\n'), "peer", "cpu")
    assert isinstance(outer.inner, CompressedDiLoCo) and outer.synchronous
    # a run with tighter bounds than compress.py's defaults: our frames stay within them
    tight = topk_config(manifest("topk_max_density = 0.005\ntopk_max_anchor_bits = 1\n"))
    assert tight.k == 20 and tight.k / tight.chunk <= 0.005 and tight.anchor_bits == 0
    with pytest.raises(ValueError, match="topk"):
        manifest('algorithm = "gossip"\n')
