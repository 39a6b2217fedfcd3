"""The training service: the trainer in one dedicated OS thread, gossip averaging around it.

Runtime model (docs/architecture.md): torch runs in one thread of its own (torch releases
the GIL inside its ops, so the trio loop stays responsive); every network object stays on
the trio thread. The two talk through two queues:

    trainer thread --(Boundary(round r, snapshot θ_r))--> trio: exchange with r's partner
    trio --(Outcome(round r, partner θs or none))--> trainer thread: outer step

Round alignment. Pairing needs every peer to agree on the round number, so a node that is
a round or more behind the most advanced live peer (it joined late, restarted, or runs on
a slower device) continues from that peer's round boundary instead of its own step: it
does fewer inner steps that round, and the learning-rate schedule follows the swarm.

DiLoCo (`outer.algorithm = "diloco"`, a baseline) is the exception: its outer optimizer is
`synchronous`, so the trainer waits at each boundary for the round's all-reduce (the
averager's `allreduce`) and steps nothing meanwhile.

The step and the weights. A node that jumps to the swarm's round moves its round clock
(`stats.step`: pairing, the lr schedule), not its weights: what the weights embody is
`stats.trained`, its own inner steps plus what it resumed from (the checkpoint's claim)
plus what averaging brought in (`_credit_averaging`). Its checkpoints claim `trained`,
never the clock: a joiner whose checkpoint pull failed trains from the run's initial
weights, and its checkpoints say so (docs/checkpoints.md, "What a checkpoint claims").

Delayed application. The exchange for round r runs while the inner steps of round r+1
compute. When round r's outcome arrives (at the first inner step after it lands), the
trainer computes φ from the snapshot θ_r and the partner's θ_r (NoLoCo, node/ml/optim) and
moves its live weights to φ plus the local progress made since the snapshot:
θ ← φ + (θ_now − θ_r). If the outcome is still missing when round r+1 ends, round r is
closed with a local outer step (the group is just us): a slow or dead partner delays
nothing. The trainer never waits on the network.

Compressed exchange (`outer.codec = "topk"`). The boundary hands the averager the outer
optimizer's frame (`prepare(θ_r, r)`: the error-fed top-k of the pseudo-gradient, encoded)
instead of θ_r, and the outcome brings the partners' decoded frames; the outer step pairs
them with the frame prepared for that round and is applied late exactly as above. Every
older round is closed before the next frame is prepared, so the error feedback sees the
rounds in order. A round without a partner frame is a local step on our own frame.

Spans: rounds that never wait. When one exchange takes longer than a round (an 86M model
in bf16 is 172 MB each way, about 14 s at 100 Mbit/s, while 50 steps of an H100 take 1.8 s),
an exchange spans k base rounds: only the boundaries r with r % k == 0 start one, and its
outcome may land at any inner step before the next of them (node/ml/optim/overlap.py
applies it with the progress made meanwhile). k follows the measured step time and the
exchange's measured (or, before the first, estimated) seconds (`rounds.span_for`): a
power of two, the node's own or the live peers' median where larger (heartbeats carry
`span`), so that peers agree on which rounds exchange. An outer step then covers k·H inner
steps; rounds averaged and local count outer steps. DiLoCo's synchronous baseline keeps
k = 1: it waits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import trio

from node.errors import DEVICE_MEMORY_EXIT, TrainingFailed
from node.ml.trainer import errors as trainer_errors
from node.ml.types import compressing
from node.process.priority import lower_session_priority, lower_thread_priority
from node.process.trainer_thread import run_trainer_thread
from node.training.outer_rounds import OuterRounds
from node.training.rounds import (
    Boundary,
    Compressed,
    Outcome,
    Snapshot,
    TrainingStats,
    span_for,
    swarm_span,
)
from node.training.state import checkpoint_tensors

if TYPE_CHECKING:
    from node.ml.types import Built, LocalTrainer, OuterOptimizer
    from node.service import NodeContext

log = logging.getLogger("node.training")


def _build_at_node_priority(build: Callable[[], Built]) -> Built:
    """Run `build` in a thread of its own, at the node's priority, and return what it built.

    Building the trainer (model, data, the newest checkpoint loaded) is the end of a join;
    niced among 4 trainers on 2 cores it took 1.2 s, at the node's priority 0.5 s (`node
    bench join`). Not on the trainer thread: torch's worker threads start on a thread's
    first parallel op (a big copy while loading) and keep its nice for good, so the
    trainer's must start after it is niced. This thread's end takes its workers with it."""
    with ThreadPoolExecutor(1, thread_name_prefix="peertrain-build") as pool:
        return pool.submit(build).result()


class TrainingService:
    """Owns the trainer thread for one run. `exchange` is the averager's coroutine and
    `on_snapshot` the checkpoint service's; both are called on the trio thread.

    As a node service (`run(ctx)`), it also follows the live swarm's step (from the
    membership view), publishes the outer optimizer as `ctx.run.outer` once built, and
    notes the join's "first step" phase; a trainer that fails stops the node
    (TrainingFailed, exit 9). Without a context (tests) it only trains."""

    name = "training"
    protocols = ()

    def __init__(self, build: Callable[[], Built],
                 exchange: Callable[[int, Any], Awaitable[Outcome]] | None,
                 max_steps: int | None = None, checkpoint_every: int = 0,
                 on_snapshot: Callable[[Snapshot], Awaitable[None]] | None = None,
                 poison_steps: int | None = None, stats: TrainingStats | None = None,
                 span: int = 1,
                 expected_exchange_s: Callable[[int], float | None] | None = None) -> None:
        # build() runs in the trainer thread: -> (trainer, outer optimizer or None, H).
        # No outer optimizer: the no-communication baseline, plain local training.
        self._build = build
        self._exchange = exchange
        self.max_steps = max_steps
        self.checkpoint_every = checkpoint_every
        self._on_snapshot = on_snapshot
        # A testnet attacker (`--attack`): train this many steps on its poisoned data, then
        # keep that model and only follow the swarm's step (`_send_as_is`).
        self.poison_steps = poison_steps
        self.stats = stats if stats is not None else TrainingStats()
        # Highest step a live peer reported (set from the trio thread). A node that is a
        # round or more behind jumps to the swarm's round: pairing only works when peers
        # agree on the round number (a late joiner, a restart, a slow CPU).
        self.swarm_step = 0
        self._rounds: OuterRounds | None = None  # the open rounds, once training runs
        self._stop = threading.Event()
        self.outer: OuterOptimizer | None = None  # once the trainer thread has built it
        self._run_ctx: Any = None  # the node's RunContext, when run as a service
        # A partner's trained steps as its heartbeats report them (None: not known); set
        # from the membership view when run as a service.
        self._trained_of: Callable[[str], int | None] = lambda peer: None
        # Base rounds per exchange ("Spans" above), read by the trainer thread at each
        # boundary. Fixed (tests), or, run as a service with `expected_exchange_s` (the
        # averager's estimate of one exchange's seconds for a model of n values), set from
        # measurements and the swarm's heartbeats.
        self.span = span
        self._expected_exchange_s = expected_exchange_s
        self._inner_steps: int | None = None  # H, once built

    def statistics(self) -> dict[str, Any]:
        return self.stats.snapshot()

    async def run(self, ctx: NodeContext | None = None, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if ctx is None:
            await self._train_in_thread(task_status)
            return
        self._run_ctx = ctx.the_run()
        self._trained_of = lambda peer: _reported_trained(ctx, peer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_swarm, ctx)
            nursery.start_soon(self._note_first_step, ctx)
            try:
                await self._train_in_thread(task_status)
            except trainer_errors.DeviceMemoryError as e:  # its own exit code and advice
                log.error("training stopped: %s", e)
                raise TrainingFailed(str(e), exit_code=DEVICE_MEMORY_EXIT) from e
            except Exception as e:  # a node asked to train that cannot stops, saying why
                log.error("training stopped: %s: %s", type(e).__name__, e)
                raise TrainingFailed(f"training stopped: {type(e).__name__}: {e}") from e
            nursery.cancel_scope.cancel()
        await trio.sleep_forever()

    async def _follow_swarm(self, ctx: NodeContext) -> None:
        while True:
            self.swarm_step = max(self.swarm_step, ctx.membership.swarm_step())
            self._follow_span(ctx)
            await trio.sleep(ctx.config.heartbeat_s / 2)

    def _follow_span(self, ctx: NodeContext) -> None:
        """The span this node wants (its measured step time, its exchange's seconds) and
        the one it uses (rounds.swarm_span); only for an outer step that overlaps (not
        DiLoCo, which waits, nor gossip learning, which meets its neighbours each round)."""
        st, h, outer = self.stats, self._inner_steps, self.outer
        if (self._expected_exchange_s is None or h is None or not st.params
                or not st.steps_run or outer is None or getattr(outer, "synchronous", False)
                or not getattr(outer, "spans", True)):
            return
        expected = self._expected_exchange_s(st.params)
        if expected is None:
            return
        st.span_wanted = span_for(expected, h * st.step_time(), st.span_wanted)
        reported = [(e.info.get("stats") or {}).get("span") for e in ctx.membership.live()]
        self.span = st.span = swarm_span(st.span_wanted, reported)

    async def _note_first_step(self, ctx: NodeContext) -> None:
        """The end of a join (docs/benchmarks.md): the trainer built (model, data, newest
        checkpoint loaded), then the first step completed."""
        while self.stats.phase == "loading":
            await trio.sleep(0.02)
        if self.stats.phase == "failed":
            return
        ctx.phases.times.setdefault("trainer built",
                                    round(time.monotonic() - ctx.phases.started, 3))
        while self.stats.compute_s == 0:
            await trio.sleep(0.02)
        ctx.phases.times.setdefault("first step",
                                    round(time.monotonic() - ctx.phases.started, 3))

    async def _train_in_thread(self, task_status: trio.TaskStatus[None]) -> None:
        """The trainer thread (node/process/trainer_thread.py) hands boundaries and
        checkpoint snapshots over in order; each exchange and each write runs as a task.
        The thread's own exception is raised here, outside the nursery: the caller gets
        the trainer's error, not an ExceptionGroup around it."""
        send, receive = trio.open_memory_channel[Boundary | Snapshot](16)
        token = trio.lowlevel.current_trio_token()

        def post(item: Boundary | Snapshot) -> None:
            with contextlib.suppress(trio.RunFinishedError, trio.WouldBlock,
                                     trio.BrokenResourceError, trio.ClosedResourceError):
                trio.from_thread.run_sync(send.send_nowait, item, trio_token=token)

        async def hand_over(nursery: trio.Nursery) -> None:
            async for item in receive:
                if isinstance(item, Snapshot):
                    if self._on_snapshot is not None:
                        nursery.start_soon(self._on_snapshot, item)
                else:
                    nursery.start_soon(self._run_exchange, item)

        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hand_over, nursery)
            task_status.started()
            try:
                await run_trainer_thread(lambda: self._thread_main(post), self._stop,
                                         "peertrain-trainer")
            except Exception as e:
                failure = e
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _run_exchange(self, boundary: Boundary) -> None:
        if self._exchange is None:
            outcome = Outcome(boundary.round, [])
        else:
            try:
                outcome = await self._exchange(boundary.round, boundary.snapshot)
            except Exception as e:  # any failure is a local step, never a dead trainer
                log.warning("round %d: exchange failed (%r); local outer step", boundary.round, e)
                outcome = Outcome(boundary.round, [])
        if outcome.partner_thetas and not outcome.partner_trained:
            known = [t for t in map(self._trained_of, outcome.peers) if t is not None]
            outcome = dataclasses.replace(outcome, partner_trained=tuple(known))
        if self._rounds is not None:  # always, once a boundary was posted
            self._rounds.deliver(outcome)

    # -- the trainer thread -----------------------------------------------------------------

    def _thread_main(self, post: Callable[[Any], None]) -> None:
        try:
            trainer, outer, inner_steps = _build_at_node_priority(self._build)
            if getattr(getattr(trainer, "config", None), "threads", 0) != 1:
                lower_thread_priority()  # before any step starts torch's worker threads
            self.outer = outer
            self._inner_steps = inner_steps
            if self._run_ctx is not None:
                self._run_ctx.outer = outer  # read by SybilWall's history gossip
            self._train(trainer, outer, inner_steps, post)
        except BaseException as e:  # raised in the trio task, which logs it
            self.stats.phase = "failed"
            self.stats.error = f"{type(e).__name__}: {e}"
            raise

    def _train(self, trainer: LocalTrainer, outer: OuterOptimizer | None, inner_steps: int,
               post: Callable[[Any], None]) -> None:
        st = self.stats
        st.params = int(trainer.parameters_vector().numel())
        st.phase = "training"
        st.started_at = time.monotonic()
        st.step = trainer.step_count  # a resumed trainer starts at its checkpoint's step
        # ... and its weights carry what the checkpoint claimed (resume_newest sets it);
        # never more than the clock
        st.trained = min(st.trained, st.step)
        rounds = self._rounds = None if outer is None else OuterRounds(
            outer, trainer.parameters_vector, trainer.set_parameters_vector, st,
            on_averaged=self._credit_averaging)
        # Checkpoints are due each time the step passes a multiple of checkpoint_every, not
        # only on the multiple itself: a node that jumps to the swarm's round may land on
        # (or skip) it, and a restarted, lagging node went hundreds of steps without one.
        saved = st.step // self.checkpoint_every if self.checkpoint_every else 0
        first = st.step
        while not self._stop.is_set():
            if self.max_steps is not None and st.step >= self.max_steps:
                st.phase = "done"
                return
            if rounds is not None:  # none: no communication, no outcomes
                rounds.apply()
            if self.poison_steps is not None and st.step - first >= self.poison_steps:
                self._send_as_is(trainer, rounds, inner_steps, post)
                return
            if (rounds is not None and self.poison_steps is None
                    and self.swarm_step >= st.step + inner_steps):
                # Continue one step before the swarm's last exchange boundary, so that the
                # next step reaches it: partners that got there first wait for us a few
                # seconds (Averager.deadline). Landing on the boundary itself skipped it, and
                # a slow node that kept catching up met its partners in no round at all (the
                # SybilWall swarm test, under load: 146 jumps, 330 failed exchanges). Past
                # that boundary already (inside a span): to the swarm's step.
                span_len = inner_steps * self._span(rounds.outer)
                target = self.swarm_step // span_len * span_len - 1
                if target <= st.step:
                    target = self.swarm_step - 1
                # Only the clock jumps: the weights keep the steps they were trained
                # (`trained`), and so do the checkpoints written from them.
                log.info("step %d is behind the swarm (%d): the round clock continues from "
                         "step %d; the weights keep their %d trained steps",
                         st.step, self.swarm_step, target, st.trained)
                if target // span_len > st.step // span_len:  # an exchange boundary passed
                    rounds.close_all()
                trainer.step_count = st.step = max(st.step, target)
            t0 = time.perf_counter()
            s = trainer.step()
            if st.compute_s == 0:  # a one-thread trainer's first step, the join's last phase,
                lower_thread_priority()  # ran at the node's priority: 0.6 s niced, 0.2 s not
                lower_session_priority()  # the join is over: other joiners go first
            st.compute_s += time.perf_counter() - t0  # evaluation included: it is compute too
            st.steps_run += 1
            st.step, st.loss, st.lr = s.step, s.loss, s.lr
            st.trained = min(st.trained + 1, st.step)
            if s.val_loss is not None:
                st.val_loss = s.val_loss
                st.val_metrics = {k: round(v, 4) for k, v in (trainer.last_eval or {}).items()}
                if st.first_val_loss is None:
                    st.first_val_loss = s.val_loss
            if self.checkpoint_every and s.step // self.checkpoint_every > saved:
                saved = s.step // self.checkpoint_every
                post(Snapshot(s.step, checkpoint_tensors(trainer, outer), trained=st.trained,
                              parent=st.lineage))
            if (rounds is not None and s.step % inner_steps == 0
                    and s.step // inner_steps % self._span(rounds.outer) == 0):
                # the clock starts before the post: the exchange may begin (and its
                # all-reduce run) before this thread is back from handing the boundary over
                posted = time.perf_counter()
                self._post_boundary(s.step // inner_steps, rounds, post)
                if getattr(rounds.outer, "synchronous", False):
                    self._wait_for(st.round, rounds, posted)

    def _span(self, outer: OuterOptimizer | None) -> int:
        """Base rounds per exchange now: 1 for a synchronous outer step (DiLoCo waits)."""
        return 1 if getattr(outer, "synchronous", False) else max(1, int(self.span))

    def _send_as_is(self, trainer: LocalTrainer, rounds: OuterRounds | None, inner_steps: int,
                    post: Callable[[Any], None]) -> None:
        """A testnet attacker past its poisoning steps: the model stays as it is, the step
        follows the swarm's, and each round crossed posts that model as the boundary's.

        Its identities (separate processes) then stay bit-identical without training in
        lockstep. Replaying the steps a sybil was behind instead cost each identity an
        honest node's CPU, and on a loaded machine the replay never caught up with a swarm
        that skips (stop 26's CI: no round with both sybils in 300 s). It never steps past
        the swarm: a peer ahead makes every honest node skip steps to its round."""
        st = self.stats
        while not self._stop.is_set():
            if rounds is not None:
                rounds.apply()
            target = self.swarm_step
            if self.max_steps is not None:
                target = min(target, self.max_steps)
            if target > st.step:
                crossed = target // inner_steps > st.step // inner_steps
                trainer.step_count = st.step = target
                if crossed and rounds is not None:
                    self._post_boundary(target // inner_steps, rounds, post)
            if self.max_steps is not None and st.step >= self.max_steps:
                st.phase = "done"
                return
            self._stop.wait(0.05)

    def _post_boundary(self, r: int, rounds: OuterRounds, post: Callable[[Any], None]) -> None:
        """Round r's boundary: a round whose exchange has not come back by now is closed
        locally, and the model goes out for round r's exchange."""
        self.stats.round = r
        snapshot = rounds.open(r)
        started = time.perf_counter()
        outer = rounds.outer
        if compressing(outer):
            # a topk run: the frame of this round's pseudo-gradient goes out, not θ_r (its
            # error feedback is taken now, after every older round was closed above)
            post(Boundary(r, Compressed((outer.prepare(snapshot, r),), snapshot.numel())))
        else:
            post(Boundary(r, snapshot.clone()))
        self.stats.outer_s += time.perf_counter() - started

    def _wait_for(self, r: int, rounds: OuterRounds, started: float) -> None:
        """DiLoCo: no inner step before round r's all-reduce is back (the averager's own
        deadlines bound the wait); the time from posting the boundary to its outcome is
        counted apart from compute."""
        while r in rounds.pending and not self._stop.is_set():
            rounds.apply()
            if r in rounds.pending:
                self._stop.wait(0.005)
        self.stats.sync_wait_s += time.perf_counter() - started

    def _credit_averaging(self, outcome: Outcome) -> None:
        """An averaged round moved the weights toward the group's mean, so they now carry
        the mean of the group's trained steps (ours and each partner's whose heartbeats
        report it), if that is more than ours: a node that started from scratch catches
        up as its weights do, about half the gap per round with one partner. A partner's
        count only raises ours by its share, and never past our clock: one peer that
        claims too much cannot make our checkpoints claim the swarm's step."""
        st = self.stats
        group = [st.trained, *(min(t, st.step) for t in outcome.partner_trained if t >= 0)]
        st.trained = max(st.trained, min(st.step, sum(group) // len(group)))


def _reported_trained(ctx: NodeContext, peer: str) -> int | None:
    """`trained` from `peer`'s last heartbeat, if it is a sane int (an older node sends none)."""
    entry = ctx.membership.book.get(peer)
    value = ((entry.info.get("stats") or {}) if entry is not None else {}).get("trained")
    return value if type(value) is int and value >= 0 else None
