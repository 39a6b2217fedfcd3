"""The first stage's loop: it drives the pipeline, a step at a time (worker.py runs it).

Each step it reads a batch, cuts it into micro-batches, sends each one's activations to
the next stage and its targets to the last stage, then waits for the gradients (and the
last stage's head gradient) until the step's deadline (deadlines.py); what has not come
back by then is dropped (`StageRunner.drop`), the rest steps. A step that got nothing
back lasts at least MIN_WAIT_S (the counter cannot run away). It then sends the updated
tied matrix to the last stage. A message for a later step (another first-stage replica's,
relayed) means the stages after it moved on: it gives up the step at once and joins
theirs (replicas one step apart lost every step otherwise).

With CheckFree+'s swap (schedule.hops) the first stage also serves its blocks' visit of
odd micro-batches while it drives (visits.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from node.pipe.deadlines import MIN_WAIT_S, POLL_S
from node.pipe.links import Lost, Message
from node.pipe.visits import Visits, key

if TYPE_CHECKING:
    from node.pipe.worker import StageWorker


class DriveStep:
    """One step of the first stage: micro-batches out, gradients back within the
    deadline, step, the tied matrix out (`run`)."""

    def __init__(self, worker: StageWorker) -> None:
        self.w = worker
        worker.step = max(worker.step, worker.leader_step())
        self.t = worker.step
        self.t0 = time.monotonic()
        self.pending: set[int] = set()  # our micro-batches whose gradient is not back
        self.tied_from: set[str] = set()  # the last-stage hosts whose head gradient came
        self.need_tied = 1
        self.done = 0
        self.n_lost = 0
        self.ahead = 0  # a later step the swarm is at, seen in a message for it: ours is lost
        self.last_back: float | None = None
        self.visits = Visits(worker)  # our interior visits (CheckFree+'s swap)

    def run(self) -> None:
        self._send()
        self._collect()
        self._finish()

    def _send(self) -> None:
        """The step's micro-batches out: activations to the next visit, targets to the
        last stage."""
        from node.ml.pipeline.schedule import micro_batches

        w, t = self.w, self.t
        assert w.batches is not None
        x, y = w.batches()
        for k, (xk, yk) in enumerate(micro_batches(x, y, w.M)):
            path = w.paths[k]
            out = w.runner.forward((w.origin, k, 0), w.dev(xk), path[0])
            self.pending.add(k)
            w.post(("last", t, k), "tgt", path[-1].stage, t, k, len(path) - 1, yk, w.origin)
            w.post(("next", t, k, 0), "act", path[1].stage, t, k, 1, out, w.origin)
        if w.stats.first_mb_at is None:
            w.stats.first_mb_at = self.t0
        # A head gradient from each last-stage host the step's micro-batches reach: each
        # sends its own when it has all of them (none after a loss). Going on at the first
        # let our next micro-batches overtake another first-stage replica's last one of
        # step t at the other last-stage host, which then refused that one as stale (a
        # lost micro-batch, and a deadline for every host).
        self.need_tied = max(1, w.last_hosts(t))

    def _collect(self) -> None:
        """Gradients from the next visit's stage, then the last stage's head gradient,
        until the deadline; or until a message says the swarm is past our step."""
        w, t = self.w, self.t
        deadline = self.t0 + w.wait_s()
        while (self.pending or (len(self.tied_from) < self.need_tied and not self.n_lost)) \
                and not w.stop.is_set():
            w.watch.awaiting = w.paths[min(self.pending)][1].stage if self.pending \
                else w.n_stages - 1
            left = deadline - time.monotonic()
            if left <= 0:
                break
            item = w.inbox.get(min(left, POLL_S))
            if item is None:
                continue
            if item.step != t:
                w.stats.stale += 1
                if isinstance(item, Message) and item.step > t:
                    # The stages after us serve a later step, so they refused ours as
                    # stale: waiting out the deadline would only keep us a step behind the
                    # other first-stage replicas, every step (stop 27's CI). A head
                    # gradient is for a step the last stage finished: the swarm's is next.
                    self.ahead = item.step + (item.kind == "tgrad")
                    break
            elif isinstance(item, Lost):
                self._on_lost(item)
            else:
                self._on_message(item)

    def _on_lost(self, item: Lost) -> None:
        """A message that could not be sent: another replica's (relayed by us) frees our
        visits of it; one of our own micro-batches is lost."""
        w = self.w
        if item.origin not in ("", w.origin):  # another replica's, via us
            self.visits.drop_all(item.origin, item.mb)
        elif item.kind in ("act", "grad", "tgt") and item.mb in self.pending:
            self.pending.discard(item.mb)
            self.visits.drop_all(w.origin, item.mb)
            w.count_lost(item.reason)
            self.n_lost += 1

    def _on_message(self, item: Message) -> None:
        """A message of our step: an interior visit (CheckFree+), a gradient of one of our
        micro-batches, a last-stage host's head gradient (each host's once)."""
        w = self.w
        if item.kind == "act" and item.hop > 0:
            self.visits.forward(item)
        elif item.kind == "grad" and item.hop > 0:
            if key(item) in self.visits.came_from:
                self.visits.back(item)
        elif item.kind == "grad" and item.mb in self.pending and item.origin in ("", w.origin):
            self.pending.discard(item.mb)
            self.last_back = time.monotonic()
            if self.visits.backward(item) is False:
                self.n_lost += 1
            else:
                self.done += 1
        elif item.kind == "tgrad" and item.sender not in self.tied_from:
            w.runner.stage.add_tied_grad(w.dev(item.tensor))
            self.tied_from.add(item.sender)
            self.last_back = time.monotonic()

    def _finish(self) -> None:
        """What did not come back is lost; the step (if anything came back), the tied
        matrix out, the step counted; a step that got nothing back is paced."""
        w, t, r = self.w, self.t, self.w.runner
        pending, ahead = self.pending, self.ahead
        for k in pending:
            self.visits.drop_all(w.origin, k)
        if pending and ahead:
            w.count_lost(f"step {t}: {len(pending)} micro-batches refused, the swarm is at "
                         f"step {ahead}", len(pending))
        elif pending:
            w.count_lost(f"step {t}: {len(pending)} micro-batches not back within "
                         f"{w.wait_s():.1f} s", len(pending))
        if self.done:
            w.apply()
            w.progress.grad_norm = round(r.grad_norm, 6)
            w.stats.micro_batches += self.done
            w.watch.trained()
        r.optimizer.zero_grad(set_to_none=True)
        w.step = max(t + 1, ahead)
        w.post(("stage", w.n_stages - 1), "tied", w.n_stages - 1, w.step, 0,
               w.n_stages - 1, r.stage.wte.weight.detach(), w.origin)
        w.progress.step = w.step
        w.after_step(w.step)
        w.timed(self.t0, self.last_back)
        if not self.done and not ahead:
            # Nothing came back (every micro-batch lost at once: a full or failed send):
            # the next step begins no sooner than MIN_WAIT_S after this one did. Unpaced,
            # one first stage's counter ran from 251 to 7055 in 3 minutes (issue 27). The
            # step still counts, and the tied matrix still goes: a last stage waits for it
            # before each step, and withholding it stalled a rebuilt last stage for good.
            w.stop.wait(max(0.0, self.t0 + MIN_WAIT_S - time.monotonic()))
