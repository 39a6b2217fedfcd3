"""The pipeline service: this node hosts one stage of a pipeline run (docs/pipeline.md).

The composition of the pipeline's pieces, each a module of node/pipe/:

- state.py (PipeState): the run's shape and this node's stage, shared by the pieces;
- stage_map.py (StageMap): who hosts which stage, from the live view and the claims;
- choice.py (StageChoice): which stage this node takes, when it moves, its lease;
- replica_averaging.py (ReplicaAveraging): NoLoCo between the hosts of one stage;
- routing.py (Routing): where the worker's messages go, which ones this node takes;
- weights.py (WeightsServer): `/peertrain/pipe-weights/1.0.0` and CheckFree+'s ends copies;
- recovery.py (Recovery): the weights a stage that starts mid-run takes;
- stage_thread.py (StageThread): the stage's worker in the trainer thread.

`run` builds them in that order (each takes the ones before it), registers the two
protocols, chooses a stage, waits until every stage has a host and trains.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import trio

from node.pipe import stall
from node.pipe.choice import StageChoice
from node.pipe.fetch import Stalls, WeightsFetcher
from node.pipe.links import Outbox
from node.pipe.recovery import Recovery
from node.pipe.replica_averaging import ReplicaAveraging
from node.pipe.routing import Routing
from node.pipe.stage_map import StageMap, lease_for
from node.pipe.stage_thread import StageThread
from node.pipe.state import PipeState
from node.pipe.weights import WeightsServer
from node.transport.lane import listen_host
from protocols import manifest as mf
from protocols import pipeline as pipe

if TYPE_CHECKING:
    from node.service import NodeContext
    from node.training.rounds import TrainingStats

log = logging.getLogger("node.pipeline")


class PipelineService:
    name = "pipeline"
    protocols = (pipe.PROTOCOL_ID, pipe.WEIGHTS_PROTOCOL_ID)

    def __init__(self, manifest: mf.Manifest, run_id: str, progress: TrainingStats,
                 data: list[str] | None = None, device: str = "cpu") -> None:
        self.state = PipeState(manifest, run_id, progress)
        self.data = data
        self.device = device
        self.outbox: Outbox | None = None
        self.averaging: ReplicaAveraging | None = None
        self.map: StageMap | None = None  # the pieces, once `compose` has a context
        self.choice: StageChoice
        self.routing: Routing
        self.weights: WeightsServer
        self.recovery: Recovery
        self.thread: StageThread

    def compose(self, ctx: NodeContext, fetcher: WeightsFetcher, outbox: Outbox | None = None,
                lane_host: str | None = None, *, averaged: bool = False) -> None:
        """The pieces over `ctx`, each given the ones it calls (module docstring);
        `averaged`: the stage's replicas average by NoLoCo (an Averager on the substrate)."""
        st = self.state
        self.outbox = outbox
        self.map = StageMap(ctx, st, lease_for(ctx, st))
        self.averaging = ReplicaAveraging(ctx, st, self.map) if averaged else None
        self.choice = StageChoice(ctx, st, self.map, self.averaging)
        self.routing = Routing(ctx, st, self.map, outbox, lane_host)
        self.weights = WeightsServer(ctx, st, self.map, fetcher)
        self.recovery = Recovery(ctx, st, self.map, fetcher, self.weights)
        self.thread = StageThread(ctx, st, self.map, self.choice, self.recovery, self.routing,
                                  self.averaging, self.data, self.device)

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        st, substrate = self.state, ctx.substrate
        stalls = Stalls(substrate)  # a peer whose streams all time out: its connection reset
        fetcher = WeightsFetcher(substrate, st.run_id, stalls)
        outbox = Outbox(substrate, st.run_id, capacity=4 * st.M + 8, stalls=stalls,
                        on_lost=st.lost,
                        # a bulk lane only on a direct path (node/transport/transports.py)
                        path_of=ctx.transports.path_of)
        self.compose(ctx, fetcher, outbox, listen_host(substrate),
                     averaged=st.m.outer.algorithm == "noloco")
        ctx.transports.serve(pipe.PROTOCOL_ID, self.routing.handle)
        ctx.transports.serve(pipe.WEIGHTS_PROTOCOL_ID, self.weights.serve)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.choice.hold_lease)
            nursery.start_soon(outbox.run)
            if self.averaging is not None:
                await nursery.start(self.averaging.run)
            await self.choice.choose()
            nursery.start_soon(self.choice.follow_membership)
            if self.weights.keeps_ends():
                nursery.start_soon(self.weights.keep_ends)
            task_status.started()
            await self.choice.wait_to_start()
            try:
                await self.thread.train()
            except Exception as e:
                from node.errors import TrainingFailed

                log.error("pipeline stopped: %s: %s", type(e).__name__, e)
                raise TrainingFailed(f"pipeline stopped: {type(e).__name__}: {e}") from e
            nursery.cancel_scope.cancel()

    # -- status --------------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        if self.map is None:
            return {"phase": "starting"}
        st = self.state
        smap = self.map.rows()
        out = self.outbox.counters if self.outbox else Counter()
        sent = {k: out.get(f"sent {k}", 0) for k in ("act", "grad", "tgt", "tied", "tgrad")}
        per_mb = {k: round(out.get(f"sent bytes {k}", 0) / sent[k]) for k in ("act", "grad")
                  if sent[k]}
        w = st.worker
        watch = w.watch if w is not None else None
        phase, stalled = stall.current(st.phase, st.phase_at, st.progress.phase, watch,
                                       w.wait_s() if w is not None else 0.0, smap,
                                       queued=st.inbox.qsize())
        return {
            "phase": phase,
            "stall": stalled.to_json() if stalled is not None else None,
            "stage": st.stage,
            "stages": st.n,
            "layers": list(st.layers),
            "micro_batches_per_step": st.M,
            "moves": st.moves,
            "map": {str(s): row for s, row in enumerate(smap)},
            "training": {**st.progress.snapshot(), "phase": phase,
                         "loss_age_s": stall.loss_age(watch)},
            "worker": w.stats.snapshot() if w else None,
            "sent": sent,
            "bytes_per_micro_batch": per_mb,
            "received": {k: v for k, v in st.counters.items() if k.startswith("received")},
            "lanes": {k: v for k, v in st.counters.items() if k.startswith("lanes")},
            "refused": {**{k: v for k, v in st.counters.items()
                           if k.startswith(("refused", "lost"))},
                        **{f"inbox {k}": v for k, v in st.inbox.refused.items()}},
            "queued": st.inbox.qsize(),
            "recovery": st.recovery,
            "claims": self.map.claims_statistics(),
            "replicas": (w.replicas.statistics()
                         if w is not None and w.replicas is not None else None),
            "weights_served": self.weights.served,
            "checkpoint_step": st.checkpointed,
            "ends_copies": self.weights.statistics(),
            "outbox": self.outbox.statistics() if self.outbox else {},
        }
