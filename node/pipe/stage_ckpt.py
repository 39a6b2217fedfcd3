"""A stage host's own checkpoint: its stage's weights and Adam state, every
`checkpoint.every_steps` steps, in its state directory (docs/pipeline.md, "Recovery live").

A host that crashes and is started again takes the stage it left empty and resumes from
this file: the stage's own weights and optimizer moments, stale by less than every_steps
steps. One file per run and stage, replaced atomically (node/files.atomic_write), in the
format of the data-parallel checkpoints (node/training/state.py: safetensors, no pickle);
it never travels, so it is not content-addressed. Runs in the trainer thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from node.files import atomic_write
from node.training.state import from_tensors, to_tensors

FORMAT = 1


class StageCheckpointError(ValueError):
    """The file is not a checkpoint of this run's stage with this layout."""


def path_for(state_dir: Path, run_id: str, stage: int) -> Path:
    return Path(state_dir) / "stages" / f"{run_id}-stage{stage}.safetensors"


def save(path: Path, runner: Any, run_id: str, layers: list[int], step: int) -> None:
    """The stage's weights, its optimizer and its learning-rate scale (CheckFree's boost)."""
    from safetensors.torch import save as to_bytes

    stage = runner.stage
    state = {"format": FORMAT, "run": run_id, "stage": stage.index, "layers": list(layers),
             "step": step, "lr_scale": runner.cfg.lr_scale,
             "model": stage.state_dict(), "optim": runner.optimizer.state_dict()}
    atomic_write(path, to_bytes(to_tensors(state)))


def load(path: Path, runner: Any, run_id: str, layers: list[int], min_step: int = 0) -> int:
    """Restore `runner`'s stage and optimizer from `path`; the step it was written at.
    StageCheckpointError (nothing changed) when it is not this run's stage and layout, or
    older than `min_step`."""
    from safetensors.torch import load as from_bytes

    try:
        state = from_tensors(from_bytes(path.read_bytes()))
    except Exception as e:  # damaged, truncated, not ours
        raise StageCheckpointError(f"{path.name}: unreadable ({type(e).__name__}: {e})") from e
    stage = runner.stage
    want = {"format": FORMAT, "run": run_id, "stage": stage.index, "layers": list(layers)}
    got = {k: state.get(k) for k in want}
    if got != want:
        raise StageCheckpointError(f"{path.name}: {got}, expected {want}")
    scale = state.get("lr_scale")
    step = state.get("step")
    if not isinstance(scale, float) or not isinstance(step, int) or step < 0:
        raise StageCheckpointError(f"{path.name}: bad step {step!r} or lr_scale {scale!r}")
    if step < min_step:
        raise StageCheckpointError(f"{path.name}: step {step}, older than step {min_step}")
    before, old_scale = {k: v.clone() for k, v in stage.state_dict().items()}, runner.cfg.lr_scale
    try:
        stage.load_state_dict(state["model"], strict=True)
        runner.reset_optimizer(scale)
        runner.optimizer.load_state_dict(state["optim"])
    except Exception as e:  # shapes or names that do not fit: back to what we had
        stage.load_state_dict(before, strict=True)
        runner.reset_optimizer(old_scale)
        raise StageCheckpointError(f"{path.name}: does not fit the stage ({e})") from e
    return step
