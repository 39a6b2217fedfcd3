"""A joiner's check of a pulled checkpoint's claim of progress, before it trains from it.

A checkpoint's step is its writer's word. A node that believed the swarm's step without
the swarm's weights once published an untrained model "at step 1180" (issue 26), and every
later joiner took the newest checkpoint listed. The check evaluates the candidate on the
validation batches every peer evaluates on, against the median validation loss the live
training peers report in their heartbeats (the candidate's writer left out: it does not
vouch for itself); a candidate worse than that is measured against the run's initial
weights too (the same on every node: drawn from the seed), which scale what "worse" may
be. protocols/checkpoint.py's `progress_refusal` says what passes; docs/checkpoints.md says
why.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from node.errors import NodeError
from protocols.checkpoint import progress_refusal

if TYPE_CHECKING:
    from node.checkpoints.store import CheckpointStore
    from node.membership.view import Membership
    from node.service import NodeContext

log = logging.getLogger("node.ckpt")


def swarm_loss(membership: Membership, exclude: set[str]) -> float | None:
    """The median validation loss (`val`) live training peers report, those in `exclude`
    left out; None when none reports one (no evaluation yet, nobody heard)."""
    vals = [v for e in membership.live() if e.info.get("role") == "node"
            and e.peer_id not in exclude
            for v in [(e.info.get("stats") or {}).get("val")]
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def measure(trainer: Any, store: CheckpointStore, cid: str) -> float:
    """Checkpoint `cid`'s validation loss, on the trainer's validation batches. Only the
    weights go in and back out (a host copy): the trainer keeps its own weights, optimizer
    state and step, and a model that fills the device is not held there twice. Raises
    CheckpointError (or KeyError, RuntimeError) for a checkpoint it cannot load."""
    from node.training.state import from_tensors

    _, tensors = store.load(cid)
    model = from_tensors(tensors)["trainer"]["model"]
    before = trainer.parameters_vector()
    try:
        trainer.model.load_state_dict(model)
        return trainer.evaluate()
    finally:
        trainer.set_parameters_vector(before)


class CheckpointVet:
    """`await vet(cid, writer)`: None to take checkpoint `cid`, else why not. `trainer()`
    blocks until the node's trainer is built (Prebuild.result) and returns (trainer, outer,
    H); it runs in a worker thread."""

    def __init__(self, ctx: NodeContext, trainer: Callable[[], tuple[Any, Any, int]]) -> None:
        self._ctx = ctx
        self._trainer = trainer
        self._initial: float | None = None  # the initial weights' loss, measured once
        self.last: dict[str, Any] | None = None  # the last check's numbers (node status)

    async def __call__(self, cid: str, writer: str) -> str | None:
        ctx = self._ctx
        swarm = swarm_loss(ctx.membership, {writer, ctx.peer_id})
        if swarm is None:
            log.info("checkpoint %s: no live peer reports a validation loss to compare it "
                     "with; taken unchecked", cid)
            return None
        ctx.phases.enter("checking checkpoint")
        try:  # torch must be loaded and the trainer built (the build waited for the pull)
            trainer, _, _ = await trio.to_thread.run_sync(self._trainer, abandon_on_cancel=True)
        except Exception as e:  # the trainer service reports a failed build; nothing to check
            log.warning("checkpoint %s taken unchecked: no trainer to check it with (%s)",
                        cid, e)
            return None
        try:
            candidate = await trio.to_thread.run_sync(measure, trainer, ctx.checkpoints, cid)
        except (NodeError, KeyError, ValueError, RuntimeError) as e:
            return f"it cannot be loaded: {e}"
        # The initial weights' loss (what the trainer holds until it resumes) scales the
        # check; a candidate no worse than the swarm passes whatever it is, so it is
        # measured only when needed, and once (every node draws the same initial weights).
        if candidate > swarm and self._initial is None:
            self._initial = await trio.to_thread.run_sync(trainer.evaluate)
        initial = self._initial if self._initial is not None else math.nan
        self.last = {"cid": cid, "loss": round(candidate, 4), "swarm": round(swarm, 4),
                     "initial": None if math.isnan(initial) else round(initial, 4)}
        reason = None if candidate <= swarm else progress_refusal(candidate, initial, swarm)
        if reason is None:
            log.info("checkpoint %s checked: validation loss %.3f (the swarm reports %.3f)",
                     cid, candidate, swarm)
        return reason
