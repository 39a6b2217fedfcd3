"""A stage that starts while the run trains takes the most trained weights it can reach.

By the rule of node/ml/recovery/sources.py (docs/pipeline.md, "What a stage's weights
claim"): a live replica or this node's own checkpoint of the stage whose weights are
current, else a rebuild from its neighbours (CheckFree: every host of each source stage
is asked), else the stale ones, most trained first; only then the seed's weights, with the
reasons logged. Each source's claim of trained steps, never the clock, ranks it and goes
with its weights (`worker.trained`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.pipe import stage_ckpt
from node.pipe.claims import RENEW_S
from node.pipe.convergence import FRESH_S
from node.pipe.fetch import WeightsFetcher, why
from node.pipe.stage_map import StageMap
from node.pipe.state import PipeState
from node.pipe.weights import WeightsServer

if TYPE_CHECKING:
    from node.pipe.worker import StageWorker
    from node.service import NodeContext

log = logging.getLogger("node.pipeline")

STALE_CHECKPOINTS = 10  # a host's own stage checkpoint older than this many intervals: rebuild
PEER_CHECKPOINTS_S = 20.0  # a recovery waits at most this for other peers' stage checkpoints
HEAR_TTLS = 2  # a recovery waits at most this many peer ttls to hear every claimed host
RECENT_RENEWALS = 2  # a claim renewed within this many renewal intervals: a live host
HEAR_POLL_S = 0.25  # how often it looks again (heartbeats land in the membership view)


class Recovery:
    def __init__(self, ctx: NodeContext, state: PipeState, stage_map: StageMap,
                 fetcher: WeightsFetcher, weights: WeightsServer) -> None:
        self.ctx = ctx
        self.state = state
        self.map = stage_map
        self.fetcher = fetcher
        self.weights = weights  # the ends copy CheckFree+ restores an edge's ends from

    async def recover(self, worker: StageWorker) -> None:
        """Mid-run, a stage is not drawn from the seed: it takes its weights from the
        first source that answers, in the order sources.rank gives (module docstring)."""
        from node.ml.recovery import sources

        st, s, p = self.state, self.state.stage, self.state.pipeline
        assert s is not None
        await self._hear_hosts()  # the step and the rule are read off what we have heard
        swarm = self.map.swarm_step()
        if swarm == 0:
            worker.started_from(0)
            return  # a fresh run: every stage starts from the run's seed
        t0 = time.monotonic()
        smap = self.map.rows()
        own = stage_ckpt.path_for(self.ctx.config.state_dir, st.run_id, s)
        claim: int | None = None
        if own.exists():
            try:
                claim = (await trio.to_thread.run_sync(
                    stage_ckpt.claim, own, st.run_id, s, list(st.layers))).trained
            except stage_ckpt.StageCheckpointError as e:
                log.warning("pipeline: this node's checkpoint of stage %d is not used: %s",
                            s, e)
        fresh = swarm - STALE_CHECKPOINTS * st.m.checkpoint.every_steps
        failed: list[str] = []
        for src in sources.rank(self.claims(smap[s]), claim, swarm, fresh,
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

    def claims(self, hosts: list[str]) -> dict[str, int | None]:
        """The trained steps `hosts` claim in every heartbeat heard within FRESH_S: a host
        of the map whose heartbeat is late by more than the ttl keeps its claim."""
        return self.map.trained_of(hosts, heard_within_s=FRESH_S)

    async def _hear_hosts(self) -> None:
        """Wait, at most HEAR_TTLS peer ttls, until this node has heard the trained steps of
        every host whose stage claim was renewed lately (sources.unheard), and a swarm step
        where a heard host's weights say the run has trained: a host not heard yet made its
        stage count as lost, which changed the rule, or left the swarm's step unconfirmed,
        and a joiner read 0 as a fresh run and took the seed's weights (CI, 2026-12-08). A
        killed host's claim stops counting RECENT_RENEWALS renewals after its death."""
        from node.ml.recovery.sources import unheard

        def waiting_for() -> str | None:
            claimed = self.map.renewing(RECENT_RENEWALS * RENEW_S)
            trained = self.claims(list(claimed))
            if missing := unheard(claimed, trained, self.ctx.peer_id):
                return f"the trained steps of {', '.join(q[-6:] for q in missing)}"
            if self.map.swarm_step() == 0 and any(t for t in trained.values()):
                return "a swarm step (hosts claim trained weights, no step is confirmed)"
            return None

        bound = HEAR_TTLS * self.ctx.config.peer_ttl_s
        with trio.move_on_after(bound):
            while (what := waiting_for()) is not None:
                log.debug("pipeline: recovery waits for %s", what)
                await trio.sleep(HEAR_POLL_S)
            return
        log.info("pipeline: recovery goes on without %s (not heard within %.0f s)", what,
                 bound)

    async def _copy(self, worker: StageWorker, peer: str, swarm: int, t0: float) -> bool:
        """A live replica's weights and its claim (its answer's, else its heartbeats')."""
        shapes = {k: tuple(v.shape) for k, v in worker.runner.stage.state_dict().items()}
        got, _ = await self.fetcher.first([peer], self.state.stage or 0, "all", shapes)
        if got is None:
            return False
        said = self.claims([peer]).get(peer)
        trained = got[1].trained if got[1].trained is not None else said or 0
        await trio.to_thread.run_sync(worker.load_copy, got[1].tensors)
        worker.started_from(min(trained, swarm))
        self._recovered("copy", [peer], t0, swarm, f"{worker.trained} trained steps")
        return True

    async def _resume(self, worker: StageWorker, own: Path, swarm: int, t0: float) -> bool:
        """This node's own checkpoint of the stage, whatever its claim (ranked already)."""
        st = self.state
        try:
            got = await trio.to_thread.run_sync(stage_ckpt.load, own, worker.runner,
                                                st.run_id, list(st.layers), 0)
        except stage_ckpt.StageCheckpointError as e:
            log.warning("pipeline: this node's checkpoint of stage %s is not used: %s",
                        st.stage, e)
            return False
        worker.started_from(min(got.trained, swarm))
        self._recovered("checkpoint", [], t0, swarm, f"this node's checkpoint of step "
                        f"{got.step}, trained {got.trained} steps, "
                        f"{max(swarm - got.trained, 0)} behind the swarm")
        return True

    async def _from_peers(self, worker: StageWorker, smap: list[list[str]], swarm: int, fresh: int,
                          t0: float) -> bool:
        """Another peer's own checkpoint of our stage (one that hosted it before), if its
        weights are current: every live peer that does not host it is asked at once, the
        first current answer taken (a refusal from each peer that holds none)."""
        from node.ml.recovery.sources import is_current

        me, s = self.ctx.peer_id, self.state.stage
        assert s is not None
        peers = [e.peer_id for e in self.map.live() if e.info.get("role") == "node"
                 and e.peer_id != me and e.peer_id not in smap[s]]
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

    async def _rebuild(self, worker: StageWorker, smap: list[list[str]], swarm: int, fresh: int,
                       t0: float) -> None:
        """CheckFree (or CheckFree+) from the nearest surviving stages, past any adjacent
        stage that is lost too (sources.lost_stages); raises when it cannot. The rebuilt
        stage claims the least trained of its sources (its weights are theirs)."""
        from node.ml.recovery.checkfree import RecoveryError, plan
        from node.ml.recovery.sources import lost_stages

        me, s, p = self.ctx.peer_id, self.state.stage, self.state.pipeline
        layers = list(self.state.layers)
        assert s is not None
        mode = p.recovery
        assert mode != "none", "a stage is rebuilt only under CheckFree (or CheckFree+)"
        # A stage with no live host is lost; for the fallback below its hosts heard within
        # FRESH_S of the newest heartbeat still count: a starved joiner's live view loses
        # hosts whose heartbeats it was too busy to take in, and a lost stage 0 then had no
        # partner to copy and took the seed (CI, 2026-12-08). A dead one fails its fetch.
        heard = self.map.rows(heard_within_s=FRESH_S)
        reach = [row or [q for q in heard[j] if q != me] for j, row in enumerate(smap)]
        said = self.claims([q for row in reach for q in row])
        empty = {j for j, row in enumerate(reach) if j != s and not set(row) - {me}}
        lost = lost_stages(smap, said, fresh, me) - {s}
        try:
            how = plan(s, layers, mode, lost)
        except RecoveryError:
            # past the untrained stages there is no source (an edge): hosted stages, however
            # few steps their weights claim (a stalled one steps its clock, not its weights),
            # beat the seed
            how = plan(s, layers, mode, empty)
        if set(how.sources) & lost:
            log.info("pipeline: stage %d is rebuilt from stages %s, which claim few trained "
                     "steps: nothing nearer survives", s, how.sources)
        elif lost:
            log.info("pipeline: stages %s are lost too; stage %d is rebuilt from the nearest "
                     "surviving stages %s", sorted(lost), s, how.sources)
        ends = await self.weights.ends_copy(worker, s, reach) if how.ends else None
        shapes = {k: tuple(v.shape) for k, v in worker.runner.stage.blocks.state_dict().items()}
        blocks: dict[int, Any] = {}
        norms: dict[int, float] = {}
        claims: list[int] = []
        found: list[str] = []
        for j in how.sources:  # its most trained hosts first
            hosts = sorted(reach[j], key=lambda q: -(said.get(q) or 0))
            got, failed = await self.fetcher.first(hosts, j, "blocks", shapes)
            if got is None:
                raise RecoveryError(f"no host of stage {j}, a source of stage {s}, gave "
                                    f"its blocks (asked {len(hosts)}"
                                    f"{': ' if failed else ''}{'; '.join(failed)})")
            peer, answer = got
            blocks[j] = answer.tensors
            gossiped = self.map.gossiped_norm(peer)
            norms[j] = gossiped if gossiped is not None else answer.gnorm
            claims.append(answer.trained if answer.trained is not None else 0)
            found.append(peer)
        await trio.to_thread.run_sync(worker.rebuild, how, blocks, norms,
                                      self.state.m.train.grad_clip, p.lr_boost)
        if ends is not None:
            holder, tensors = ends
            await trio.to_thread.run_sync(worker.load_ends, tensors)
            found += [holder] if holder not in found else []
        worker.started_from(min([*claims, swarm]))
        rule = how.rule if ends is None else "ends" if how.rule == "none" else f"{how.rule}+ends"
        self._recovered(rule, found, t0, swarm, norms={str(k): v for k, v in norms.items()})

    def _recovered(self, rule: str, sources: list[str], t0: float, step: int,
                   reason: str | None = None, norms: dict[str, float] | None = None) -> None:
        self.state.recovery = {"rule": rule, "sources": sources, "at_step": step,
                               "seconds": round(time.monotonic() - t0, 3), "reason": reason,
                               "norms": norms}
        log.info("pipeline: stage %s started mid-run at step %d by %s from %s (%.2f s)%s",
                 self.state.stage, step, rule, sources, time.monotonic() - t0,
                 f": {reason}" if reason else "")
