"""A pipeline stage's weights claim the steps they were trained, never the swarm's clock
(node/ml/recovery/sources.py, node/pipe/recovery.py `Recovery.recover`; docs/pipeline.md, "What a
stage's weights claim"). Issue 26 item 2, the pipeline's case."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from node.ml.recovery.sources import Source, rank
from node.pipe import stage_ckpt
from tests.conftest import node_context
from tests.node.pipe.test_pipe_convergence import service_hearing

SWARM = 1000
FRESH = SWARM - 250  # 10 intervals of 25 steps


def test_trained_weights_come_before_seed_weights_whatever_the_clock():
    # a replica that restarted from the seed 3 steps ago, one that trained all along
    assert [s.peer for s in rank({"seedy": 3, "old": 990}, None, SWARM, FRESH)][:1] == ["old"]
    # this host's checkpoint of trained weights beats a replica on seed weights
    order = rank({"seedy": 3}, 980, SWARM, FRESH)
    assert [s.kind for s in order] == ["checkpoint", "peers", "checkfree", "replica", "seed"]
    # a checkpoint of seed weights (trained 0) comes after a rebuild, before the seed
    assert [s.kind for s in rank({}, 0, SWARM, FRESH)] == ["peers", "checkfree", "checkpoint",
                                                           "seed"]
    # equal counts: the live replica first; no CheckFree where the rule forbids it
    assert rank({"r": 990}, 990, SWARM, FRESH, checkfree=False) == [
        Source("replica", 990, "r"), Source("checkpoint", 990), Source("peers"),
        Source("seed")]


def test_a_claim_above_the_clock_or_unknown_gains_no_rank():
    order = rank({"liar": 10**9, "honest": 995, "older": None}, None, SWARM, FRESH)
    assert order[0] == Source("replica", SWARM, "liar")  # capped at the swarm's step
    assert [s.peer for s in order] == ["liar", "honest", None, None, "older", None]
    # early in a run every trained step counts as current, an untrained one never does
    assert [s.kind for s in rank({"a": 0, "b": 4}, None, 20, -230)] == [
        "replica", "peers", "checkfree", "replica", "seed"]


def test_a_recovering_replica_ranks_its_stage_s_hosts_by_their_heartbeats():
    """Stage 1's two hosts: r1 restarted from the seed (its heartbeats say 2 trained
    steps), r2 trained all along; both run at the swarm's step. The new replica copies r2."""
    service = service_hearing(("a0", 0, 0.5, {"step": SWARM}),
                              ("r1", 1, 0.5, {"step": SWARM, "trained": 2}),
                              ("r2", 1, 0.5, {"step": SWARM, "trained": 990}),
                              ("c2", 2, 0.5, {"step": SWARM}), ("d3", 3, 0.5, {"step": SWARM}),
                              me="z1", stage=1)
    claims = service.map.trained_of(service.map.rows()[1])
    assert claims == {"r1": 2, "r2": 990}
    assert rank(claims, None, service.map.swarm_step(), FRESH)[0].peer == "r2"


class Unreachable:
    """A substrate whose every stream fails at once: no neighbour gives its weights."""

    async def open_stream(self, peer, protocol):
        raise ConnectionRefusedError(f"{peer} unreachable")


def test_a_stage_started_from_the_seed_checkpoints_no_trained_steps(tmp_path):
    """Stage 1 lost on every host at the swarm's step 1000; its replacement's CheckFree
    fails (neither neighbour answers), so it starts from the seed's weights, at the swarm's
    step. Its stage checkpoint must not claim the swarm's progress: a restart that asks for
    current weights refuses it (the old code wrote "step 1025" and a restart resumed from it
    as fresh), and what it claims is the 0 steps its weights were trained."""
    service = service_hearing(("a0", 0, 0.5, {"step": SWARM}), ("c2", 2, 0.5, {"step": SWARM}),
                              ("d3", 3, 0.5, {"step": SWARM}), me="z1", stage=1,
                              substrate=Unreachable())
    st = service.state
    service.map.ctx.config.state_dir = tmp_path
    assert service.map.swarm_step() == SWARM
    worker = service.thread.build_worker(post=lambda *a: None)
    trio.run(service.recovery.recover, worker)
    assert st.recovery is not None and st.recovery["rule"] == "none"
    assert worker.step == SWARM  # the clock follows the swarm

    every = st.m.checkpoint.every_steps
    service.thread.checkpoint_hook(worker)(SWARM + every)
    path = stage_ckpt.path_for(tmp_path, st.run_id, 1)
    restarted = service.thread.build_worker(post=lambda *a: None)
    with pytest.raises(stage_ckpt.StageCheckpointError):
        stage_ckpt.load(path, restarted.runner, st.run_id, list(st.layers),
                        min_step=SWARM - 10 * every)
    assert stage_ckpt.claim(path, st.run_id, 1, list(st.layers)) == \
        stage_ckpt.Claim(SWARM + every, 0)

    # restarted with that file: CheckFree fails again, the file is the only source left,
    # and the stage says it holds 0 trained steps
    st.recovery = None
    trio.run(service.recovery.recover, restarted)
    assert st.recovery["rule"] == "checkpoint" and restarted.trained == 0
    assert "trained 0 steps" in st.recovery["reason"]


def test_each_optimizer_step_counts_one_trained_step(tmp_path):
    service = service_hearing(me="z1", stage=1)
    service.map.ctx.config.state_dir = tmp_path
    worker = service.thread.build_worker(post=lambda *a: None)
    worker.started_from(40)
    stage = worker.runner.stage
    import torch

    stage.run_blocks(torch.randn(2, 8, service.state.m.model.d_model)).pow(2).mean().backward()
    worker.apply()
    assert worker.trained == service.state.progress.trained == 41
    assert worker.snapshot("blocks")[3] == 41  # the claim its weights answers carry


def test_heartbeats_of_a_stage_host_report_trained():
    from node.service import NodeContext

    run = SimpleNamespace(progress=SimpleNamespace(step=1000, trained=3, loss=None,
                                                   val_loss=None, grad_norm=None,
                                                   span_wanted=1),
                          stage=1, manifest=SimpleNamespace(pipeline=object()),
                          stage_training=True)
    ctx = node_context(run=run, phases=SimpleNamespace(started=0.0))
    stats = NodeContext.own_stats(ctx)  # type: ignore[arg-type]
    assert (stats["step"], stats["trained"]) == (1000, 3)
