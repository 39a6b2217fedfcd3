"""The services of each role, in the order they start: the one place to read what a node runs.

    every node   control, metrics, guard, manifests, checkpoint server, redialer,
                 reachability, relay, [hole punch], WebRTC, paths, [mDNS]     (daemon.py)
    bootstrap    + heartbeats relayed (not published), peer records      bootstrap_services
    run member   + heartbeats, run document, peer records, remembered peers  member_services
                 + a data-parallel trainer's checkpoint service, which pulls the
                   newest checkpoint before it is ready, and its trainer built
                   meanwhile                                              prepare_trainer
    trainer      + the pipeline (a pipeline run), or [SybilWall's history gossip],
                   [averaging] and training                              trainer_services

The daemon (node/daemon.py) builds the context, calls these as the node learns its role,
and starts what they return, each service ready before the next (node/service.py). Every
torch-importing module is imported inside the function that needs it, and only once
`preload.ready()` has returned on the paths that train: an import on the trio thread would
block it on the background import's lock (node/process/preload.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from node.discovery.remembered import RememberPeers
from node.errors import DeviceUnavailable
from node.membership.heartbeats import HeartbeatService
from node.membership.records import PeerRecordService
from node.process import preload
from node.service import NodeContext, Service

if TYPE_CHECKING:
    from collections.abc import Callable

    from node.checkpoints.service import CheckpointService
    from node.config import NodeConfig
    from node.membership.redial import Redialer
    from node.run.rundoc_sync import RunDocSync
    from node.training.build import Prebuild


def bootstrap_services(config: NodeConfig, runs: list[str]) -> list[Service]:
    """Relay the runs' gossip and list their peers; train nothing."""
    return [HeartbeatService(runs, publish=False, interval_s=config.heartbeat_s,
                             target_inbound_per_s=config.heartbeat_target_per_s),
            PeerRecordService(config.reprovide_s)]


def member_services(ctx: NodeContext, rundoc: RunDocSync,
                    remember: Callable[[], dict[str, list[str]]]) -> list[Service]:
    """What every member of a run runs: it is heard, it holds the run document, it can be
    found, and it remembers where the next join of its state directory starts."""
    config, run_id = ctx.config, ctx.the_run().run_id
    return [HeartbeatService([run_id], publish=True, interval_s=config.heartbeat_s,
                             target_inbound_per_s=config.heartbeat_target_per_s),
            rundoc,
            PeerRecordService(config.reprovide_s),
            RememberPeers(config.state_dir, run_id, ctx.peer_id, remember)]


@dataclass
class TrainerPrep:
    """What a data-parallel trainer's join sets going before torch is in: the checkpoint
    service (a service of its own, started with the member services) and the trainer,
    built in the background once torch is loaded but not while a checkpoint downloads."""

    checkpoints: CheckpointService
    prebuilt: Prebuild


def prepare_trainer(ctx: NodeContext, rundoc: RunDocSync) -> TrainerPrep:
    from node.checkpoints.service import CheckpointService
    from node.checkpoints.vet import CheckpointVet
    from node.training.build import Prebuild, build_training

    config, manifest = ctx.config, ctx.the_run().manifest
    prebuilt: list[Prebuild] = []  # the vet asks for the trainer only after both exist
    # Pulls the newest checkpoint before it reports ready; needs no torch (still loading
    # in the background) until it checks the pulled checkpoint's claim of progress with
    # the trainer built meanwhile.
    checkpoints = CheckpointService(
        publish=rundoc.publish, synced=rundoc.first_sync, still_loading=preload.pending,
        members_heard=lambda: any(p != ctx.peer_id for p in ctx.membership.live_nodes()),
        vet=CheckpointVet(ctx, lambda: prebuilt[0].result()))

    def build() -> Any:
        # testnets only: a stand-in at a measured device's step time (node/training/timed.py)
        from node.training.timed import build_timed, from_env

        if (stand_in := from_env()) is not None:
            return build_timed(manifest, ctx.peer_id, *stand_in)
        return build_training(manifest, ctx.peer_id, resolve_device_name(config.device),
                              config.data, attack=config.attack)

    prebuilt.append(Prebuild(build, hold=lambda: checkpoints.downloading))
    return TrainerPrep(checkpoints, prebuilt[0])


def trainer_services(ctx: NodeContext, prep: TrainerPrep | None,
                     redialer: Redialer) -> list[Service]:
    """Once torch is loaded and the device known: a pipeline run's stage host, or the
    data-parallel trainer with its averaging (and SybilWall's history gossip). The
    averager's recent partners keep their connections past `max_peers` (`redialer`)."""
    config, run = ctx.config, ctx.the_run()
    m = run.manifest
    if m.pipeline is not None:
        from node.pipe.service import PipelineService

        return [PipelineService(m, run.run_id, run.progress, config.data, device=ctx.device)]
    from node.averaging import adapt
    from node.averaging.history_gossip import HistoryGossip
    from node.averaging.service import Averager
    from node.membership.redial import dial_partner
    from node.training.build import POISON_ROUNDS, neighbours, resume_newest
    from node.training.service import TrainingService
    from protocols import sparse

    assert prep is not None, "a data-parallel trainer is prepared at the join"
    services: list[Service] = []
    averager = None
    if m.outer.algorithm != "none":
        history = None
        if m.aggregate.method == "sybilwall" and m.outer.algorithm == "gossip":
            history = HistoryGossip()
            services.append(history)
        averager = Averager(
            ctx.substrate, run.run_id, ctx.peer_id, ctx.membership.live_nodes,
            codecs=adapt.supported(m.outer.codec), auto_codec=m.outer.codec == adapt.AUTO,
            group_size=m.outer.group_size,
            step_time=run.progress.step_time, inner_steps=m.outer.inner_steps,
            stats=run.progress, neighbours=neighbours(m),
            fixed_neighbours=config.neighbours or None,
            after_round=history.after_round if history else None,
            transports=ctx.transports, all_reduce=m.outer.algorithm == "diloco",
            relay_limit=int(m.network.relay_exchange_mb * 1e6),
            topk_bounds=sparse.bounds_of(m.outer),
            dial=lambda peer: dial_partner(ctx.substrate, peer,
                                           ctx.membership.addresses_of(peer)))
        redialer.protect = averager.partners_now
        services.append(averager)
    prebuilt = prep.prebuilt

    def build() -> tuple[Any, Any, int]:
        trainer, outer, inner_steps = prebuilt.result()
        resume_newest(m, trainer, outer, ctx.checkpoints, stats=run.progress)
        return trainer, outer, inner_steps

    services.append(TrainingService(
        build,
        exchange=(averager.allreduce if m.outer.algorithm == "diloco" else averager.exchange)
        if averager else None,
        checkpoint_every=m.checkpoint.every_steps, on_snapshot=prep.checkpoints.save,
        poison_steps=POISON_ROUNDS * m.outer.inner_steps if config.attack else None,
        stats=run.progress,
        expected_exchange_s=averager.expected_exchange_s if averager else None))
    return services


def resolve_device_name(spec: str) -> str:
    """`auto` picks CUDA when torch sees a GPU (node/ml/device.py; torch is imported here,
    lazily: it costs a second or more)."""
    if spec == "cpu":
        return "cpu"
    from node.ml import device

    try:
        return str(device.resolve(spec))
    except device.DeviceError as e:
        raise DeviceUnavailable(f"--device {spec}: {e}") from e
