"""One pipeline stage's loop, in the trainer thread (torch lives here; docs/architecture.md).

The worker owns a `StageRunner` (node/ml/pipeline/runner.py) and talks to the trio thread
through the stage's `Inbox` (messages in) and `post` (messages out: the trio side picks
the peer). It never waits without a deadline:

* The first stage drives: each step it reads a batch, cuts it into micro-batches, sends
  each one's activations to the next stage and its targets to the last stage, then waits
  for the gradients (and the last stage's head gradient) until the step's deadline; what
  has not come back by then is dropped (`StageRunner.drop`), the rest steps. A step that
  got nothing back lasts at least MIN_WAIT_S (the counter cannot run away). It then
  sends the updated tied matrix to the last stage. A message for a later step (another
  first-stage replica's, relayed) means the stages after it moved on: it gives up the
  step at once and joins theirs (replicas one step apart lost every step otherwise).
* Any other stage serves: activations in -> forward -> out, gradients in -> backward ->
  back to whoever sent the activations. A stage steps when all of the step's
  micro-batches are back, when a newer step's activations arrive, or when the step has
  been quiet past its deadline; older micro-batches are refused as stale.
* The last stage computes the loss once a micro-batch's activations and targets are both
  in, sends its head gradient to the first stage when it steps, and uses the newest tied
  matrix (waiting for the one of the step, within the deadline, before its first
  micro-batch).

A micro-batch is named by its origin (the first-stage replica that cut it, its peer id),
its step and its index: with two first-stage replicas and one host left at a later stage,
that host gets micro-batch k of the step from both, and keyed by index alone the second
looked like a duplicate (stale, every step). A serving stage steps once every visit its
step sends it is back (`arrivals`: the service counts them from the stage map and the
routing, so a host left alone on its stage waits for the lost replica's share too).

With CheckFree+'s swap (schedule.hops) an odd micro-batch visits the first and the last
stage twice: each message names its visit (`hop`), saved activations are keyed by
(origin, micro-batch, visit), the first stage also serves its blocks' visit while it
drives, and the last also forwards its blocks' visit before the head's.

The deadline is measured: 4 x the EWMA of the step's round trip, at least MIN_WAIT_S
(FIRST_WAIT_S before the first step completes: every stage warms up then).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from node.pipe.links import Inbox, Lost, Message
from node.pipe.stall import StallWatch

log = logging.getLogger("node.pipeline")

MIN_WAIT_S = 5.0
FIRST_WAIT_S = 60.0
POLL_S = 0.5


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
Key = tuple[str, int, int]  # (origin, micro-batch, visit): one visit of one micro-batch


class StageWorker:
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
        self._deferred: deque[Message | Lost] = deque()  # read while awaiting the tied matrix
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

    def _apply(self) -> None:
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
        if self.stats.step_s == 0:
            return self.first_wait_s
        return max(MIN_WAIT_S, 4 * self.stats.step_s)

    def _timed(self, t0: float, last_back: float | None) -> None:
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

    def _after_step(self, step: int) -> None:
        """The replicas' outer round (replicas.py) and the checkpoint, under the lock
        weights are served by."""
        if self.replicas is not None or self.on_step is not None:
            with self.lock:
                if self.replicas is not None:
                    self.replicas.after_step(step)
                if self.on_step is not None:
                    self.on_step(step)

    def _lost(self, why: str, n: int = 1) -> None:
        self.stats.dropped += n
        self.stats.last_reason = why

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

    def _dev(self, t: Any) -> Any:
        return t if self.device == "cpu" else t.to(self.device)

    # -- the first stage -----------------------------------------------------------------

    def drive_step(self) -> None:
        """One step: micro-batches out, gradients back within the deadline, step. With
        CheckFree+'s swap the first stage also runs its blocks as an interior visit of
        odd micro-batches (`_visit`), between sending their embedding and its gradient."""
        from node.ml.pipeline.schedule import micro_batches

        assert self.batches is not None
        self.step = max(self.step, self.leader_step())
        t, r = self.step, self.runner
        t0 = time.monotonic()
        x, y = self.batches()
        pending = set()
        for k, (xk, yk) in enumerate(micro_batches(x, y, self.M)):
            path = self.paths[k]
            out = r.forward((self.origin, k, 0), self._dev(xk), path[0])
            pending.add(k)
            self.post(("last", t, k), "tgt", path[-1].stage, t, k, len(path) - 1, yk,
                      self.origin)
            self.post(("next", t, k, 0), "act", path[1].stage, t, k, 1, out, self.origin)
        if self.stats.first_mb_at is None:
            self.stats.first_mb_at = t0
        # A head gradient from each last-stage host the step's micro-batches reach: each
        # sends its own when it has all of them (none after a loss). Going on at the first
        # let our next micro-batches overtake another first-stage replica's last one of
        # step t at the other last-stage host, which then refused that one as stale (a
        # lost micro-batch, and a deadline for every host).
        need_tied = max(1, self.last_hosts(t))
        tied_from: set[str] = set()
        done = 0
        deadline = t0 + self.wait_s()
        lost = 0
        ahead = 0  # a later step the swarm is at, seen in a message for it: ours is lost
        last_back: float | None = None
        came_from: dict[Key, str] = {}  # our interior visits awaiting gradients
        seen: set[Key] = set()  # ... and those already run
        while (pending or (len(tied_from) < need_tied and not lost)) and not self.stop.is_set():
            # gradients from the next visit's stage; then the last stage's head gradient
            self.watch.awaiting = self.paths[min(pending)][1].stage if pending \
                else self.n_stages - 1
            left = deadline - time.monotonic()
            if left <= 0:
                break
            item = self.inbox.get(min(left, POLL_S))
            if item is None:
                continue
            if item.step != t:
                self.stats.stale += 1
                if isinstance(item, Message) and item.step > t:
                    # The stages after us serve a later step, so they refused ours as
                    # stale: waiting out the deadline would only keep us a step behind the
                    # other first-stage replicas, every step (stop 27's CI). A head
                    # gradient is for a step the last stage finished: the swarm's is next.
                    ahead = item.step + (item.kind == "tgrad")
                    break
                continue
            if isinstance(item, Lost):
                if item.origin not in ("", self.origin):  # another replica's, via us
                    self._drop_all(item.origin, item.mb, came_from)
                elif item.kind in ("act", "grad", "tgt") and item.mb in pending:
                    pending.discard(item.mb)
                    self._drop_all(self.origin, item.mb, came_from)
                    self._lost(item.reason)
                    lost += 1
                continue
            if item.kind == "act" and item.hop > 0:
                self._visit(item, came_from, seen)
            elif item.kind == "grad" and item.hop > 0:
                if _key(item) in came_from:
                    self._back(item, came_from)
            elif item.kind == "grad" and item.mb in pending and item.origin in ("", self.origin):
                pending.discard(item.mb)
                last_back = time.monotonic()
                if self._backward(item) is False:
                    lost += 1
                    continue
                done += 1
            elif item.kind == "tgrad" and item.sender not in tied_from:
                r.stage.add_tied_grad(self._dev(item.tensor))
                tied_from.add(item.sender)
                last_back = time.monotonic()
        for k in pending:
            self._drop_all(self.origin, k, came_from)
        if pending and ahead:
            self._lost(f"step {t}: {len(pending)} micro-batches refused, the swarm is at "
                       f"step {ahead}", len(pending))
        elif pending:
            self._lost(f"step {t}: {len(pending)} micro-batches not back within "
                       f"{self.wait_s():.1f} s", len(pending))
        if done:
            self._apply()
            self.progress.grad_norm = round(r.grad_norm, 6)
            self.stats.micro_batches += done
            self.watch.trained()
        r.optimizer.zero_grad(set_to_none=True)
        self.step = max(t + 1, ahead)
        self.post(("stage", self.n_stages - 1), "tied", self.n_stages - 1, self.step, 0,
                  self.n_stages - 1, r.stage.wte.weight.detach(), self.origin)
        self.progress.step = self.step
        self._after_step(self.step)
        self._timed(t0, last_back)
        if not done and not ahead:
            # Nothing came back (every micro-batch lost at once: a full or failed send):
            # the next step begins no sooner than MIN_WAIT_S after this one did. Unpaced,
            # one first stage's counter ran from 251 to 7055 in 3 minutes (issue 27). The
            # step still counts, and the tied matrix still goes: a last stage waits for it
            # before each step, and withholding it stalled a rebuilt last stage for good.
            self.stop.wait(max(0.0, t0 + MIN_WAIT_S - time.monotonic()))

    def _visit(self, item: Message, came_from: dict[Key, str], seen: set[Key]) -> None:
        """Activations in for a visit that is not the micro-batch's last: forward, on to
        the next visit (a visit seen before is stale; one the stage refuses is lost)."""
        key = _key(item)
        if key in seen or key in came_from:
            self.stats.stale += 1
            return
        seen.add(key)
        path = self.paths[item.mb]
        out = self._forward(key, item.tensor, path[item.hop])
        if out is not None:
            came_from[key] = item.sender
            nxt = item.hop + 1
            self.post(("next", item.step, item.mb, item.hop), "act", path[nxt].stage,
                      item.step, item.mb, nxt, out, item.origin)

    def _back(self, item: Message, came_from: dict[Key, str]) -> bool:
        """A gradient for one of our visits past the first: backward, back to the visit
        before. False if the gradient did not fit (logged, that micro-batch lost)."""
        sender = came_from.pop(_key(item))
        g = self._backward(item)
        if g is False:
            return False
        prev = item.hop - 1
        self.post(("peer", sender), "grad", self.paths[item.mb][prev].stage, item.step,
                  item.mb, prev, g, item.origin)
        return True

    def _drop_all(self, origin: str, mb: int, came_from: dict[Key, str]) -> None:
        """A micro-batch that will not complete: forget every visit of it we hold."""
        for key in [k for k in came_from if k[:2] == (origin, mb)]:
            del came_from[key]
        for h in range(len(self.paths[mb])):
            self.runner.drop((origin, mb, h))

    # -- the other stages ----------------------------------------------------------------

    def serve(self) -> None:
        r = self.runner
        cur = -1  # the step being served
        is_open = False  # cur still takes micro-batches
        came_from: dict[Key, str] = {}  # a visit -> who sent its activations
        seen: set[Key] = set()  # visits of cur already run
        done = 0
        want = self.visits  # visits cur brings this host (`arrivals`, when it opened)
        losses: list[float] = []
        # the head: activations and targets not paired yet, by (kind, step, origin, mb)
        waiting: dict[tuple[str, int, str, int], Message] = {}
        t_start = quiet_since = time.monotonic()
        last_back: float | None = None

        def finish() -> None:
            nonlocal done, losses, is_open, last_back
            for key in list(came_from):
                r.drop(key)
                self._lost(f"step {cur}: micro-batch {key[1]} not back in time")
            came_from.clear()
            if done:
                if self.runner.stage.is_last and r.stage.tied_grad() is not None:
                    self.post(("stage", 0), "tgrad", 0, cur, 0, 0, r.stage.tied_grad().detach(),
                              "")
                    r.stage.tied.grad = None
                self._apply()
                self.progress.grad_norm = round(r.grad_norm, 6)
                self._timed(t_start, last_back)
                self.watch.trained()
                if losses:
                    self.progress.loss = round(sum(losses) / len(losses), 4)
                    self.watch.loss_at = time.monotonic()
            last_back = None
            r.optimizer.zero_grad(set_to_none=True)
            self.progress.step = cur + 1
            self._after_step(cur + 1)
            done, losses, is_open = 0, [], False

        def visit_done() -> None:
            nonlocal done, last_back
            last_back = time.monotonic()
            done += 1
            self.stats.micro_batches += 1
            if done >= want:
                finish()

        while not self.stop.is_set():
            item = self._deferred.popleft() if self._deferred else self.inbox.get(POLL_S)
            now = time.monotonic()
            if item is None:
                if is_open and now - quiet_since > self.wait_s():
                    finish()
                self.watch.awaiting = self._awaited(came_from)
                continue
            quiet_since = now
            if isinstance(item, Lost):
                if item.step == cur:
                    self._drop_all(item.origin, item.mb, came_from)
                    self._lost(item.reason)
                continue
            if item.kind == "tied":
                if item.step >= self.tied_version:
                    r.stage.set_tied(self._dev(item.tensor))
                    self.tied_version = item.step
                continue
            if item.kind == "grad":
                if item.step != cur or _key(item) not in came_from:
                    self.stats.stale += 1
                    continue
                if self._back(item, came_from):
                    visit_done()
                continue
            # activations (or, where the head runs, targets)
            if item.step < cur or (item.step == cur and not is_open):
                self.stats.stale += 1
                continue
            if item.step > cur:
                if is_open:
                    finish()
                cur, is_open, t_start = item.step, True, now
                want = max(1, self.arrivals(cur))
                seen.clear()
                waiting = {k: v for k, v in waiting.items() if k[1] >= cur}
                if self.stats.first_mb_at is None:
                    self.stats.first_mb_at = now
                if self.runner.stage.is_last:
                    self._await_tied(cur)
            if item.kind == "act" and not self.paths[item.mb][item.hop].head:
                self._visit(item, came_from, seen)
                continue
            waiting[(item.kind, item.step, item.origin, item.mb)] = item
            bound = self.inbox.capacity
            if len(waiting) > bound:  # bounded: the oldest go
                for old in sorted(waiting, key=lambda k: (k[1], k[3]))[:len(waiting) - bound]:
                    del waiting[old]
            for kind, step, origin, mb in list(waiting):
                if not is_open:
                    break
                if kind != "act" or step != cur:
                    continue
                act, tgt = waiting.get(("act", cur, origin, mb)), waiting.get(
                    ("tgt", cur, origin, mb))
                if act is None or tgt is None or _key(act) in seen:
                    continue
                del waiting[("act", cur, origin, mb)], waiting[("tgt", cur, origin, mb)]
                key = _key(act)
                seen.add(key)
                try:
                    loss = r.forward_loss(key, self._dev(act.tensor), self._dev(tgt.tensor),
                                          self.paths[mb][act.hop])
                    g = r.backward_loss(key, 1.0 / self.M)
                except Exception as e:  # PipelineFull, a shape the model refuses
                    r.drop(key)
                    self._lost(f"micro-batch {mb}: {e}")
                    continue
                losses.append(loss)
                prev = act.hop - 1
                self.post(("peer", act.sender), "grad", self.paths[mb][prev].stage, cur, mb,
                          prev, g, origin)
                visit_done()

    def _awaited(self, came_from: dict[Key, str]) -> int:
        """A serving stage with nothing arriving: the stage of the next visit of a
        micro-batch it ran forward (its gradient), else the stage before its own (the
        activations)."""
        for _, mb, hop in came_from:
            return self.paths[mb][hop + 1].stage
        return max(0, self.stage - 1)

    def _backward(self, item: Message) -> Any:
        """The input's gradient (None on the first stage), or False: a gradient that does
        not fit the saved activations (a shape the wire allows but this micro-batch is
        not) costs that micro-batch, logged, never the worker."""
        try:
            return self.runner.backward(_key(item), self._dev(item.tensor))
        except (RuntimeError, ValueError, KeyError) as e:
            self.runner.drop(_key(item))
            self._lost(f"gradient of micro-batch {item.mb} from {item.sender} refused: {e}")
            log.warning("pipeline: refused the gradient of step %d micro-batch %d from %s: "
                        "%s", item.step, item.mb, item.sender, e,
                        extra={"peer": item.sender, "reason": "pipe gradient"})
            return False

    def _forward(self, key: Key, x: Any, hop: Any) -> Any:
        try:
            return self.runner.forward(key, self._dev(x), hop)
        except Exception as e:  # PipelineFull, a shape the model refuses: that mb is lost
            self._lost(f"micro-batch {key[1]}: {e}")
            return None

    def _await_tied(self, step: int) -> None:
        """Last stage, before step `step`'s first micro-batch: the tied matrix the first
        stage sent after step - 1, within the deadline; else run on the one we have.
        What else arrives meanwhile is served after (`_deferred`)."""
        if self.tied_version >= step or step == 0:
            return
        deadline = time.monotonic() + min(self.wait_s(), 10.0)
        while time.monotonic() < deadline and not self.stop.is_set():
            item = self.inbox.get(min(deadline - time.monotonic(), POLL_S))
            if item is None:
                continue
            if isinstance(item, Message) and item.kind == "tied":
                if item.step >= self.tied_version:
                    self.runner.stage.set_tied(self._dev(item.tensor))
                    self.tied_version = item.step
                if self.tied_version >= step:
                    return
            elif item.step >= step and len(self._deferred) < self.inbox.capacity:
                self._deferred.append(item)
            else:
                self.stats.stale += 1
        self.stats.stale_tied += 1


def _key(item: Message) -> Key:
    return item.origin, item.mb, item.hop
