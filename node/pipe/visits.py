"""A micro-batch's visits of one stage: forward on to the next visit, gradient back to the
one before (both loops run them: drive.py, serve_loop.py).

A micro-batch is named by its origin (the first-stage replica that cut it, its peer id),
its step and its index: with two first-stage replicas and one host left at a later stage,
that host gets micro-batch k of the step from both, and keyed by index alone the second
looked like a duplicate (stale, every step).

With CheckFree+'s swap (schedule.hops) an odd micro-batch visits the first and the last
stage twice: each message names its visit (`hop`), and saved activations are keyed by
(origin, micro-batch, visit).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from node.pipe.links import Message

if TYPE_CHECKING:
    from node.pipe.worker import StageWorker

log = logging.getLogger("node.pipeline")

Key = tuple[str, int, int]  # (origin, micro-batch, visit): one visit of one micro-batch


def key(item: Message) -> Key:
    return item.origin, item.mb, item.hop


class Visits:
    """The visits this stage ran forward and owes a gradient for (`came_from`: who sent
    each one's activations, where its gradient goes back), and those already run in the
    step (`seen`: a second copy is stale)."""

    def __init__(self, worker: StageWorker) -> None:
        self.w = worker
        self.came_from: dict[Key, str] = {}
        self.seen: set[Key] = set()

    def forward(self, item: Message) -> None:
        """Activations in for a visit that is not the micro-batch's last: forward, on to
        the next visit (a visit seen before is stale; one the stage refuses is lost)."""
        w, k = self.w, key(item)
        if k in self.seen or k in self.came_from:
            w.stats.stale += 1
            return
        self.seen.add(k)
        path = w.paths[item.mb]
        out = self._forward(k, item.tensor, path[item.hop])
        if out is None:
            return
        self.came_from[k] = item.sender
        nxt = item.hop + 1
        w.post(("next", item.step, item.mb, item.hop), "act", path[nxt].stage,
               item.step, item.mb, nxt, out, item.origin)

    def _forward(self, k: Key, x: Any, hop: Any) -> Any:
        try:
            return self.w.runner.forward(k, self.w.dev(x), hop)
        except Exception as e:  # PipelineFull, a shape the model refuses: that mb is lost
            self.w.count_lost(f"micro-batch {k[1]}: {e}")
            return None

    def back(self, item: Message) -> bool:
        """A gradient for one of our visits past the first: backward, back to the visit
        before. False if the gradient did not fit (logged, that micro-batch lost)."""
        sender = self.came_from.pop(key(item))
        g = self.backward(item)
        if g is False:
            return False
        prev = item.hop - 1
        self.w.post(("peer", sender), "grad", self.w.paths[item.mb][prev].stage, item.step,
                    item.mb, prev, g, item.origin)
        return True

    def backward(self, item: Message) -> Any:
        """The input's gradient (None on the first stage), or False: a gradient that does
        not fit the saved activations (a shape the wire allows but this micro-batch is
        not) costs that micro-batch, logged, never the worker."""
        w = self.w
        try:
            return w.runner.backward(key(item), w.dev(item.tensor))
        except (RuntimeError, ValueError, KeyError) as e:
            w.runner.drop(key(item))
            w.count_lost(f"gradient of micro-batch {item.mb} from {item.sender} refused: {e}")
            log.warning("pipeline: refused the gradient of step %d micro-batch %d from %s: "
                        "%s", item.step, item.mb, item.sender, e,
                        extra={"peer": item.sender, "reason": "pipe gradient"})
            return False

    def drop_all(self, origin: str, mb: int) -> None:
        """A micro-batch that will not complete: forget every visit of it we hold."""
        for k in [k for k in self.came_from if k[:2] == (origin, mb)]:
            del self.came_from[k]
        for h in range(len(self.w.paths[mb])):
            self.w.runner.drop((origin, mb, h))

    def awaited(self) -> int:
        """A serving stage with nothing arriving: the stage of the next visit of a
        micro-batch it ran forward (its gradient), else the stage before its own (the
        activations)."""
        for _, mb, hop in self.came_from:
            return self.w.paths[mb][hop + 1].stage
        return max(0, self.w.stage - 1)
