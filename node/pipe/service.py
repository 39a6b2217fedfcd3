"""The pipeline service: this node hosts one stage of a pipeline run (docs/pipeline.md).

On start it picks its stage from the live membership (placement.py: the stage with the
fewest live hosts, ties to the lowest), writes it in its own namespace of the run
document (`peer/<id>/stage`), as a leased claim (`stage/<n>/<id>`, claims.py: the map
every node agrees on; a takeover bids on it) and in its heartbeats (so every view has it
within a second), and keeps the choice in line with membership: until training starts, nodes
that joined together move apart (placement.rebalance). Training starts once every stage
has a host, the replicas are balanced and the map has been stable for SETTLE_S; then the
stage's worker (worker.py) runs in the trainer thread, torch's own, and this service
carries its messages on `/peertrain/pipe/1.0.0` (links.py) on the trio thread.

Routing: replicas are numbered by sorted peer id (placement.next_replica). Activations
go to the replica of the next visit's stage the seeded route names (a visit per stage in
stage order; CheckFree+'s swap visits the edge stages twice: schedule.hops), targets
straight to the last stage replica the micro-batch will reach, gradients back to whoever sent the
activations, the head gradient from the last stage to every first-stage host, the tied
matrix from first-stage replica r to the last-stage replicas q with q % R0 == r.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import trio

from node.ml.pipeline.schedule import hops
from node.pipe import claims, convergence, placement, stage_ckpt, stall
from node.pipe.convergence import FRESH_S
from node.pipe.fetch import Stalls, WeightsFetcher, why
from node.pipe.links import Inbox, Lost, Outbox, Outgoing, serve_stream
from node.transport.lane import listen_host
from protocols import manifest as mf
from protocols import pipeline as pipe

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from node.service import NodeContext
    from node.training.rounds import TrainingStats

log = logging.getLogger("node.pipeline")

SETTLE_S = 3.0  # the stage map must hold this long before training starts
FIRST_VIEW_S = 3.0  # a joiner waits at most this for a first heartbeat before choosing
JOIN_TIMEOUT_S = 30.0
STALE_CHECKPOINTS = 10  # a host's own stage checkpoint older than this many intervals: rebuild
ENDS_EVERY_S = 10.0  # CheckFree+: how often a neighbour refreshes its copy of an edge's ends
PEER_CHECKPOINTS_S = 20.0  # a recovery waits at most this for other peers' stage checkpoints


class PipelineService:
    name = "pipeline"
    protocols = (pipe.PROTOCOL_ID, pipe.WEIGHTS_PROTOCOL_ID)

    def __init__(self, manifest: mf.Manifest, run_id: str, progress: TrainingStats,
                 data: list[str] | None = None, device: str = "cpu") -> None:
        p = manifest.pipeline
        if p is None:
            raise ValueError("not a pipeline run")
        self.m = manifest
        self.run_id = run_id
        self.progress = progress
        self.data = data
        self.device = device
        self.lane_host: str | None = None  # where our bulk lanes listen, once running
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
        self.outbox: Outbox | None = None
        self.worker: Any = None
        self._ctx: NodeContext | None = None
        self._stop = threading.Event()  # the running worker's
        self._move_to: int | None = None  # a takeover asked by membership
        self.recovery: dict[str, Any] | None = None  # how this stage started, mid-run
        self.weights_served = 0
        self.checkpointed: int | None = None  # the step of this stage's newest own checkpoint
        # CheckFree+: the ends (embedding, final norm) of a neighbouring edge stage, kept so
        # that a replacement can restore them when that stage loses every host; refreshed
        # every ENDS_EVERY_S (_keep_ends). An EdgeCopies once torch is loaded.
        self.ends_copies: Any = None
        # NoLoCo between this stage's replicas (replicas.py), unless outer.algorithm is
        # "none": built in run(), keyed by stage (its run key follows _set_stage).
        self.averager: Any = None
        self._nursery: trio.Nursery | None = None
        # This node's lease on its stage in the run document (claims.py); None without a
        # run document (unit tests of the heartbeat rules)
        self.lease: claims.StageLease | None = None

    # -- the stage map -------------------------------------------------------------------

    def live(self, first_choice: bool = False) -> list[Any]:
        """The membership view's live peers, less those whose last heartbeat was written
        more than FRESH_S ago (its `t`, judged by the swarm's clock: Membership.age):
        gossip re-delivered heartbeats minutes old (a relay's backlog, a seen-cache that
        expired) and they made a killed host look live and a swarm step 200 steps old look
        current.

        `first_choice` (a joiner choosing its stage): less, too, those written more than a
        peer ttl before the freshest one heard. A replacement that starts within seconds of
        its predecessor's death (as fast as a joiner does since trainers yield the CPU,
        node/process/priority.py) got the dead host's last heartbeat from gossip's history, stamped
        live on arrival, took another stage, and a trained host took the dead one's over
        (CI, 2026-11-26). Only for that choice: later the ttl on arrival expires such an
        entry, and a host whose heartbeats arrive late under load stays in the map."""
        ctx = self._ctx
        assert ctx is not None
        now = time.time()
        aged = [(e, ctx.membership.age(e, now)) for e in ctx.membership.live()]
        freshest = min((a for _, a in aged if a is not None), default=0.0)
        margin = ctx.config.peer_ttl_s if first_choice else math.inf
        return [e for e, age in aged
                if age is None or (age <= FRESH_S and age - freshest <= margin)]

    def swarm_step(self) -> int:
        """The highest step a fresh live peer reports that the trained others (ours
        included) confirm (convergence.confirmed_step): a first stage behind it jumps
        to it, a stage that starts late starts there."""
        claims = {e.peer_id: s for e in self.live()
                  if type(s := (e.info.get("stats") or {}).get("step")) is int}
        if self.training and self._ctx is not None:
            claims[self._ctx.peer_id] = self.progress.step
        return convergence.confirmed_step(claims, self.settled())

    def hosts(self, first_choice: bool = False) -> dict[str, int]:
        """Live node -> the stage it hosts (its heartbeats, else its run-document entry)."""
        ctx = self._ctx
        assert ctx is not None
        doc = ctx.run.document if ctx.run else None
        out: dict[str, int] = {}
        for e in self.live(first_choice):
            if e.info.get("role") != "node" or e.peer_id == ctx.peer_id:
                continue
            s = (e.info.get("stats") or {}).get("stage")
            if type(s) is not int and doc is not None:
                s = doc.get(f"peer/{e.peer_id}/stage")
            if type(s) is int and 0 <= s < self.n:
                out[e.peer_id] = s
        if self.stage is not None:
            out[ctx.peer_id] = self.stage
        return out

    def agreed_hosts(self, first_choice: bool = False) -> dict[str, int]:
        """`hosts()` plus the live stage claims of peers the live view misses
        (claims.merged): what a joiner fills and untrained nodes rebalance by."""
        hosts = self.hosts(first_choice)
        if self.lease is None:
            return hosts
        from node.run.rundoc_sync import now_ms

        me = self.lease.me  # our own claim is `self.stage`, or a previous run's
        return claims.merged(hosts, [c for c in self.lease.claims(now_ms()) if c.peer != me])

    def settled(self) -> set[str]:
        """Live hosts whose stage trains already (their heartbeats say `staged`)."""
        ctx = self._ctx
        assert ctx is not None
        out = {e.peer_id for e in self.live()
               if (e.info.get("stats") or {}).get("staged") == 1}
        if self.training:
            out.add(ctx.peer_id)
        return out

    def uptimes(self) -> dict[str, float]:
        """Live nodes' uptimes (heartbeats; ours from the clock): placement moves the
        youngest of a stage's trained hosts."""
        ctx = self._ctx
        assert ctx is not None
        out = {}
        for e in self.live():
            u = (e.info.get("stats") or {}).get("uptime")
            if isinstance(u, int | float) and not isinstance(u, bool):
                out[e.peer_id] = float(u) + (time.monotonic() - e.last_seen)
        out[ctx.peer_id] = time.monotonic() - ctx.phases.started
        return out

    def stage_map(self) -> list[list[str]]:
        return placement.stage_map(self.hosts(), self.n)

    def claim(self, peer: str, h: pipe.MessageHeader) -> str | None:
        """Why `peer` may not send this message here (None: it may): activations come
        from the stage of the micro-batch's previous visit, gradients from its next."""
        s, kind = self.stage, h.kind
        assert s is not None
        if h.stage != s:
            return f"{kind} for stage {h.stage} from {peer}: this node hosts stage {s} now"
        sender = {"tgt": 0, "tied": 0, "tgrad": self.n - 1}.get(kind, -1)
        if kind in ("act", "grad"):
            path = self.paths[h.mb]
            if h.hop >= len(path) or path[h.hop].stage != s:
                return f"{kind} for visit {h.hop} of micro-batch {h.mb}: not at stage {s}"
            other = h.hop - 1 if kind == "act" else h.hop + 1
            if not 0 <= other < len(path):
                return f"{kind} for visit {h.hop} of micro-batch {h.mb} has no sender"
            sender = path[other].stage
        if 0 <= sender < self.n and peer in self.stage_map()[sender]:
            return None
        return f"{kind} for stage {s} from {peer}, which does not host stage {sender}"

    def _set_stage(self, stage: int) -> None:
        ctx = self._ctx
        assert ctx is not None and ctx.run is not None
        if self.stage is not None and stage != self.stage:
            self.moves += 1
            self.recovery = None  # it said how the stage we leave started
            log.info("pipeline: moving from stage %d to stage %d", self.stage, stage)
        else:
            log.info("pipeline: hosting stage %d of %d", stage, self.n)
        self.stage = stage
        ctx.run.stage = stage  # heartbeats and the run document's stats carry it
        if self.averager is not None:
            self.averager.run_id = self._replica_key()
        from node.run.rundoc_sync import now_ms, topic

        doc = ctx.run.document
        key = f"peer/{ctx.peer_id}/stage"
        doc.set(key, stage, now_ms())
        entry = doc.entry(key)
        if entry is not None:
            ctx.publisher.publish_nowait(topic(self.run_id), doc.encode_delta([entry]))
        if self.lease is not None:
            self.lease.hold(stage, now_ms())

    # -- the service ---------------------------------------------------------------------

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._ctx = ctx
        substrate = ctx.substrate
        stalls = Stalls(substrate)  # a peer whose streams all time out: its connection reset
        self.fetcher = WeightsFetcher(substrate, self.run_id, stalls)
        self.outbox = Outbox(substrate, self.run_id, capacity=4 * self.M + 8, stalls=stalls,
                             on_lost=self._on_lost,
                             # a bulk lane only on a direct path (node/transport/transports.py)
                             path_of=ctx.transports.path_of)
        self.lane_host = listen_host(substrate)
        ctx.transports.serve(pipe.PROTOCOL_ID, self._handle)
        ctx.transports.serve(pipe.WEIGHTS_PROTOCOL_ID, self._serve_weights)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.lease = self._lease(ctx)
            nursery.start_soon(self._hold_lease)
            nursery.start_soon(self.outbox.run)
            if self.m.outer.algorithm == "noloco":
                await nursery.start(self._averager(ctx).run)
            with trio.move_on_after(FIRST_VIEW_S):
                while ctx.membership.first_peer_after_s is None:
                    await trio.sleep(0.1)
            # Heartbeats that queued while torch's import held this thread were stamped
            # live when processed, a killed host's among them, with old stats (seen: a
            # replacement took a stage whose host was dead, on a swarm step 2 minutes old).
            # One ttl later those have expired and every live peer has beaten again.
            if time.monotonic() - ctx.phases.started > ctx.config.peer_ttl_s:
                await trio.sleep(ctx.config.peer_ttl_s)
            self._set_stage(placement.choose(self.agreed_hosts(first_choice=True), self.n))
            nursery.start_soon(self._follow_membership, ctx)
            if self._keeps_ends():
                nursery.start_soon(self._keep_ends)
            task_status.started()
            await self._wait_to_start(ctx)
            try:
                await self._train()
            except Exception as e:
                from node.errors import TrainingFailed

                log.error("pipeline stopped: %s: %s", type(e).__name__, e)
                raise TrainingFailed(f"pipeline stopped: {type(e).__name__}: {e}") from e
            nursery.cancel_scope.cancel()

    # -- replicas: NoLoCo between the hosts of one stage ----------------------------------

    def _averager(self, ctx: NodeContext) -> Any:
        from node.averaging import adapt
        from node.averaging.service import Averager

        o = self.m.outer
        self.averager = Averager(
            ctx.substrate, self._replica_key(), ctx.peer_id, self._replica_partners,
            codecs=adapt.supported(o.codec), auto_codec=o.codec == adapt.AUTO, group_size=2,
            step_time=self.progress.step_time, inner_steps=o.inner_steps, stats=self.progress,
            transports=ctx.transports, relay_limit=int(self.m.network.relay_exchange_mb * 1e6))
        return self.averager

    def _replica_key(self) -> str:
        """The run key of this stage's exchanges: a replica of another stage refuses."""
        return f"{self.run_id}/stage{self.stage}"

    def _replica_partners(self) -> list[str]:
        """The other live hosts of this node's stage (called from both threads)."""
        ctx, s = self._ctx, self.stage
        if ctx is None or s is None:
            return []
        return [p for p in self.stage_map()[s] if p != ctx.peer_id]

    def _replica_rounds(self, worker: Any, token: trio.lowlevel.TrioToken) -> Any:
        from node.ml.optim import NoLoCoConfig
        from node.pipe.replicas import ReplicaRounds

        o = self.m.outer
        rounds: Any = None

        def post(r: int, theta: Any) -> None:  # trainer thread
            with contextlib.suppress(trio.RunFinishedError, trio.Cancelled):
                trio.from_thread.run_sync(self._start_exchange, rounds, r, theta,
                                          trio_token=token)

        rounds = ReplicaRounds(worker.runner.stage, o.inner_steps,
                               NoLoCoConfig(outer_lr=o.outer_lr, momentum=o.momentum), post,
                               has_partners=lambda: bool(self._replica_partners()),
                               progress=self.progress)
        return rounds

    def _start_exchange(self, rounds: Any, r: int, theta: Any) -> None:
        async def exchange() -> None:
            rounds.deliver(await self.averager.exchange(r, theta))  # never raises

        if self._nursery is not None:
            self._nursery.start_soon(exchange)

    async def _follow_membership(self, ctx: NodeContext) -> None:
        while True:
            await trio.sleep(ctx.config.heartbeat_s)
            self._follow_once()

    def _lease(self, ctx: NodeContext) -> claims.StageLease | None:
        if ctx.run is None or getattr(ctx.run, "document", None) is None:
            return None
        from node.run.rundoc_sync import topic

        def publish(delta: bytes) -> None:
            ctx.publisher.publish_nowait(topic(self.run_id), delta)

        return claims.StageLease(ctx.run.document, ctx.peer_id, self.n, publish)

    async def _hold_lease(self) -> None:
        """Renew our stage claim while we host it; a stop (this task cancelled with the
        service) tombstones it, so the stage is free at once, not a lease later."""
        from node.run.rundoc_sync import now_ms

        if self.lease is None:
            return
        try:
            while True:
                await trio.sleep(claims.RENEW_S / 3)
                self.lease.renew(now_ms())
        finally:
            with contextlib.suppress(Exception):
                self.lease.release(now_ms())

    def _follow_once(self) -> None:
        """Keep the stage choice in line with the live view (placement.rebalance); a
        takeover only of a stage nobody heard lately hosts (convergence.recent_hosts)."""
        ctx = self._ctx
        assert ctx is not None
        # untrained nodes move apart by the agreed map; a trained one by its live view,
        # and then only through a bid on the stage's lease (_bid)
        hosts = self.hosts() if self.training else self.agreed_hosts()
        move = placement.rebalance(ctx.peer_id, hosts, self.n, training=self.training,
                                   settled=self.settled(), uptime=self.uptimes())
        if self.lease is not None and self.lease.bid is not None and move != self.lease.bid:
            from node.run.rundoc_sync import now_ms

            self.lease.withdraw_bid(now_ms())  # the stage we bid for is not empty any more
        if move is None:
            return
        if not self.training:
            self._set_stage(move)
        elif self._move_to is None and self.worker is not None:
            heard = ctx.membership.book.live(time.monotonic() - (FRESH_S - ctx.config.peer_ttl_s))
            recent = convergence.recent_hosts(heard, move)
            if recent:
                self.counters["refused: takeover"] += 1
                log.info("pipeline: stage %d has no live host in this view, but %s was "
                         "heard within %.0f s: not taking it over", move, recent, FRESH_S)
                if self.lease is not None and self.lease.bid is not None:
                    from node.run.rundoc_sync import now_ms

                    self.lease.withdraw_bid(now_ms())
            elif self.lease is not None and not self._bid(move):
                return
            else:
                log.warning("pipeline: stage %d has no host heard within %.0f s; this node "
                            "(stage %s, which keeps %d more) takes it over", move, FRESH_S,
                            self.stage, len(self.stage_map()[self.stage or 0]) - 1)
                self._move_to = move
                self._stop.set()

    def _bid(self, move: int) -> bool:
        """A takeover of `move` through its lease (claims.verdict): True once our bid
        has held BID_S with no claim ranked before it; refused while another's lease on
        the stage is live; a lost bid is withdrawn."""
        from node.run.rundoc_sync import now_ms

        ctx, lease = self._ctx, self.lease
        assert ctx is not None and lease is not None
        t = now_ms()
        verdict, peer = claims.verdict(ctx.peer_id, move, lease.claims(t), t)
        if verdict == "refused":
            self.counters["refused: takeover (lease)"] += 1
            log.info("pipeline: stage %d has no live host in this view, but %s's claim on it "
                     "is live: not taking it over", move, peer)
        elif verdict == "bid":
            lease.place_bid(move, t)
            log.info("pipeline: bidding for stage %d, which no live claim holds", move)
        elif verdict == "lost":
            lease.withdraw_bid(t)
            self.counters["refused: takeover (bid lost)"] += 1
            log.info("pipeline: %s's claim on stage %d ranks before our bid: withdrawn",
                     peer, move)
        return verdict == "won"

    async def _wait_to_start(self, ctx: NodeContext) -> None:
        self.phase = "waiting for stages"
        self.progress.phase = "waiting for stages"
        stable_since, last = time.monotonic(), None
        while True:
            smap = self.stage_map()
            if smap != last:
                stable_since, last = time.monotonic(), smap
            if (placement.complete(smap) and placement.balanced(smap)
                    and time.monotonic() - stable_since >= SETTLE_S):
                break
            await trio.sleep(0.2)
        self.training = True
        assert ctx.run is not None
        ctx.run.stage_training = True
        self.phase = "training"
        log.info("pipeline: training stage %d; map %s", self.stage,
                 {s: [p[-6:] for p in row] for s, row in enumerate(smap)})

    async def _train(self) -> None:
        """Run the stage's worker; when membership moves this node to a stage left with no
        host (a takeover), stop it, rebuild the new stage (`_recover`) and run that."""
        while True:
            await self._run_worker()
            move = self._move_to
            if move is None:
                return
            self._move_to = None
            self._set_stage(move)
            while self.inbox.get(0) is not None:  # what came for the old stage
                pass

    async def _run_worker(self) -> None:
        token = trio.lowlevel.current_trio_token()
        failure: list[BaseException] = []
        done = trio.Event()
        self._stop = threading.Event()

        def post(to: tuple, kind: str, stage: int, step: int, mb: int, hop: int,
                 tensor: Any, origin: str) -> None:
            with contextlib.suppress(trio.RunFinishedError, trio.Cancelled):
                trio.from_thread.run_sync(self._dispatch, to, Outgoing(
                    kind, stage, step, mb, tensor, hop, origin),  # type: ignore[arg-type]
                    trio_token=token)

        self.worker = None
        worker = await trio.to_thread.run_sync(self._build_worker, post)
        self.phase, self.phase_at = f"recovering stage {self.stage}", time.monotonic()
        await self._recover(worker)
        self.phase = "training"
        worker.on_step = self._checkpoint_hook(worker)
        if self.averager is not None:  # φ starts from the weights the stage starts with
            worker.replicas = await trio.to_thread.run_sync(self._replica_rounds, worker, token)
        self.worker = worker

        def main() -> None:
            import torch

            from node.process.priority import lower_session_priority, lower_thread_priority

            lower_thread_priority()
            lower_session_priority()
            try:
                torch.set_num_threads(self.m.train.threads)
                worker.run()
            except BaseException as e:
                self.progress.phase = "failed"
                self.progress.error = f"{type(e).__name__}: {e}"
                failure.append(e)
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(done.set, trio_token=token)

        thread = threading.Thread(target=main, daemon=True, name="peertrain-stage")
        thread.start()
        try:
            await done.wait()
        finally:
            worker.stop.set()
            with trio.move_on_after(JOIN_TIMEOUT_S) as waited:
                waited.shield = True
                await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
        if failure:
            raise failure[0]

    def _build_worker(self, post: Any) -> Any:
        """In the trainer thread: the stage from the run's seed, its runner, its data."""
        import torch

        from node.ml.pipeline.runner import StageOptim, StageRunner
        from node.ml.pipeline.stages import build_stages
        from node.ml.trainer.models import GPTConfig
        from node.pipe.worker import StageWorker

        m, s = self.m, self.stage
        assert s is not None and self._ctx is not None
        torch.set_num_threads(m.train.threads)
        config = GPTConfig(d_model=m.model.d_model, n_layers=m.model.n_layers,
                           n_heads=m.model.n_heads, context=m.model.context)
        stages = build_stages(config, self.layers, m.run.seed)
        stage = stages[s]
        if stage.is_last and not stage.is_first:
            stage.set_tied(stages[0].wte.weight)
        stage.to(self.device)
        # as many as the inbox holds: a host left alone on its stage serves every origin
        runner = StageRunner(stage, StageOptim(lr=m.train.lr, grad_clip=m.train.grad_clip),
                             max_in_flight=self.inbox.capacity)
        self.progress.params = sum(p.numel() for p in stage.parameters())
        batches = None
        if s == 0:
            batches = self._batches()
        return StageWorker(runner, self.n, self.M, self.inbox, post, self._stop,
                           progress=self.progress, batches=batches,
                           ready=lambda: placement.complete(self.stage_map()),
                           device=self.device, first_step=self.swarm_step(),
                           leader_step=self.swarm_step, layers=self.layers, swap=self.swap,
                           last_hosts=self._last_hosts, origin=self._ctx.peer_id,
                           arrivals=self._arrivals)

    def _last_hosts(self, step: int) -> int:
        """How many last-stage hosts get micro-batches of `step` from some first-stage
        replica (trainer thread): the hosts a driver hears a head gradient from."""
        counts = [len(row) for row in self.stage_map()]
        p = self.m.pipeline
        assert p is not None
        if 0 in counts:  # a stage without a host: no step completes anyway
            return 1
        return len({placement.last_replica(self.m.run.seed, step, k, r,
                                           [counts[v.stage] for v in path], p.routing)
                    for k, path in enumerate(self.paths) for r in range(counts[0])})

    def _arrivals(self, step: int) -> int:
        """How many visits of `step` reach this host (trainer thread; placement.arrivals)."""
        smap, ctx, p = self.stage_map(), self._ctx, self.m.pipeline
        assert ctx is not None and p is not None and self.stage is not None
        row = smap[self.stage]
        return placement.arrivals(self.m.run.seed, step, [[v.stage for v in path] for path
                                                          in self.paths], [len(r) for r in smap],
                                  p.routing, self.stage,
                                  row.index(ctx.peer_id) if ctx.peer_id in row else 0)

    def _batches(self) -> Any:
        import torch

        from node.ml.trainer.tasks import TaskConfig, build_task
        from node.training.build import replica_index

        m = self.m
        ctx = self._ctx
        assert ctx is not None
        files = tuple(self.data) if self.data else (
            tuple(m.data.paths) if m.data.source == "files" else ())
        task = build_task(TaskConfig(
            name=m.model.task, d_model=m.model.d_model, n_layers=m.model.n_layers,
            n_heads=m.model.n_heads, context=m.model.context, data_files=files,
            data_format=m.data.format, jsonl_field=m.data.jsonl_field,
            val_fraction=m.data.val_fraction))
        gen = torch.Generator().manual_seed(m.run.seed * 1_000_003 + replica_index(ctx.peer_id))
        return lambda: task.train_batch(m.train.batch_size, gen)

    # -- recovery: a stage that starts while the run trains --------------------------------

    async def _recover(self, worker: Any) -> None:
        """Mid-run, a stage is not drawn from the seed: it takes the most trained weights
        it can reach, by the rule of node/ml/recovery/sources.py (docs/pipeline.md, "What a
        stage's weights claim"): a live replica or this node's own checkpoint of the stage
        whose weights are current, else a rebuild from its neighbours (CheckFree: every
        host of each source stage is asked), else the stale ones, most trained first; only
        then the seed's weights, with the reasons logged. Each source's claim of trained
        steps, never the clock, ranks it and goes with its weights (`worker.trained`)."""
        from node.ml.recovery import sources

        ctx, s, p = self._ctx, self.stage, self.m.pipeline
        assert ctx is not None and s is not None and p is not None
        swarm = self.swarm_step()
        if swarm == 0:
            worker.started_from(0)
            return  # a fresh run: every stage starts from the run's seed
        t0 = time.monotonic()
        smap = self.stage_map()
        own = stage_ckpt.path_for(ctx.config.state_dir, self.run_id, s)
        claim: int | None = None
        if own.exists():
            try:
                claim = (await trio.to_thread.run_sync(
                    stage_ckpt.claim, own, self.run_id, s, list(self.layers))).trained
            except stage_ckpt.StageCheckpointError as e:
                log.warning("pipeline: this node's checkpoint of stage %d is not used: %s",
                            s, e)
        fresh = swarm - STALE_CHECKPOINTS * self.m.checkpoint.every_steps
        failed: list[str] = []
        for src in sources.rank(self.trained_of(smap[s]), claim, swarm, fresh,
                                checkfree=p.recovery != "none"):
            if src.kind == "replica":
                assert src.peer is not None
                if await self._copy(worker, src.peer, swarm, t0):
                    return
            elif src.kind == "checkpoint":
                if await self._resume(worker, own, swarm, t0):
                    return
            elif src.kind == "peers":
                if await self._from_peers(worker, smap, swarm, fresh, t0):
                    return
            elif src.kind == "checkfree":
                try:
                    await self._rebuild(worker, smap, swarm, fresh, t0)
                    return
                except Exception as e:  # RecoveryError, BadGradNorm, no neighbour answered
                    log.warning("pipeline: stage %d cannot be rebuilt (%s)", s, why(e))
                    failed.append(why(e))
        log.warning("pipeline: stage %d starts from the seed's weights", s)
        worker.started_from(0)
        self._recovered("none", [], t0, swarm, "; ".join(failed) or (
            'recovery = "none": the seed\'s weights' if p.recovery == "none"
            else "no replica, checkpoint or neighbour had its weights"))

    def trained_of(self, hosts: list[str]) -> dict[str, int | None]:
        """`hosts` (less this node) -> the trained steps their heartbeats claim."""
        ctx = self._ctx
        assert ctx is not None
        said = {e.peer_id: (e.info.get("stats") or {}).get("trained") for e in self.live()}
        return {q: t if type(t := said.get(q)) is int else None
                for q in hosts if q != ctx.peer_id}

    async def _copy(self, worker: Any, peer: str, swarm: int, t0: float) -> bool:
        """A live replica's weights and its claim (its answer's, else its heartbeats')."""
        shapes = {k: tuple(v.shape) for k, v in worker.runner.stage.state_dict().items()}
        got, _ = await self.fetcher.first([peer], self.stage or 0, "all", shapes)
        if got is None:
            return False
        said = self.trained_of([peer]).get(peer)
        trained = got[1].trained if got[1].trained is not None else said or 0
        await trio.to_thread.run_sync(worker.load_copy, got[1].tensors)
        worker.started_from(min(trained, swarm))
        self._recovered("copy", [peer], t0, swarm, f"{worker.trained} trained steps")
        return True

    async def _resume(self, worker: Any, own: Any, swarm: int, t0: float) -> bool:
        """This node's own checkpoint of the stage, whatever its claim (ranked already)."""
        try:
            got = await trio.to_thread.run_sync(stage_ckpt.load, own, worker.runner,
                                                self.run_id, list(self.layers), 0)
        except stage_ckpt.StageCheckpointError as e:
            log.warning("pipeline: this node's checkpoint of stage %s is not used: %s",
                        self.stage, e)
            return False
        worker.started_from(min(got.trained, swarm))
        self._recovered("checkpoint", [], t0, swarm, f"this node's checkpoint of step "
                        f"{got.step}, trained {got.trained} steps, "
                        f"{max(swarm - got.trained, 0)} behind the swarm")
        return True

    async def _from_peers(self, worker: Any, smap: list[list[str]], swarm: int, fresh: int,
                          t0: float) -> bool:
        """Another peer's own checkpoint of our stage (one that hosted it before), if its
        weights are current: every live peer that does not host it is asked at once, the
        first current answer taken (a refusal from each peer that holds none)."""
        from node.ml.recovery.sources import is_current

        ctx, s = self._ctx, self.stage
        assert ctx is not None and s is not None
        peers = [e.peer_id for e in self.live() if e.info.get("role") == "node"
                 and e.peer_id != ctx.peer_id and e.peer_id not in smap[s]]
        shapes = {k: tuple(v.shape) for k, v in worker.runner.stage.state_dict().items()}
        found: list[tuple[str, Any]] = []

        async def ask(peer: str, cancel: trio.CancelScope) -> None:
            try:
                got = await self.fetcher.fetch_once(peer, s, "all", shapes)
            except Exception as e:
                log.debug("pipeline: no checkpoint of stage %d from %s: %s", s, peer, why(e))
                return
            if is_current(got.trained, fresh) and not found:
                found.append((peer, got))
                cancel.cancel()

        with trio.move_on_after(PEER_CHECKPOINTS_S):  # a peer that hangs delays CheckFree
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    nursery.start_soon(ask, peer, nursery.cancel_scope)
        if not found:
            return False
        peer, got = found[0]
        await trio.to_thread.run_sync(worker.load_copy, got.tensors)
        worker.started_from(min(got.trained or 0, swarm))
        self._recovered("checkpoint", [peer], t0, swarm, f"{peer[-6:]}'s checkpoint of the "
                        f"stage, trained {worker.trained} steps")
        return True

    async def _rebuild(self, worker: Any, smap: list[list[str]], swarm: int, fresh: int,
                       t0: float) -> None:
        """CheckFree (or CheckFree+) from the nearest surviving stages, past any adjacent
        stage that is lost too (sources.lost_stages); raises when it cannot. The rebuilt
        stage claims the least trained of its sources (its weights are theirs)."""
        from node.ml.recovery.checkfree import RecoveryError, plan
        from node.ml.recovery.sources import lost_stages

        ctx, s, p = self._ctx, self.stage, self.m.pipeline
        assert ctx is not None and s is not None and p is not None
        mode = p.recovery
        assert mode != "none", "a stage is rebuilt only under CheckFree (or CheckFree+)"
        said = self.trained_of([q for row in smap for q in row])
        empty = {j for j, row in enumerate(smap) if j != s and not set(row) - {ctx.peer_id}}
        lost = lost_stages(smap, said, fresh, ctx.peer_id) - {s}
        try:
            how = plan(s, list(self.layers), mode, lost)
        except RecoveryError:
            # past the untrained stages there is no source (an edge): hosted stages, however
            # few steps their weights claim (a stalled one steps its clock, not its weights),
            # beat the seed
            how = plan(s, list(self.layers), mode, empty)
        if set(how.sources) & lost:
            log.info("pipeline: stage %d is rebuilt from stages %s, which claim few trained "
                     "steps: nothing nearer survives", s, how.sources)
        elif lost:
            log.info("pipeline: stages %s are lost too; stage %d is rebuilt from the nearest "
                     "surviving stages %s", sorted(lost), s, how.sources)
        ends = await self._ends_copy(worker, s, smap) if how.ends else None
        shapes = {k: tuple(v.shape) for k, v in worker.runner.stage.blocks.state_dict().items()}
        blocks: dict[int, Any] = {}
        norms: dict[int, float] = {}
        claims: list[int] = []
        found: list[str] = []
        for j in how.sources:  # its most trained hosts first
            hosts = sorted(smap[j], key=lambda q: -(said.get(q) or 0))
            got, failed = await self.fetcher.first(hosts, j, "blocks", shapes)
            if got is None:
                raise RecoveryError(f"no host of stage {j}, a source of stage {s}, gave "
                                    f"its blocks (asked {len(smap[j])}"
                                    f"{': ' if failed else ''}{'; '.join(failed)})")
            peer, answer = got
            blocks[j] = answer.tensors
            gossiped = self._gossiped_norm(peer)
            norms[j] = gossiped if gossiped is not None else answer.gnorm
            claims.append(answer.trained if answer.trained is not None else 0)
            found.append(peer)
        await trio.to_thread.run_sync(worker.rebuild, how, blocks, norms,
                                      self.m.train.grad_clip, p.lr_boost)
        if ends is not None:
            holder, tensors = ends
            await trio.to_thread.run_sync(worker.load_ends, tensors)
            found += [holder] if holder not in found else []
        worker.started_from(min([*claims, swarm]))
        rule = how.rule if ends is None else "ends" if how.rule == "none" else f"{how.rule}+ends"
        self._recovered(rule, found, t0, swarm, norms={str(k): v for k, v in norms.items()})

    def _checkpoint_hook(self, worker: Any) -> Any:
        """The worker's on_step: the stage's own checkpoint every checkpoint.every_steps
        steps (trainer thread). A failed write (a full disk) is logged; training goes on."""
        ctx, s = self._ctx, self.stage
        assert ctx is not None and s is not None
        every = self.m.checkpoint.every_steps
        path = stage_ckpt.path_for(ctx.config.state_dir, self.run_id, s)

        def on_step(step: int) -> None:
            if step <= 0 or step % every:
                return
            try:
                stage_ckpt.save(path, worker.runner, self.run_id, list(self.layers), step,
                                worker.trained)
            except OSError as e:
                log.warning("pipeline: stage %d's checkpoint at step %d not written: %s",
                            s, step, e)
                return
            self.checkpointed = step

        return on_step

    def _edge_neighbour(self, edge: int) -> int:
        return 1 if edge == 0 else self.n - 2

    async def _ends_copy(self, worker: Any, s: int, smap: list[list[str]]
                         ) -> tuple[str, dict[str, Any]]:
        """CheckFree+: (holder, tensors) of the copy of lost edge stage `s`'s ends (its
        embedding / final norm) that its neighbour keeps; ours if this node was that
        neighbour (a takeover). RecoveryError when no neighbour has one."""
        from node.ml.recovery.checkfree import RecoveryError

        ctx = self._ctx
        assert ctx is not None
        if self.ends_copies is not None and s in self.ends_copies.refreshed_at:
            return ctx.peer_id, self.ends_copies.get(s)
        shapes = {k: tuple(v.shape) for k, v in worker.runner.stage.ends_state().items()}
        holders = smap[self._edge_neighbour(s)]
        got, failed = await self.fetcher.first(holders, s, "ends", shapes)
        if got is None:
            raise RecoveryError(f"no neighbour holds a copy of stage {s}'s ends "
                                f"(asked {len(holders)}: {'; '.join(failed)})")
        return got[0], got[1].tensors

    def _keeps_ends(self) -> bool:
        """Whether the edges' neighbours keep a copy of their ends: under CheckFree+, and
        under CheckFree too where a lost edge takes CheckFree+'s rule (checkfree.plan)."""
        from node.ml.recovery.checkfree import edges_have_rule

        p = self.m.pipeline
        return p is not None and edges_have_rule(self.layers, p.recovery)

    async def _keep_ends(self) -> None:
        """CheckFree+: a host of the stage next to an edge stage keeps a copy of that
        edge's ends, refreshed every ENDS_EVERY_S from one of its live hosts."""
        from node.ml.recovery import EdgeCopies

        self.ends_copies = EdgeCopies()
        shapes: dict[int, dict[str, tuple[int, ...]]] = {}  # per edge, built once
        while True:
            await trio.sleep(ENDS_EVERY_S)
            if not self.training or self.worker is None or self.stage is None:
                continue
            for edge in (0, self.n - 1):
                if edge == self.stage or self._edge_neighbour(edge) != self.stage:
                    continue
                hosts = self.stage_map()[edge]
                if not hosts:
                    continue  # lost: keep the copy we have, a replacement will ask for it
                try:
                    if edge not in shapes:
                        shapes[edge] = await trio.to_thread.run_sync(self._ends_shapes, edge)
                    got = await self.fetcher.fetch(hosts[0], edge, "ends", shapes[edge])
                except Exception as e:
                    log.info("pipeline: refreshing the copy of stage %d's ends: %s", edge, e)
                    continue
                self.ends_copies.refresh(edge, got.tensors, got.step)

    def _ends_shapes(self, edge: int) -> dict[str, tuple[int, ...]]:
        from node.ml.pipeline.stages import Stage
        from node.ml.trainer.models import GPTConfig

        m = self.m.model
        config = GPTConfig(d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                           context=m.context)
        template = Stage(config, edge, self.n, 0)
        return {k: tuple(v.shape) for k, v in template.ends_state().items()}

    def _recovered(self, rule: str, sources: list[str], t0: float, step: int,
                   reason: str | None = None, norms: dict[str, float] | None = None) -> None:
        self.recovery = {"rule": rule, "sources": sources, "at_step": step,
                         "seconds": round(time.monotonic() - t0, 3), "reason": reason,
                         "norms": norms}
        log.info("pipeline: stage %s started mid-run at step %d by %s from %s (%.2f s)%s",
                 self.stage, step, rule, sources, time.monotonic() - t0,
                 f": {reason}" if reason else "")

    def _held_checkpoint(self, stage: int) -> tuple[int, float, dict[str, Any], int] | None:
        """This node's own checkpoint of `stage`, which it does not host now (it moved, or
        restarted on another stage), as a weights answer: a replacement of that stage,
        lost on every host, takes it if current (docs/pipeline.md, "Adjacent losses")."""
        ctx = self._ctx
        if ctx is None or not 0 <= stage < self.n:
            return None
        path = stage_ckpt.path_for(ctx.config.state_dir, self.run_id, stage)
        if not path.exists():
            return None
        try:
            got, model = stage_ckpt.weights(path, self.run_id, stage, list(self.layers))
        except stage_ckpt.StageCheckpointError as e:
            log.info("pipeline: not serving this node's checkpoint of stage %d: %s", stage, e)
            return None
        return got.step, 0.0, model, got.trained

    def _gossiped_norm(self, peer: str) -> float | None:
        ctx = self._ctx
        assert ctx is not None
        for e in self.live():
            if e.peer_id == peer:
                v = (e.info.get("stats") or {}).get("gnorm")
                return v if isinstance(v, int | float) and not isinstance(v, bool) else None
        return None

    async def _serve_weights(self, stream: INetStream) -> None:
        from node.transport.streams import next_event, write_chunks

        try:
            with trio.fail_after(10):
                decoder = pipe.WEIGHTS_REQUEST_LIMITS.decoder()
                stage, part = pipe.check_weights_request(await next_event(stream, decoder),
                                                         self.run_id)
            worker = self.worker
            copies = self.ends_copies
            if part == "ends" and stage != self.stage and copies is not None \
                    and stage in copies.refreshed_at:
                step, gnorm, state = copies.refreshed_at[stage], 0.0, copies.get(stage)
                trained = None
            elif part == "all" and stage != self.stage and (
                    held := await trio.to_thread.run_sync(self._held_checkpoint, stage)):
                step, gnorm, state, trained = held
            elif worker is None or stage != self.stage:
                await stream.write(pipe.encode_no_weights(
                    f"this node hosts stage {self.stage}, not {stage}" if worker
                    else "not training yet"))
                return
            else:
                step, gnorm, state, trained = await trio.to_thread.run_sync(worker.snapshot,
                                                                            part)
            with trio.fail_after(pipe.WEIGHTS_DEADLINE_S):
                await write_chunks(stream, pipe.encode_weights(self.run_id, stage, step,
                                                               gnorm, state, trained))
            self.weights_served += 1
        finally:
            with contextlib.suppress(Exception), trio.move_on_after(2):
                await stream.close()

    # -- messages ------------------------------------------------------------------------

    def _dispatch(self, to: tuple, msg: Outgoing) -> None:
        """Trio thread: pick the peer(s) for one of the worker's messages and queue it."""
        ctx, outbox = self._ctx, self.outbox
        assert ctx is not None and outbox is not None and self.stage is not None
        smap = self.stage_map()
        counts = [len(row) for row in smap]
        me = ctx.peer_id
        r = smap[self.stage].index(me) if me in smap[self.stage] else 0
        p = self.m.pipeline
        assert p is not None
        peers: list[str] = []
        try:
            if to[0] == "peer":
                peers = [to[1]]
            elif to[0] == "next":  # ("next", step, mb, our visit)
                path, h = self.paths[to[2]], to[3]
                q = placement.next_replica(self.m.run.seed, to[1], to[2], h, r,
                                           counts[path[h].stage], counts[path[h + 1].stage],
                                           p.routing)
                peers = [smap[path[h + 1].stage][q]]
            elif to[0] == "last":
                path = self.paths[to[2]]
                q = placement.last_replica(self.m.run.seed, to[1], to[2], r,
                                           [counts[v.stage] for v in path], p.routing)
                peers = [smap[path[-1].stage][q]]
            elif to[0] == "stage":
                row = smap[to[1]]
                if msg.kind == "tied":  # first-stage replica r feeds last replicas r mod R0
                    peers = [q for i, q in enumerate(row) if i % max(1, counts[0]) == r]
                else:
                    peers = list(row)
        except (IndexError, ZeroDivisionError):
            peers = []
        if not peers:
            self._on_lost(msg, f"no live host for {msg.kind} to stage {msg.stage}")
            return
        for peer in peers:
            outbox.send(peer, msg)

    def _on_lost(self, msg: Outgoing, reason: str) -> None:
        self.counters[f"lost {msg.kind}"] += 1
        if msg.kind in ("act", "tgt"):  # our micro-batch will not come back
            self.inbox.offer(Lost(msg.kind, msg.step, msg.mb, reason, msg.origin))

    def _lane_host(self) -> str | None:
        """Where we listen for a sender's bulk lane; None (no lanes) where a sender could
        not connect to it (behind a NAT: Transports.lane_dialable)."""
        if self._ctx is not None and not self._ctx.transports.lane_dialable():
            return None
        return self.lane_host

    async def _handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            # Messages may come before our worker runs (a neighbour saw the map complete a
            # moment before we did): the bounded inbox holds them until it does.
            if self.stage is None:
                self.counters["refused: no stage yet"] += 1
                return
            await serve_stream(stream, peer, self._expect(), self.claim, self.inbox,
                               self.counters, lane_host=self._lane_host())
        finally:
            try:
                with trio.move_on_after(2):
                    await stream.close()
            except Exception:
                pass

    def _expect(self) -> pipe.Expect:
        s = self.stage
        assert s is not None
        kinds = set()  # acts for a visit past the first, grads for one before the last
        for path in self.paths:
            kinds |= {"act" for h in path[1:] if h.stage == s}
            kinds |= {"grad" for h in path[:-1] if h.stage == s}
        if s == 0:
            kinds.add("tgrad")
        if s == self.n - 1:
            kinds |= {"tgt", "tied"}
        m = self.m
        return pipe.Expect(self.run_id, s, m.model.d_model, m.train.batch_size // self.M,
                           m.model.context, self.M, frozenset(kinds))

    # -- status --------------------------------------------------------------------------

    def _claims_statistics(self) -> dict[str, Any] | None:
        """The stage map the run document's live claims agree on, and our claim and bid."""
        if self.lease is None:
            return None
        from node.run.rundoc_sync import now_ms

        return self.lease.statistics(now_ms())

    def statistics(self) -> dict[str, Any]:
        if self._ctx is None:
            return {"phase": "starting"}
        smap = self.stage_map()
        out = self.outbox.counters if self.outbox else Counter()
        sent = {k: out.get(f"sent {k}", 0) for k in ("act", "grad", "tgt", "tied", "tgrad")}
        per_mb = {k: round(out.get(f"sent bytes {k}", 0) / sent[k]) for k in ("act", "grad")
                  if sent[k]}
        w = self.worker
        watch = w.watch if w is not None else None
        phase, stalled = stall.current(self.phase, self.phase_at, self.progress.phase, watch,
                                       w.wait_s() if w is not None else 0.0, smap,
                                       queued=self.inbox.qsize())
        return {
            "phase": phase,
            "stall": stalled.to_json() if stalled is not None else None,
            "stage": self.stage,
            "stages": self.n,
            "layers": list(self.layers),
            "micro_batches_per_step": self.M,
            "moves": self.moves,
            "map": {str(s): row for s, row in enumerate(smap)},
            "training": {**self.progress.snapshot(), "phase": phase,
                         "loss_age_s": stall.loss_age(watch)},
            "worker": self.worker.stats.snapshot() if self.worker else None,
            "sent": sent,
            "bytes_per_micro_batch": per_mb,
            "received": {k: v for k, v in self.counters.items() if k.startswith("received")},
            "lanes": {k: v for k, v in self.counters.items() if k.startswith("lanes")},
            "refused": {**{k: v for k, v in self.counters.items()
                           if k.startswith(("refused", "lost"))},
                        **{f"inbox {k}": v for k, v in self.inbox.refused.items()}},
            "queued": self.inbox.qsize(),
            "recovery": self.recovery,
            "claims": self._claims_statistics(),
            "replicas": (self.worker.replicas.statistics()
                         if self.worker is not None and self.worker.replicas is not None
                         else None),
            "weights_served": self.weights_served,
            "checkpoint_step": self.checkpointed,
            "ends_copies": ({str(k): step for k, step in self.ends_copies.refreshed_at.items()}
                            if self.ends_copies is not None else {}),
            "outbox": self.outbox.statistics() if self.outbox else {},
        }
