"""From a validated run manifest to the trainer and outer optimizer it describes."""

from __future__ import annotations

import hashlib
from typing import Any

from node.errors import NodeError
from protocols import manifest as mf


class TrainerSetupError(NodeError):
    exit_code = 7


def replica_index(peer_id: str) -> int:
    """A stable per-peer number: each replica draws its own data stream (spec 1b)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big")


def check_swarm_algorithm(m: mf.Manifest) -> None:
    """DiLoCo needs a group all-reduce every round: it is the baseline of the in-process
    convergence benchmark (testnet/bench), not something a swarm of strangers runs."""
    if m.outer.algorithm not in ("noloco", "none"):
        raise TrainerSetupError(f"outer.algorithm = {m.outer.algorithm!r} runs only in the "
                                "convergence benchmark; a swarm runs 'noloco' or 'none'")


def build_training(m: mf.Manifest, peer_id: str, device: str,
                   data: list[str] | None = None, resume: Any = None) -> tuple[Any, Any, int]:
    """Build (trainer, outer optimizer or None, inner steps H). Runs in the trainer thread."""
    from node.optim.noloco import NoLoCo, NoLoCoConfig
    from node.trainer.loop import TrainConfig, Trainer
    from node.trainer.tasks import TaskConfig, build_task

    task = build_task(TaskConfig(
        name=m.model.task,
        d_model=m.model.d_model,
        n_layers=m.model.n_layers,
        n_heads=m.model.n_heads,
        context=m.model.context,
        data_files=tuple(data) if data else tuple(m.data.paths) if m.data.source == "files"
        else (),
        data_format=m.data.format,
        jsonl_field=m.data.jsonl_field,
        val_fraction=m.data.val_fraction,
        model_factory=m.model.factory or None,
    ))
    t = m.train
    trainer = Trainer(task, TrainConfig(
        lr=t.lr, warmup_steps=t.warmup_steps, max_steps=t.total_steps,
        weight_decay=t.weight_decay, grad_clip=t.grad_clip, batch_size=t.batch_size,
        eval_every=t.eval_every, eval_batches=t.eval_batches, device=device,
        threads=t.threads, seed=m.run.seed, replica=replica_index(peer_id),
    ))
    if m.outer.algorithm == "none":
        if resume is not None:
            _resume(trainer, None, *resume)
        return trainer, None, m.outer.inner_steps
    check_swarm_algorithm(m)
    outer = NoLoCo(trainer.parameters_vector(),
                   NoLoCoConfig(outer_lr=m.outer.outer_lr, momentum=m.outer.momentum))
    if resume is not None:
        _resume(trainer, outer, *resume)
    return trainer, outer, m.outer.inner_steps


def _resume(trainer: Any, outer: Any, store: Any, cid: str) -> None:
    """Continue from a local checkpoint; a damaged one is skipped with a logged reason."""
    import logging

    from node.checkpoints import CheckpointError
    from node.training import restore_checkpoint

    try:
        manifest, tensors = store.load(cid)
        restore_checkpoint(trainer, outer, manifest.step, tensors)
        logging.getLogger("node.training").info("resumed from checkpoint %s (step %d)", cid,
                                                manifest.step)
    except (CheckpointError, KeyError, RuntimeError, ValueError) as e:
        logging.getLogger("node.training").warning("not resuming from %s: %s", cid, e)
