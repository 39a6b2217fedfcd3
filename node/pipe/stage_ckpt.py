"""A stage host's own checkpoint: its stage's weights and Adam state, every
`checkpoint.every_steps` steps, in its state directory (docs/pipeline.md, "Recovery live").

A host that crashes and is started again takes the stage it left empty and resumes from
this file: the stage's own weights and optimizer moments, stale by less than every_steps
steps. One file per run and stage, replaced atomically (node/files.atomic_write), in the
format of the data-parallel checkpoints (node/training/state.py: safetensors, no pickle);
it never travels, so it is not content-addressed. Runs in the trainer thread.

What it claims (docs/pipeline.md, "What a stage's weights claim"): `trained`, the steps
the stage's weights were trained (the worker's count: 0 from the seed, the source's count
for a copy, a rebuild or a resume), beside `step`, the pipeline's clock at the save. The
clock follows the swarm whatever the weights are; until 2026-11-27 the file held only the
clock, so a stage started from the seed after a failed recovery wrote "step 1010" over
seed weights and a restart resumed from it as fresh. A format-1 file (the clock only) is
read with `trained` 0: its weights are used only where nothing trained is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.files import atomic_write
from node.training.state import from_tensors, to_tensors

FORMAT = 2
FORMATS = (1, 2)  # 1: before `trained`


@dataclass(frozen=True, slots=True)
class Claim:
    """What a stage checkpoint says of itself: the clock at the save, and the steps its
    weights were trained."""

    step: int
    trained: int


class StageCheckpointError(ValueError):
    """The file is not a checkpoint of this run's stage with this layout."""


def path_for(state_dir: Path, run_id: str, stage: int) -> Path:
    return Path(state_dir) / "stages" / f"{run_id}-stage{stage}.safetensors"


def save(path: Path, runner: Any, run_id: str, layers: list[int], step: int,
         trained: int) -> None:
    """The stage's weights, its optimizer and its learning-rate scale (CheckFree's boost),
    at clock `step`, claiming `trained` steps (never more than the clock)."""
    from safetensors.torch import save as to_bytes

    stage = runner.stage
    state = {"format": FORMAT, "run": run_id, "stage": stage.index, "layers": list(layers),
             "step": step, "trained": max(0, min(trained, step)),
             "lr_scale": runner.cfg.lr_scale,
             "model": stage.state_dict(), "optim": runner.optimizer.state_dict()}
    atomic_write(path, to_bytes(to_tensors(state)))


def _read(path: Path, run_id: str, stage: int, layers: list[int]) -> tuple[dict, Claim]:
    from safetensors.torch import load as from_bytes

    try:
        state = from_tensors(from_bytes(path.read_bytes()))
    except Exception as e:  # damaged, truncated, not ours
        raise StageCheckpointError(f"{path.name}: unreadable ({type(e).__name__}: {e})") from e
    want = {"run": run_id, "stage": stage, "layers": list(layers)}
    got = {k: state.get(k) for k in want}
    if got != want or state.get("format") not in FORMATS:
        raise StageCheckpointError(f"{path.name}: {got} format {state.get('format')!r}, "
                                   f"expected {want} format {FORMAT}")
    scale, step = state.get("lr_scale"), state.get("step")
    trained = state.get("trained", 0) if state["format"] == 1 else state.get("trained")
    if (not isinstance(scale, float) or type(step) is not int or step < 0
            or type(trained) is not int or not 0 <= trained <= step):
        raise StageCheckpointError(f"{path.name}: bad step {step!r}, trained {trained!r} "
                                   f"or lr_scale {scale!r}")
    return state, Claim(step, trained)


def claim(path: Path, run_id: str, stage: int, layers: list[int]) -> Claim:
    """What the checkpoint at `path` claims, without loading it into a stage (a recovery
    ranks it against the live replicas: node/ml/recovery/sources.py)."""
    return _read(path, run_id, stage, layers)[1]


def weights(path: Path, run_id: str, stage: int, layers: list[int]
            ) -> tuple[Claim, dict[str, Any]]:
    """The claim and the stage's weights (its state dict, no optimizer), to serve to a
    replacement of a stage this node hosted before (node/pipe/weights.py)."""
    state, got = _read(path, run_id, stage, layers)
    model = state.get("model")
    if not isinstance(model, dict):
        raise StageCheckpointError(f"{path.name}: no weights")
    return got, model


def load(path: Path, runner: Any, run_id: str, layers: list[int], min_step: int = 0) -> Claim:
    """Restore `runner`'s stage and optimizer from `path`; what the file claims.
    StageCheckpointError (nothing changed) when it is not this run's stage and layout, or
    its weights were trained fewer than `min_step` steps (seed weights saved at a late
    clock are as old as the seed)."""
    stage = runner.stage
    state, got = _read(path, run_id, stage.index, layers)
    if got.trained < min_step:
        raise StageCheckpointError(f"{path.name}: trained {got.trained} steps (saved at step "
                                   f"{got.step}), older than step {min_step}")
    before, old_scale = {k: v.clone() for k, v in stage.state_dict().items()}, runner.cfg.lr_scale
    try:
        stage.load_state_dict(state["model"], strict=True)
        runner.reset_optimizer(state["lr_scale"])
        runner.optimizer.load_state_dict(state["optim"])
    except Exception as e:  # shapes or names that do not fit: back to what we had
        stage.load_state_dict(before, strict=True)
        runner.reset_optimizer(old_scale)
        raise StageCheckpointError(f"{path.name}: does not fit the stage ({e})") from e
    return got
