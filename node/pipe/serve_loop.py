"""The loop of every stage but the first: it serves (worker.py runs it).

Activations in -> forward -> out, gradients in -> backward -> back to whoever sent the
activations (visits.py). A stage steps when all of the step's micro-batches are back,
when a newer step's activations arrive, or when the step has been quiet past its deadline
(deadlines.py); older micro-batches are refused as stale. A serving stage steps once every
visit its step sends it is back (`arrivals`: the service counts them from the stage map
and the routing, so a host left alone on its stage waits for the lost replica's share too).

The last stage computes the loss once a micro-batch's activations and targets are both
in, sends its head gradient to the first stage when it steps, and uses the newest tied
matrix (waiting for the one of the step, within the deadline, before its first
micro-batch). With CheckFree+'s swap (schedule.hops) it also forwards its blocks' visit
of odd micro-batches before the head's.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from node.pipe.deadlines import POLL_S
from node.pipe.links import Lost, Message
from node.pipe.visits import Visits, key

if TYPE_CHECKING:
    from node.pipe.worker import StageWorker

# the head's activations and targets not paired yet, by (kind, step, origin, mb)
Waiting = dict[tuple[str, int, str, int], Message]


class ServeLoop:
    """A serving stage's state across steps: the step being served and what it holds."""

    def __init__(self, worker: StageWorker) -> None:
        self.w = worker
        self.cur = -1  # the step being served
        self.is_open = False  # cur still takes micro-batches
        self.visits = Visits(worker)  # who sent each visit of cur; visits already run
        self.done = 0
        self.want = worker.visits  # visits cur brings this host (`arrivals`, when it opened)
        self.losses: list[float] = []
        self.waiting: Waiting = {}
        self.t_start = self.quiet_since = time.monotonic()
        self.last_back: float | None = None
        # The last stage: what arrived while it awaited the tied matrix, served after.
        self.deferred: deque[Message | Lost] = deque()

    def run(self) -> None:
        w = self.w
        while not w.stop.is_set():
            item = self.deferred.popleft() if self.deferred else w.inbox.get(POLL_S)
            now = time.monotonic()
            if item is None:
                if self.is_open and now - self.quiet_since > w.wait_s():
                    self._finish()
                w.watch.awaiting = self.visits.awaited()
                continue
            self.quiet_since = now
            if isinstance(item, Lost):
                if item.step == self.cur:
                    self.visits.drop_all(item.origin, item.mb)
                    w.count_lost(item.reason)
            elif item.kind == "tied":
                self._set_tied(item)
            elif item.kind == "grad":
                if item.step != self.cur or key(item) not in self.visits.came_from:
                    w.stats.stale += 1
                elif self.visits.back(item):
                    self._visit_done()
            else:  # activations (or, where the head runs, targets)
                self._arrived(item, now)

    def _arrived(self, item: Message, now: float) -> None:
        """Activations or targets: refused if stale, opening the step if newer, forwarded
        or kept for the head."""
        w = self.w
        if item.step < self.cur or (item.step == self.cur and not self.is_open):
            w.stats.stale += 1
            return
        if item.step > self.cur:
            self._open(item.step, now)
        if item.kind == "act" and not w.paths[item.mb][item.hop].head:
            self.visits.forward(item)
            return
        self._head(item)

    def _open(self, step: int, now: float) -> None:
        """A newer step's first micro-batch: the open step ends, `step` opens."""
        w = self.w
        if self.is_open:
            self._finish()
        self.cur, self.is_open, self.t_start = step, True, now
        self.want = max(1, w.arrivals(step))
        self.visits.seen.clear()
        self.waiting = {k: v for k, v in self.waiting.items() if k[1] >= step}
        if w.stats.first_mb_at is None:
            w.stats.first_mb_at = now
        if w.runner.stage.is_last:
            self._await_tied(step)

    def _head(self, item: Message) -> None:
        """The head: activations or targets kept until their pair is in, then the loss,
        backward, and the gradient back to whoever sent the activations."""
        w, r, cur, waiting = self.w, self.w.runner, self.cur, self.waiting
        waiting[(item.kind, item.step, item.origin, item.mb)] = item
        bound = w.inbox.capacity
        if len(waiting) > bound:  # bounded: the oldest go
            for old in sorted(waiting, key=lambda k: (k[1], k[3]))[:len(waiting) - bound]:
                del waiting[old]
        for kind, step, origin, mb in list(waiting):
            if not self.is_open:
                break
            if kind != "act" or step != cur:
                continue
            act, tgt = waiting.get(("act", cur, origin, mb)), waiting.get(
                ("tgt", cur, origin, mb))
            if act is None or tgt is None or key(act) in self.visits.seen:
                continue
            del waiting[("act", cur, origin, mb)], waiting[("tgt", cur, origin, mb)]
            k = key(act)
            self.visits.seen.add(k)
            try:
                loss = r.forward_loss(k, w.dev(act.tensor), w.dev(tgt.tensor),
                                      w.paths[mb][act.hop])
                g = r.backward_loss(k, 1.0 / w.M)
            except Exception as e:  # PipelineFull, a shape the model refuses
                r.drop(k)
                w.count_lost(f"micro-batch {mb}: {e}")
                continue
            self.losses.append(loss)
            prev = act.hop - 1
            w.post(("peer", act.sender), "grad", w.paths[mb][prev].stage, cur, mb, prev, g,
                   origin)
            self._visit_done()

    def _visit_done(self) -> None:
        self.last_back = time.monotonic()
        self.done += 1
        self.w.stats.micro_batches += 1
        if self.done >= self.want:
            self._finish()

    def _finish(self) -> None:
        """The step ends: what is not back is lost; the stage steps if anything came
        back (the last stage sending its head gradient first), and the step is counted."""
        w, r, cur = self.w, self.w.runner, self.cur
        for k in list(self.visits.came_from):
            r.drop(k)
            w.count_lost(f"step {cur}: micro-batch {k[1]} not back in time")
        self.visits.came_from.clear()
        if self.done:
            if r.stage.is_last and r.stage.tied_grad() is not None:
                w.post(("stage", 0), "tgrad", 0, cur, 0, 0, r.stage.tied_grad().detach(), "")
                r.stage.tied.grad = None
            w.apply()
            w.progress.grad_norm = round(r.grad_norm, 6)
            w.timed(self.t_start, self.last_back)
            w.watch.trained()
            if self.losses:
                w.progress.loss = round(sum(self.losses) / len(self.losses), 4)
                w.watch.loss_at = time.monotonic()
        self.last_back = None
        r.optimizer.zero_grad(set_to_none=True)
        w.progress.step = cur + 1
        w.after_step(cur + 1)
        self.done, self.losses, self.is_open = 0, [], False

    def _set_tied(self, item: Message) -> None:
        """The last stage: the newest tied matrix the first stage sent."""
        if item.step >= self.w.tied_version:
            self.w.runner.stage.set_tied(self.w.dev(item.tensor))
            self.w.tied_version = item.step

    def _await_tied(self, step: int) -> None:
        """Last stage, before step `step`'s first micro-batch: the tied matrix the first
        stage sent after step - 1, within the deadline; else run on the one we have.
        What else arrives meanwhile is served after (`deferred`)."""
        w = self.w
        if w.tied_version >= step or step == 0:
            return
        deadline = time.monotonic() + min(w.wait_s(), 10.0)
        while time.monotonic() < deadline and not w.stop.is_set():
            item = w.inbox.get(min(deadline - time.monotonic(), POLL_S))
            if item is None:
                continue
            if isinstance(item, Message) and item.kind == "tied":
                self._set_tied(item)
                if w.tied_version >= step:
                    return
            elif item.step >= step and len(self.deferred) < w.inbox.capacity:
                self.deferred.append(item)
            else:
                w.stats.stale += 1
        w.stats.stale_tied += 1
