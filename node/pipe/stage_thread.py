"""The stage's worker (worker.py) in the trainer thread, torch's own, and its lifecycle.

Built in the trainer thread from the run's seed, then given the weights a mid-run stage
recovers (recovery.py) and NoLoCo's rounds (replica_averaging.py); it runs until it
fails, the service stops, or membership moves this node to a stage left with no host (a
takeover: the worker stops, the new stage is rebuilt and run). Its messages reach the
trio thread through Routing.dispatch; every checkpoint.every_steps steps it writes the
stage's own checkpoint (stage_ckpt.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import trio

from node.pipe import stage_ckpt
from node.pipe.choice import StageChoice
from node.pipe.links import Outgoing
from node.pipe.recovery import Recovery
from node.pipe.replica_averaging import ReplicaAveraging
from node.pipe.routing import Routing
from node.pipe.stage_map import StageMap
from node.pipe.state import PipeState
from node.process.trainer_thread import run_trainer_thread

if TYPE_CHECKING:
    from collections.abc import Callable

    from node.pipe.worker import StageWorker
    from node.service import NodeContext

log = logging.getLogger("node.pipeline")

class StageThread:
    def __init__(self, ctx: NodeContext, state: PipeState, stage_map: StageMap,
                 choice: StageChoice, recovery: Recovery, routing: Routing,
                 averaging: ReplicaAveraging | None = None, data: list[str] | None = None,
                 device: str = "cpu") -> None:
        self.ctx = ctx
        self.state = state
        self.map = stage_map
        self.choice = choice
        self.recovery = recovery
        self.routing = routing
        self.averaging = averaging
        self.data = data
        self.device = device

    async def train(self) -> None:
        """Run the stage's worker; when membership moves this node to a stage left with no
        host (a takeover), stop it, rebuild the new stage (Recovery) and run that."""
        st = self.state
        while True:
            await self._run_worker()
            move = st.move_to
            if move is None:
                return
            st.move_to = None
            self.choice.set_stage(move)
            while st.inbox.get(0) is not None:  # what came for the old stage
                pass

    async def _run_worker(self) -> None:
        st = self.state
        token = trio.lowlevel.current_trio_token()
        st.stop = threading.Event()

        def post(to: tuple, kind: str, stage: int, step: int, mb: int, hop: int,
                 tensor: Any, origin: str) -> None:
            with contextlib.suppress(trio.RunFinishedError, trio.Cancelled):
                trio.from_thread.run_sync(self.routing.dispatch, to, Outgoing(
                    kind, stage, step, mb, tensor, hop, origin),  # type: ignore[arg-type]
                    trio_token=token)

        st.worker = None
        worker = await trio.to_thread.run_sync(self.build_worker, post)
        st.phase, st.phase_at = f"recovering stage {st.stage}", time.monotonic()
        await self.recovery.recover(worker)
        st.phase = "training"
        worker.on_step = self.checkpoint_hook(worker)
        if self.averaging is not None:  # φ starts from the weights the stage starts with
            worker.replicas = await trio.to_thread.run_sync(self.averaging.rounds, worker,
                                                            token)
        st.worker = worker

        def main() -> None:
            import torch

            from node.process.priority import lower_session_priority, lower_thread_priority

            lower_thread_priority()
            lower_session_priority()
            try:
                torch.set_num_threads(st.m.train.threads)
                worker.run()
            except BaseException as e:
                st.progress.phase = "failed"
                st.progress.error = f"{type(e).__name__}: {e}"
                raise

        await run_trainer_thread(main, worker.stop, "peertrain-stage")

    def build_worker(self, post: Callable[..., None]) -> StageWorker:
        """In the trainer thread: the stage from the run's seed, its runner, its data."""
        import torch

        from node.ml.pipeline.runner import StageOptim, StageRunner
        from node.ml.pipeline.stages import build_stages
        from node.ml.trainer.models import GPTConfig
        from node.pipe.worker import StageWorker

        st = self.state
        m, s = st.m, st.stage
        assert s is not None
        torch.set_num_threads(m.train.threads)
        config = GPTConfig(d_model=m.model.d_model, n_layers=m.model.n_layers,
                           n_heads=m.model.n_heads, context=m.model.context)
        stages = build_stages(config, st.layers, m.run.seed)
        stage = stages[s]
        if stage.is_last and not stage.is_first:
            stage.set_tied(stages[0].wte.weight)
        stage.to(self.device)
        # as many as the inbox holds: a host left alone on its stage serves every origin
        runner = StageRunner(stage, StageOptim(lr=m.train.lr, grad_clip=m.train.grad_clip),
                             max_in_flight=st.inbox.capacity)
        st.progress.params = sum(p.numel() for p in stage.parameters())
        batches = None
        if s == 0:
            batches = self._batches()
        return StageWorker(runner, st.n, st.M, st.inbox, post, st.stop,
                           progress=st.progress, batches=batches, ready=self.map.complete,
                           device=self.device, first_step=self.map.swarm_step(),
                           leader_step=self.map.swarm_step, layers=st.layers, swap=st.swap,
                           last_hosts=self.routing.last_hosts, origin=self.ctx.peer_id,
                           arrivals=self.routing.arrivals)

    def _batches(self) -> Any:
        import torch

        from node.ml.trainer.tasks import TaskConfig, build_task
        from node.training.build import replica_index

        m = self.state.m
        files = tuple(self.data) if self.data else (
            tuple(m.data.paths) if m.data.source == "files" else ())
        task = build_task(TaskConfig(
            name=m.model.task, d_model=m.model.d_model, n_layers=m.model.n_layers,
            n_heads=m.model.n_heads, context=m.model.context, data_files=files,
            data_format=m.data.format, jsonl_field=m.data.jsonl_field,
            val_fraction=m.data.val_fraction))
        gen = torch.Generator().manual_seed(m.run.seed * 1_000_003
                                            + replica_index(self.ctx.peer_id))
        return lambda: task.train_batch(m.train.batch_size, gen)

    def checkpoint_hook(self, worker: StageWorker) -> Callable[[int], None]:
        """The worker's on_step: the stage's own checkpoint every checkpoint.every_steps
        steps (trainer thread). A failed write (a full disk) is logged; training goes on."""
        st, s = self.state, self.state.stage
        assert s is not None
        every = st.m.checkpoint.every_steps
        path = stage_ckpt.path_for(self.ctx.config.state_dir, st.run_id, s)

        def on_step(step: int) -> None:
            if step <= 0 or step % every:
                return
            try:
                stage_ckpt.save(path, worker.runner, st.run_id, list(st.layers), step,
                                worker.trained)
            except OSError as e:
                log.warning("pipeline: stage %d's checkpoint at step %d not written: %s",
                            s, step, e)
                return
            st.checkpointed = step

        return on_step
