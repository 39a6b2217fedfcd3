"""A stage host's own checkpoint (node/pipe/stage_ckpt.py): what it restores, and what it
refuses without touching the stage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from node.ml.pipeline import StageOptim, StageRunner, build_stages
from node.ml.trainer.models import GPTConfig
from node.pipe import stage_ckpt

CONFIG = GPTConfig(d_model=16, n_layers=2, n_heads=2, context=8)
LAYERS = [1, 1]
RUN = "QmRun"


def runner(stage: int = 1, seed: int = 0) -> StageRunner:
    return StageRunner(build_stages(CONFIG, LAYERS, seed)[stage], StageOptim(lr=1e-2))


def trained(r: StageRunner, steps: int = 3) -> StageRunner:
    for _ in range(steps):
        x = torch.randn(2, 8, 16)
        r.stage.run_blocks(x).pow(2).mean().backward()
        r.step()
    return r


def test_a_checkpoint_restores_weights_adam_and_the_lr_scale(tmp_path: Path):
    a = trained(runner())
    a.reset_optimizer(1.1)  # a CheckFree rebuild raised this stage's learning rate
    trained(a, 2)
    path = stage_ckpt.path_for(tmp_path, RUN, 1)
    stage_ckpt.save(path, a, RUN, LAYERS, step=40, trained=35)
    b = runner(seed=1)  # another start: the checkpoint must overwrite all of it
    assert stage_ckpt.load(path, b, RUN, LAYERS) == stage_ckpt.Claim(step=40, trained=35)
    for (k, va), vb in zip(a.stage.state_dict().items(), b.stage.state_dict().values(),
                           strict=True):
        assert torch.equal(va, vb), k
    assert b.cfg.lr_scale == pytest.approx(1.1)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"][0]["lr"] == sb["param_groups"][0]["lr"]
    for i, st in sa["state"].items():
        assert torch.equal(st["exp_avg"], sb["state"][i]["exp_avg"])
    # the same next step from both
    torch.manual_seed(0)
    trained(a, 1)
    torch.manual_seed(0)
    trained(b, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.stage.parameters(), b.stage.parameters(),
                                                 strict=True))


@pytest.mark.parametrize(("run", "stage", "layers", "match"), [
    ("QmOther", 1, LAYERS, "expected"),  # another run's
    (RUN, 0, LAYERS, "expected"),  # another stage's
    (RUN, 1, [2, 0], "expected"),  # another layout's
])
def test_a_foreign_checkpoint_is_refused_and_changes_nothing(tmp_path, run, stage, layers,
                                                             match):
    path = tmp_path / "ckpt.safetensors"
    stage_ckpt.save(path, trained(runner(stage)), run, layers, step=10, trained=10)
    r = runner(1)
    before = {k: v.clone() for k, v in r.stage.state_dict().items()}
    with pytest.raises(stage_ckpt.StageCheckpointError, match=match):
        stage_ckpt.load(path, r, RUN, LAYERS)
    assert all(torch.equal(before[k], v) for k, v in r.stage.state_dict().items())


def test_a_damaged_checkpoint_is_refused(tmp_path):
    path = stage_ckpt.path_for(tmp_path, RUN, 1)
    stage_ckpt.save(path, trained(runner()), RUN, LAYERS, step=10, trained=10)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(stage_ckpt.StageCheckpointError, match="unreadable"):
        stage_ckpt.load(path, runner(), RUN, LAYERS)


def test_a_checkpoint_older_than_asked_is_refused(tmp_path):
    path = stage_ckpt.path_for(tmp_path, RUN, 1)
    stage_ckpt.save(path, trained(runner()), RUN, LAYERS, step=10, trained=10)
    r = runner()
    before = {k: v.clone() for k, v in r.stage.state_dict().items()}
    with pytest.raises(stage_ckpt.StageCheckpointError, match="older than step 11"):
        stage_ckpt.load(path, r, RUN, LAYERS, min_step=11)
    assert all(torch.equal(before[k], v) for k, v in r.stage.state_dict().items())
    assert stage_ckpt.load(path, r, RUN, LAYERS, min_step=10).trained == 10


def test_seed_weights_saved_at_a_late_clock_are_as_old_as_the_seed(tmp_path):
    """A stage that started from the seed at the swarm's step 1000 and trained 3 steps:
    its checkpoint says so, and a restart asking for weights trained since step 750 (10
    intervals behind the swarm) refuses it, though it was written at step 1003."""
    path = stage_ckpt.path_for(tmp_path, RUN, 1)
    stage_ckpt.save(path, trained(runner()), RUN, LAYERS, step=1003, trained=3)
    assert stage_ckpt.claim(path, RUN, 1, LAYERS) == stage_ckpt.Claim(1003, 3)
    with pytest.raises(stage_ckpt.StageCheckpointError, match="trained 3 steps"):
        stage_ckpt.load(path, runner(), RUN, LAYERS, min_step=750)
    # a claim above the clock is not written
    stage_ckpt.save(path, trained(runner()), RUN, LAYERS, step=10, trained=99)
    assert stage_ckpt.claim(path, RUN, 1, LAYERS).trained == 10


def test_a_checkpoint_from_before_trained_claims_nothing(tmp_path):
    """Format 1 recorded only the clock, which may be the swarm's over seed weights: it is
    read as 0 trained steps (used only where nothing trained is left)."""
    from safetensors.torch import load, save

    from node.training.state import from_tensors, to_tensors

    path = stage_ckpt.path_for(tmp_path, RUN, 1)
    stage_ckpt.save(path, trained(runner()), RUN, LAYERS, step=500, trained=500)
    state = from_tensors(load(path.read_bytes()))
    del state["trained"]
    state["format"] = 1
    path.write_bytes(save(to_tensors(state)))
    assert stage_ckpt.claim(path, RUN, 1, LAYERS) == stage_ckpt.Claim(500, 0)

