"""What the pieces of the pipeline service share: this node's stage and the run's shape.

One object, passed to each piece (stage_map.py, choice.py, routing.py, weights.py,
recovery.py, stage_thread.py) when the service composes them, so that none reads another's
attributes through a lambda: the stage it hosts, whether it trains, the running worker,
the inbox the worker reads, the counters `node status` shows.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from node.ml.pipeline.schedule import hops
from node.pipe.links import Inbox, Lost, Outgoing
from protocols import manifest as mf

if TYPE_CHECKING:
    from node.pipe.worker import StageWorker
    from node.training.rounds import TrainingStats


class PipeState:
    """The run's shape (stages, micro-batches, layers, routes) and this node's stage."""

    def __init__(self, manifest: mf.Manifest, run_id: str, progress: TrainingStats) -> None:
        p = manifest.pipeline
        if p is None:
            raise ValueError("not a pipeline run")
        self.m = manifest
        self.run_id = run_id
        self.progress = progress
        self.n = p.stages
        self.M = p.micro_batches
        self.layers = mf.stage_layers(manifest.model.n_layers, p.stages, tuple(p.layers))
        # CheckFree+ runs odd micro-batches through the edge stages in swapped order, so
        # that each edge's partner learns to stand in for it (schedule.hops).
        self.swap = p.recovery == "checkfree+"
        self.paths = [hops(self.layers, k, self.swap) for k in range(self.M)]
        self.stage: int | None = None
        self.moves = 0
        self.phase = "choosing a stage"
        self.phase_at = time.monotonic()  # when a recovery began (stall.current says how long)
        self.training = False
        self.inbox = Inbox(capacity=4 * self.M + 8)
        self.counters: Counter[str] = Counter()
        self.worker: StageWorker | None = None  # the running one, once its stage started
        self.stop = threading.Event()  # the running worker's
        self.move_to: int | None = None  # a takeover asked by membership
        self.recovery: dict[str, Any] | None = None  # how this stage started, mid-run
        self.checkpointed: int | None = None  # the step of this stage's newest own checkpoint

    @property
    def pipeline(self) -> mf.PipelineSection:
        p = self.m.pipeline
        assert p is not None  # checked in __init__
        return p

    def lost(self, msg: Outgoing, reason: str) -> None:
        """A message of ours that no peer will get (the outbox's on_lost, routing's)."""
        self.counters[f"lost {msg.kind}"] += 1
        if msg.kind in ("act", "tgt"):  # our micro-batch will not come back
            self.inbox.offer(Lost(msg.kind, msg.step, msg.mb, reason, msg.origin))
