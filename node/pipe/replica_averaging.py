"""NoLoCo between the hosts of one stage: the stage's Averager and its rounds.

The Averager (node/averaging) runs on `/peertrain/avg/1.0.0` keyed by stage, so a replica
of another stage refuses; its partners are the other live hosts of this node's stage. The
worker's ReplicaRounds (replicas.py) post θ from the trainer thread; the exchange runs
here, on the trio thread, and hands the outcome back.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import trio

from node.pipe.stage_map import StageMap
from node.pipe.state import PipeState

if TYPE_CHECKING:
    from node.averaging.service import Averager
    from node.pipe.replicas import ReplicaRounds
    from node.pipe.worker import StageWorker
    from node.service import NodeContext


class ReplicaAveraging:
    def __init__(self, ctx: NodeContext, state: PipeState, stage_map: StageMap) -> None:
        from node.averaging import adapt
        from node.averaging.service import Averager

        self.ctx = ctx
        self.state = state
        self.map = stage_map
        m = state.m
        o = m.outer
        self.averager: Averager = Averager(
            ctx.substrate, self.key(), ctx.peer_id, self.partners,
            codecs=adapt.supported(o.codec), auto_codec=o.codec == adapt.AUTO, group_size=2,
            step_time=state.progress.step_time, inner_steps=o.inner_steps,
            stats=state.progress, transports=ctx.transports,
            relay_limit=int(m.network.relay_exchange_mb * 1e6))
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """The Averager, and the exchanges the rounds start, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.averager.run)
            task_status.started()
            await trio.sleep_forever()

    def key(self) -> str:
        """The run key of this stage's exchanges: a replica of another stage refuses."""
        return f"{self.state.run_id}/stage{self.state.stage}"

    def rekey(self) -> None:
        """This node moved to another stage: its exchanges follow (choice.py)."""
        self.averager.run_id = self.key()

    def partners(self) -> list[str]:
        """The other live hosts of this node's stage (called from both threads)."""
        s = self.state.stage
        if s is None:
            return []
        return [p for p in self.map.rows()[s] if p != self.ctx.peer_id]

    def has_partners(self) -> bool:
        return bool(self.partners())

    def rounds(self, worker: StageWorker, token: trio.lowlevel.TrioToken) -> ReplicaRounds:
        """The worker's rounds (trainer thread), from the weights its stage starts with."""
        from node.ml.optim import NoLoCoConfig
        from node.pipe.replicas import ReplicaRounds

        o = self.state.m.outer
        rounds: ReplicaRounds | None = None

        def post(r: int, theta: Any) -> None:  # trainer thread
            assert rounds is not None
            with contextlib.suppress(trio.RunFinishedError, trio.Cancelled):
                trio.from_thread.run_sync(self._start_exchange, rounds, r, theta,
                                          trio_token=token)

        rounds = ReplicaRounds(worker.runner.stage, o.inner_steps,
                               NoLoCoConfig(outer_lr=o.outer_lr, momentum=o.momentum), post,
                               has_partners=self.has_partners, progress=self.state.progress)
        return rounds

    def _start_exchange(self, rounds: ReplicaRounds, r: int, theta: Any) -> None:
        async def exchange() -> None:
            rounds.deliver(await self.averager.exchange(r, theta))  # never raises

        if self._nursery is not None:
            self._nursery.start_soon(exchange)
