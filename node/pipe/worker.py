"""One pipeline stage's worker, in the trainer thread (torch lives here; docs/architecture.md).

The worker owns a `StageRunner` (node/ml/pipeline/runner.py) and talks to the trio thread
through the stage's `Inbox` (messages in) and `post` (messages out: the trio side picks
the peer). It never waits without a deadline (deadlines.py). It holds what every stage
shares: the weights (and the lock a snapshot for a recovering neighbour is taken under),
the step's clock and counters, the measured deadline, and what runs after each step (the
replicas' round, the checkpoint). It runs one of two loops:

* the first stage drives, a step at a time (drive.py);
* any other stage serves (serve_loop.py), the last one computing the loss.

Both run a micro-batch's visits of the stage the same way (visits.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from node.pipe.deadlines import FIRST_WAIT_S, POLL_S, step_deadline
from node.pipe.drive import DriveStep
from node.pipe.links import Inbox
from node.pipe.serve_loop import ServeLoop
from node.pipe.stall import StallWatch


@dataclass
class WorkerStats:
    micro_batches: int = 0  # done here (forward and backward)
    dropped: int = 0  # lost: a dead peer, a deadline, a refused message
    stale: int = 0  # arrived for a step already over
    steps: int = 0
    stale_tied: int = 0  # last stage: steps run on the previous tied matrix
    step_s: float = 0.0  # EWMA of a step's wall time
    started: float = field(default_factory=time.monotonic)
    first_mb_at: float | None = None
    last_reason: str | None = None

    def snapshot(self) -> dict[str, Any]:
        since = self.first_mb_at
        rate = (self.micro_batches / (time.monotonic() - since)
                if since is not None and time.monotonic() > since else 0.0)
        return {"micro_batches": self.micro_batches, "dropped": self.dropped,
                "stale": self.stale, "steps": self.steps, "stale_tied": self.stale_tied,
                "step_s": round(self.step_s, 3), "micro_batches_per_s": round(rate, 2),
                "last_drop": self.last_reason}


# (to, kind, the receiver's stage, step, mb, the receiver's hop, tensor, origin)
Post = Callable[[tuple, str, int, int, int, int, Any, str], None]


class StageWorker:
    """One stage in the trainer thread: its runner, inbox and post, the state both loops
    share, and what the service reads (`stats`, `watch`, `wait_s`) or calls from other
    threads (`snapshot` and the recovery's loads)."""

    def __init__(self, runner: Any, n_stages: int, micro_batches: int, inbox: Inbox,
                 post: Post, stop: threading.Event, *, progress: Any,
                 batches: Callable[[], tuple[Any, Any]] | None = None,
                 ready: Callable[[], bool] = lambda: True, device: str = "cpu",
                 first_step: int = 0, leader_step: Callable[[], int] = lambda: 0,
                 last_hosts: Callable[[int], int] = lambda step: 1,
                 first_wait_s: float = FIRST_WAIT_S, layers: Sequence[int] | None = None,
                 swap: bool = False, origin: str = "",
                 arrivals: Callable[[int], int] | None = None) -> None:
        from node.ml.pipeline.schedule import hops

        self.runner = runner
        self.stage = runner.stage.index
        self.n_stages = n_stages
        self.M = micro_batches
        # Each micro-batch's visits (schedule.hops): one per stage in stage order, or
        # CheckFree+'s swapped order on odd micro-batches, where an edge stage holding
        # blocks is visited twice. `visits`: how many of a step's visits are ours.
        layers = list(layers) if layers is not None else [1] * n_stages
        self.paths = [hops(layers, k, swap) for k in range(micro_batches)]
        self.visits = sum(h.stage == self.stage for path in self.paths for h in path)
        self.origin = origin  # our peer id: the origin of the micro-batches we cut
        # How many visits a step brings this host (placement.arrivals); alone, `visits`.
        self.arrivals = arrivals or (lambda step: self.visits)
        self.inbox = inbox
        self.post = post
        self.stop = stop
        self.progress = progress  # TrainingStats: step, loss for heartbeats and status
        self.batches = batches
        self.ready = ready
        self.device = device
        self.step = first_step
        # The steps the stage's weights were trained (0: the seed's), which its checkpoints
        # and the weights it serves claim; `step` is the pipeline's clock, which follows the
        # swarm whatever the weights are (docs/pipeline.md, "What a stage's weights claim").
        self.trained = 0
        self.first_wait_s = first_wait_s  # the deadline until a step has been measured
        # First-stage replicas keep in step: one behind the most advanced replica's step
        # jumps to it (else its micro-batches reach stages already past that step, stale).
        self.leader_step = leader_step
        self.last_hosts = last_hosts  # how many last-stage hosts a step's micro-batches reach
        self.stats = WorkerStats()
        self.watch = StallWatch()  # when a step last trained, whose messages we wait for
        self.tied_version = 0  # last stage: the step its tied matrix is for
        # Held while the weights change (a step, a recovery) so that a snapshot served to
        # a recovering neighbour (`snapshot`, from another thread) is one step's weights.
        self.lock = threading.Lock()
        self.replicas: Any = None  # ReplicaRounds, set once the stage is recovered
        # Called with the new step after each step, under the lock (the service writes the
        # stage's checkpoint every checkpoint.every_steps steps).
        self.on_step: Callable[[int], None] | None = None

    # -- recovery (called from other threads before run(), or while it runs) ------------

    def snapshot(self, part: str) -> tuple[int, float, dict[str, Any], int]:
        """(step, gradient norm after clipping, weights, trained steps): "blocks", "ends"
        or "all" of the stage."""
        stage = self.runner.stage
        with self.lock:
            if part == "blocks":
                state = stage.blocks_state()
            elif part == "ends":
                state = stage.ends_state()
            else:
                state = {k: v.detach().clone() for k, v in stage.state_dict().items()}
            return self.progress.step, float(self.runner.grad_norm), \
                {k: v.cpu() for k, v in state.items()}, self.trained

    def started_from(self, trained: int) -> None:
        """The steps the weights a recovery loaded were trained (the source's claim)."""
        self.trained = self.progress.trained = max(0, trained)

    def apply(self) -> None:
        """One optimizer step on the stage: the weights are trained one more step."""
        with self.lock:
            self.runner.step()
            self.trained += 1
        self.progress.trained = self.trained

    def load_copy(self, state: dict[str, Any]) -> None:
        """A live replica's weights (a stage that still has one is copied, not rebuilt)."""
        with self.lock:
            self.runner.stage.load_state_dict(state, strict=True)

    def load_ends(self, state: dict[str, Any]) -> None:
        """CheckFree+: a lost edge stage's embedding or final norm, from the copy its
        neighbour kept (Stage.load_ends_state checks the names)."""
        with self.lock:
            self.runner.stage.load_ends_state(state)

    def rebuild(self, plan: Any, blocks: dict[int, Any], norms: dict[int, float],
                grad_clip: float, lr_boost: float) -> None:
        """CheckFree: the lost stage's blocks from its neighbours', a fresh Adam at lr x
        lr_boost (node/ml/recovery/checkfree.py checks the norms and the weights)."""
        from node.ml.recovery.checkfree import rebuild_blocks

        state = rebuild_blocks(plan, blocks, norms, grad_clip)
        with self.lock:
            if state is not None:
                self.runner.stage.load_blocks_state(state)
            self.runner.reset_optimizer(lr_boost)

    # -- common ---------------------------------------------------------------------------

    def wait_s(self) -> float:
        return step_deadline(self.stats.step_s, self.first_wait_s)

    def timed(self, t0: float, last_back: float | None) -> None:
        """Count a step. Its time is until its last gradient came back (None: none did),
        never until a deadline that expired: that would stretch the deadline it is
        measured against, and a step that always loses one micro-batch still measures."""
        st = self.stats
        if last_back is not None:
            dt = last_back - t0
            st.step_s = dt if st.step_s == 0 else 0.7 * st.step_s + 0.3 * dt
        st.steps += 1
        self.progress.compute_s += time.monotonic() - t0
        self.progress.steps_run += 1

    def after_step(self, step: int) -> None:
        """The replicas' outer round (replicas.py) and the checkpoint, under the lock
        weights are served by."""
        if self.replicas is not None or self.on_step is not None:
            with self.lock:
                if self.replicas is not None:
                    self.replicas.after_step(step)
                if self.on_step is not None:
                    self.on_step(step)

    def count_lost(self, why: str, n: int = 1) -> None:
        self.stats.dropped += n
        self.stats.last_reason = why

    def dev(self, t: Any) -> Any:
        return t if self.device == "cpu" else t.to(self.device)

    # -- the loops ------------------------------------------------------------------------

    def run(self) -> None:
        self.progress.phase = "training"
        self.watch.trained()  # a stall counts from the worker's start, not its build
        if self.stage == 0:
            while not self.stop.is_set():
                if not self.ready():
                    self.progress.phase = "waiting for stages"
                    self.stop.wait(POLL_S)
                    continue
                self.progress.phase = "training"
                self.drive_step()
        else:
            self.serve()

    def drive_step(self) -> None:
        """The first stage: one step (drive.py). With CheckFree+'s swap it also runs its
        blocks as an interior visit of odd micro-batches, between sending their embedding
        and its gradient."""
        DriveStep(self).run()

    def serve(self) -> None:
        """Any other stage: serve until stopped (serve_loop.py)."""
        ServeLoop(self).run()
