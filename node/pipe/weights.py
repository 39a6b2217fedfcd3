"""The pipe-weights server (`/peertrain/pipe-weights/1.0.0`) and CheckFree+'s ends copies.

A host answers a stage's weights (all of them, its blocks, or its ends) from its running
worker; a stage it does not host from its own checkpoint of it (a replacement of a stage
lost on every host takes that if current: docs/pipeline.md, "Adjacent losses"); an edge
stage's ends from the copy a host of the next stage keeps, refreshed every ENDS_EVERY_S,
so that a replacement can restore them when that edge loses every host.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import trio

from node.pipe import stage_ckpt
from node.pipe.fetch import WeightsFetcher
from node.pipe.stage_map import StageMap
from node.pipe.state import PipeState
from protocols import pipeline as pipe

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from node.ml.recovery import EdgeCopies
    from node.pipe.worker import StageWorker
    from node.service import NodeContext

log = logging.getLogger("node.pipeline")

ENDS_EVERY_S = 10.0  # CheckFree+: how often a neighbour refreshes its copy of an edge's ends


class WeightsServer:
    def __init__(self, ctx: NodeContext, state: PipeState, stage_map: StageMap,
                 fetcher: WeightsFetcher) -> None:
        self.ctx = ctx
        self.state = state
        self.map = stage_map
        self.fetcher = fetcher
        self.served = 0
        # CheckFree+: the ends (embedding, final norm) of a neighbouring edge stage, kept so
        # that a replacement can restore them when that stage loses every host; refreshed
        # every ENDS_EVERY_S (keep_ends). An EdgeCopies once torch is loaded.
        self.ends_copies: EdgeCopies | None = None

    async def serve(self, stream: INetStream) -> None:
        from node.transport.streams import next_event, write_chunks

        st = self.state
        try:
            with trio.fail_after(10):
                decoder = pipe.WEIGHTS_REQUEST_LIMITS.decoder()
                stage, part = pipe.check_weights_request(await next_event(stream, decoder),
                                                         st.run_id)
            worker = st.worker
            copies = self.ends_copies
            if part == "ends" and stage != st.stage and copies is not None \
                    and stage in copies.refreshed_at:
                step, gnorm, state = copies.refreshed_at[stage], 0.0, copies.get(stage)
                trained = None
            elif part == "all" and stage != st.stage and (
                    held := await trio.to_thread.run_sync(self.held_checkpoint, stage)):
                step, gnorm, state, trained = held
            elif worker is None or stage != st.stage:
                await stream.write(pipe.encode_no_weights(
                    f"this node hosts stage {st.stage}, not {stage}" if worker
                    else "not training yet"))
                return
            else:
                step, gnorm, state, trained = await trio.to_thread.run_sync(worker.snapshot,
                                                                            part)
            with trio.fail_after(pipe.WEIGHTS_DEADLINE_S):
                await write_chunks(stream, pipe.encode_weights(st.run_id, stage, step,
                                                               gnorm, state, trained))
            self.served += 1
        finally:
            with contextlib.suppress(Exception), trio.move_on_after(2):
                await stream.close()

    def held_checkpoint(self, stage: int) -> tuple[int, float, dict[str, Any], int] | None:
        """This node's own checkpoint of `stage`, which it does not host now (it moved, or
        restarted on another stage), as a weights answer: a replacement of that stage,
        lost on every host, takes it if current (docs/pipeline.md, "Adjacent losses")."""
        st = self.state
        if not 0 <= stage < st.n:
            return None
        path = stage_ckpt.path_for(self.ctx.config.state_dir, st.run_id, stage)
        if not path.exists():
            return None
        try:
            got, model = stage_ckpt.weights(path, st.run_id, stage, list(st.layers))
        except stage_ckpt.StageCheckpointError as e:
            log.info("pipeline: not serving this node's checkpoint of stage %d: %s", stage, e)
            return None
        return got.step, 0.0, model, got.trained

    def edge_neighbour(self, edge: int) -> int:
        return 1 if edge == 0 else self.state.n - 2

    async def ends_copy(self, worker: StageWorker, s: int, smap: list[list[str]]
                        ) -> tuple[str, dict[str, Any]]:
        """CheckFree+: (holder, tensors) of the copy of lost edge stage `s`'s ends (its
        embedding / final norm) that its neighbour keeps; ours if this node was that
        neighbour (a takeover). RecoveryError when no neighbour has one."""
        from node.ml.recovery.checkfree import RecoveryError

        if self.ends_copies is not None and s in self.ends_copies.refreshed_at:
            return self.ctx.peer_id, self.ends_copies.get(s)
        shapes = {k: tuple(v.shape) for k, v in worker.runner.stage.ends_state().items()}
        holders = smap[self.edge_neighbour(s)]
        got, failed = await self.fetcher.first(holders, s, "ends", shapes)
        if got is None:
            raise RecoveryError(f"no neighbour holds a copy of stage {s}'s ends "
                                f"(asked {len(holders)}: {'; '.join(failed)})")
        return got[0], got[1].tensors

    def keeps_ends(self) -> bool:
        """Whether the edges' neighbours keep a copy of their ends: under CheckFree+, and
        under CheckFree too where a lost edge takes CheckFree+'s rule (checkfree.plan)."""
        from node.ml.recovery.checkfree import edges_have_rule

        return edges_have_rule(self.state.layers, self.state.pipeline.recovery)

    async def keep_ends(self) -> None:
        """CheckFree+: a host of the stage next to an edge stage keeps a copy of that
        edge's ends, refreshed every ENDS_EVERY_S from one of its live hosts."""
        from node.ml.recovery import EdgeCopies

        st = self.state
        copies = self.ends_copies = EdgeCopies()
        shapes: dict[int, dict[str, tuple[int, ...]]] = {}  # per edge, built once
        while True:
            await trio.sleep(ENDS_EVERY_S)
            if not st.training or st.worker is None or st.stage is None:
                continue
            for edge in (0, st.n - 1):
                if edge == st.stage or self.edge_neighbour(edge) != st.stage:
                    continue
                hosts = self.map.rows()[edge]
                if not hosts:
                    continue  # lost: keep the copy we have, a replacement will ask for it
                try:
                    if edge not in shapes:
                        shapes[edge] = await trio.to_thread.run_sync(self._ends_shapes, edge)
                    got = await self.fetcher.fetch(hosts[0], edge, "ends", shapes[edge])
                except Exception as e:
                    log.info("pipeline: refreshing the copy of stage %d's ends: %s", edge, e)
                    continue
                copies.refresh(edge, got.tensors, got.step)

    def _ends_shapes(self, edge: int) -> dict[str, tuple[int, ...]]:
        from node.ml.pipeline.stages import Stage
        from node.ml.trainer.models import GPTConfig

        m = self.state.m.model
        config = GPTConfig(d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                           context=m.context)
        template = Stage(config, edge, self.state.n, 0)
        return {k: tuple(v.shape) for k, v in template.ends_state().items()}

    def statistics(self) -> dict[str, int]:
        """Edge stage -> the step of our copy of its ends."""
        if self.ends_copies is None:
            return {}
        return {str(k): step for k, step in self.ends_copies.refreshed_at.items()}
