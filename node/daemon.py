"""The daemon: the composition root that builds a node's services and runs them.

`Node.run()` goes through phases that `node status` shows:

    starting -> connecting (bootstrap peers) -> discovering (the run's manifest, fetched
    from its providers and verified) -> [syncing state -> finding providers ->
    downloading checkpoint] -> running

Every node runs the base services; a bootstrap node (no run-id) then serves and provides
the runs in its store; a node that joins a run adds the run's services once the manifest
is verified. Services start in the order listed, each ready before the next (node/service.py);
all live in one nursery, so SIGINT/SIGTERM cancel them all.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

import trio

from node import preload
from node.checkpoints.exchange import CheckpointServer
from node.checkpoints.store import CheckpointStore
from node.config import NodeConfig
from node.discovery import remembered
from node.discovery.mdns import MdnsService
from node.discovery.remembered import RememberPeers
from node.discovery.sources import NoBootstrapPeer, Source, connect_first, how_to_give_one
from node.errors import (
    BootstrapUnreachable,
    DeviceUnavailable,
    StateDirError,
    TrainingFailed,
)
from node.files import atomic_write
from node.guard.service import GuardService, classify
from node.membership.heartbeats import HeartbeatService
from node.membership.records import VALIDATORS, PeerRecordService
from node.membership.redial import Redialer
from node.membership.view import Membership
from node.memory import tune_malloc
from node.metrics.service import MetricsService
from node.reach.paths import PathService
from node.reach.punch import HolePunchService
from node.reach.relays import RelayService
from node.reach.service import ReachabilityService
from node.run.manifest import ManifestService
from node.run.rundoc_sync import RunDocSync, load_document, stamps
from node.run.store import RunStore
from node.service import NodeContext, RunContext, Service
from node.status.control import ControlService
from node.training.data_check import check_training_data
from node.webrtc.service import WebRtcService
from p2p.gate import Gate
from p2p.host import Substrate
from p2p.identity import IdentityError, load_or_create_identity
from p2p.pubsub import PacedPublisher
from protocols import keys
from protocols import manifest as mf

log = logging.getLogger("node")

ADDRS_FILE = "addrs.json"
# The trainer thread holds the GIL between torch ops. With small models (many short ops)
# the trio thread then waits up to the switch interval (5 ms by default) after every
# socket call, and an exchange of hundreds of them takes seconds (measured: every exchange
# of a 7-node digits testnet timed out, heartbeats arrived ~9 s late). A forced switch
# costs nothing while trio sleeps in epoll, where it holds no GIL.
SWITCH_INTERVAL_S = 0.0002


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.started_unix = time.time()
        self.stop_signal: int | None = None  # SIGINT/SIGTERM that stopped us (cli: exit code)
        try:
            config.state_dir.mkdir(parents=True, exist_ok=True)
            key_pair = load_or_create_identity(config.state_dir)
        except (OSError, IdentityError) as e:
            raise StateDirError(f"cannot use state directory {config.state_dir}: {e}") from e
        signer = keys.Signer(key_pair.private_key.to_bytes()[:32])
        gate = Gate(config.budget, config.scoring, classify=classify)
        substrate = Substrate(key_pair, config.listen, dht_protocol_validators=VALIDATORS,
                              gate=gate, announce=config.announce)
        self.ctx = NodeContext(
            config=config, substrate=substrate, signer=signer,
            publisher=PacedPublisher(substrate), runs=RunStore(config.state_dir),
            checkpoints=CheckpointStore(config.state_dir),
            membership=Membership(signer.peer_id, ttl_s=config.peer_ttl_s))
        self.manifests = ManifestService()
        self.redialer = Redialer(substrate, config.bootstrap, self.ctx.membership.addresses)
        self.mdns = MdnsService(signer.peer_id, config.listen) if config.mdns else None
        self.bootstrap_reached: list[str] = []  # addresses that answered at start
        self._checkpoints: Any = None  # a trainer's CheckpointService, built at the join
        self._prebuilt: Any = None  # ... and its trainer, built once torch is in (Prebuild)
        self.metrics = MetricsService(self.status, config.metrics,
                                      fallback=config.metrics_fallback,
                                      progress_s=config.progress_s)
        reach = ReachabilityService(upnp=config.upnp)
        self.ctx.lane_dialable = reach.lane_dialable
        punch = HolePunchService(reach.verdict)
        # WebRTC data channels to peers reached only through a relay (node/webrtc/);
        # averaging and checkpoint pulls open their streams through it.
        self.webrtc = WebRtcService(reach.verdict)
        # Path kinds other services label (the punch's; a WebRTC transport adds its own).
        self.paths = PathService([punch.label], upnp_mapped=reach.mapped)
        self.ctx.open_stream = self.webrtc.open_stream
        # a data channel's path is `webrtc`, not the relay's: no relay budget, no lane
        self.ctx.path_of = lambda peer: (self.webrtc.paths().get(peer)
                                         or self.paths.paths().get(peer, "direct"))
        checkpoint_server = CheckpointServer(self.ctx.checkpoints)
        self.webrtc.set_handler(checkpoint_server.protocols[0], checkpoint_server.handle)
        self.services: list[Service] = [
            ControlService({"status": self.status, "ping": lambda: "pong",
                            "rundoc": self._rundoc_stamps,
                            "api_status": self.metrics.api_status}),
            self.metrics,
            GuardService(gate),
            self.manifests,
            checkpoint_server,
            self.redialer,
            reach,
            RelayService(reach.verdict),
            *([punch] if config.punch else []),
            self.webrtc,
            self.paths,
            *([self.mdns] if self.mdns else []),
        ]

    @property
    def peer_id(self) -> str:
        return self.ctx.peer_id

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        tune_malloc()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            await self._run(task_status)
        finally:
            if self._prebuilt is not None:
                self._prebuilt.cancel()

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        ctx = self.ctx
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_on_signals, nursery.cancel_scope)
            if self.config.run_id is not None and self.config.train:
                preload.start()  # torch loads while the node joins (node/preload.py)
            await nursery.start(ctx.substrate.serve)
            await nursery.start(ctx.publisher.run)
            for service in self.services:
                await nursery.start(service.run, ctx)
            self._write_addrs()
            log.info("peer %s listening on %s", self.peer_id, " ".join(ctx.substrate.addrs()))
            if await self._connect_bootstrap():
                # The DHT self-lookup fills the routing table in the background: discovery
                # needs only the bootstrap peers (in the table once dialed, and asked
                # directly); waiting for its round trips made `connect` 2-3 s of a start.
                assert ctx.substrate.dht is not None
                nursery.start_soon(ctx.substrate.dht.bootstrap)
            if self.config.run_id is None:
                runs = ctx.runs.run_ids()
                for run_id in runs:
                    await self.manifests.provide(ctx, run_id)
                    log.info("serving run %s", run_id)
                more = self._bootstrap_services(runs)
            else:
                more = await self._join(self.config.run_id, nursery)
            for service in more:
                self.services.append(service)
                await nursery.start(service.run, ctx)
            if self.config.run_id is not None:
                for service in await self._trainer_services():
                    self.services.append(service)
                    await nursery.start(service.run, ctx)
            ctx.phases.enter("running")
            task_status.started()

    # -- what each role runs ------------------------------------------------------------------

    def _bootstrap_services(self, runs: list[str]) -> list[Service]:
        """Relay the runs' gossip and list their peers; train nothing."""
        return [HeartbeatService(runs, publish=False, interval_s=self.config.heartbeat_s),
                PeerRecordService(self.config.reprovide_s)]

    async def _join(self, run_id: str, nursery: trio.Nursery) -> list[Service]:
        """Find and verify the run, then build the services of a node in it."""
        ctx, config = self.ctx, self.config
        ctx.phases.enter("discovering")
        manifest = await self.manifests.resolve(ctx, run_id)
        if config.train:  # data that cannot train is refused before we announce
            await trio.to_thread.run_sync(check_training_data, manifest, config.data)
        # fsynced: off the trio thread, which would wait for a disk busy with checkpoints
        await trio.to_thread.run_sync(ctx.runs.put, mf.canonical_bytes(manifest))
        log.info("joined run %s (%s)", run_id, manifest.run.name)
        await self._dial_manifest_bootstrap(list(manifest.network.bootstrap))
        # In the background: a DHT provide is a lookup and a round of ADD_PROVIDER, ~1 s of
        # a testnet node's start that held its first heartbeat; peers find us through the
        # run's other providers meanwhile.
        nursery.start_soon(self.manifests.provide, ctx, run_id)
        from node.training.rounds import TrainingStats

        document = load_document(config.state_dir, run_id, ctx.signer,
                                 list(manifest.network.admins))
        ctx.membership.attach(document)
        ctx.device = config.device  # what was asked ("auto"), until torch says what it is
        ctx.run = RunContext(run_id, manifest, document, TrainingStats())
        rundoc = RunDocSync(first_peers=[self.manifests.source] if self.manifests.source
                            else [])
        services: list[Service] = [
            HeartbeatService([run_id], publish=True, interval_s=config.heartbeat_s),
            rundoc,
            PeerRecordService(config.reprovide_s),
            RememberPeers(config.state_dir, run_id, ctx.peer_id, self._peers_to_remember),
        ]
        if config.train:
            from node.training.build import check_swarm_algorithm

            check_swarm_algorithm(manifest, config.attack)  # a clear error, not an idle node
        if config.train and manifest.pipeline is None:  # a stage host pulls no checkpoint
            from node.checkpoints.service import CheckpointService
            from node.checkpoints.vet import CheckpointVet

            # Pulls the newest checkpoint before it reports ready; needs no torch, which
            # is still loading in the background (node/preload.py), until it checks the
            # pulled checkpoint's claim of progress with the trainer (built meanwhile).
            self._checkpoints = CheckpointService(
                publish=rundoc.publish, synced=rundoc.first_sync,
                still_loading=preload.pending,
                members_heard=lambda: any(p != ctx.peer_id
                                          for p in ctx.membership.live_nodes()),
                vet=CheckpointVet(ctx, lambda: self._prebuilt.result()))
            services.append(self._checkpoints)
            # Built once torch is in, but not while a checkpoint downloads; the trainer
            # resumes it from the checkpoint once that is in (_trainer_services).
            from node.training.build import Prebuild, build_training

            checkpoints = self._checkpoints

            def build() -> Any:
                # testnets only: a stand-in at a measured device's step time
                from node.training.timed import build_timed, from_env

                if (stand_in := from_env()) is not None:
                    return build_timed(manifest, ctx.peer_id, *stand_in)
                return build_training(manifest, ctx.peer_id, resolve_device_name(config.device),
                                      config.data, attack=config.attack)

            self._prebuilt = Prebuild(build, hold=lambda: checkpoints.downloading)
        return services

    async def _trainer_services(self) -> list[Service]:
        """Once torch is loaded: the device, averaging (and SybilWall's history gossip), the
        trainer. Every torch-importing module is imported only after `preload.ready()`: an
        import on the trio thread would block it on the background import's lock."""
        ctx, config = self.ctx, self.config
        if config.train and not preload.statistics()["done"]:
            ctx.phases.enter("loading torch")
        if config.train:
            try:
                await preload.ready()
            except Exception as e:  # a broken torch install: exit 9 with the reason
                raise TrainingFailed(f"training stopped: cannot import torch: "
                                     f"{type(e).__name__}: {e}") from e
        # `auto` asks torch; without training, torch loads only for this (in a worker).
        ctx.device = await trio.to_thread.run_sync(resolve_device_name, config.device)
        if not config.train:
            return []
        if ctx.the_run().manifest.pipeline is not None:
            from node.pipe.service import PipelineService

            run = ctx.the_run()
            return [PipelineService(run.manifest, run.run_id, run.progress, config.data,
                                    device=ctx.device,
                                    path_of=lambda peer: self.paths.paths().get(peer, "direct"))]
        from node.averaging import adapt
        from node.averaging.history_gossip import HistoryGossip
        from node.averaging.service import PROTOCOL_ID as av_protocol
        from node.averaging.service import Averager
        from node.training.build import POISON_ROUNDS, neighbours, resume_newest
        from node.training.service import TrainingService

        run, checkpoints = ctx.the_run(), self._checkpoints
        assert checkpoints is not None
        m = run.manifest
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
                open_stream=ctx.open_stream, path_of=ctx.path_of,
                all_reduce=m.outer.algorithm == "diloco", lane_dialable=ctx.lane_dialable,
                relay_limit=int(m.network.relay_exchange_mb * 1e6),
                rtt_of=lambda peer: (ms / 1000 if (ms := self.paths.rtt_ms.get(peer))
                                     else None))
            self.webrtc.set_handler(av_protocol, averager.handle)
            services.append(averager)
        prebuilt = self._prebuilt
        assert prebuilt is not None

        def build() -> tuple[Any, Any, int]:
            trainer, outer, inner_steps = prebuilt.result()
            resume_newest(m, trainer, outer, ctx.checkpoints, stats=run.progress)
            return trainer, outer, inner_steps

        services.append(TrainingService(
            build,
            exchange=(averager.allreduce if m.outer.algorithm == "diloco" else averager.exchange)
            if averager else None,
            checkpoint_every=m.checkpoint.every_steps, on_snapshot=checkpoints.save,
            poison_steps=POISON_ROUNDS * m.outer.inner_steps if config.attack else None,
            stats=run.progress,
            expected_exchange_s=averager.expected_exchange_s if averager else None))
        return services

    # -- start and stop -----------------------------------------------------------------------

    async def _stop_on_signals(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s; shutting down", signal.Signals(signum).name)
                self.ctx.phases.enter("stopping")
                self.stop_signal = signum
                scope.cancel()
                return

    def _write_addrs(self) -> None:
        atomic_write(self.config.state_dir / ADDRS_FILE, json.dumps(
            {"peer_id": self.peer_id, "addrs": self.ctx.substrate.addrs(), "pid": os.getpid()}
        ).encode(), durable=False)

    def _bootstrap_sources(self) -> list[Source]:
        """In order: the CLI's (flag, ticket, environment or config file), remembered peers,
        the manifest's when held here, mDNS (node/discovery/sources.py)."""
        config = self.config
        sources = [Source(config.bootstrap_from, list(config.bootstrap))]
        if config.run_id is None:
            return sources  # a bootstrap node is an entry point: it needs no other
        known = remembered.addresses(remembered.load(config.state_dir, config.run_id))
        sources.append(Source("remembered peers", known))
        if (local := self.ctx.runs.get(config.run_id)) is not None:
            manifest = mf.parse_canonical(local, expected_run_id=config.run_id)
            sources.append(Source("the manifest's network.bootstrap",
                                  list(manifest.network.bootstrap)))
        if self.mdns is not None:
            mdns = self.mdns
            sources.append(Source("mDNS", lookup=lambda: mdns.wait_for_peers(config.mdns_wait_s)))
        return sources

    async def _connect_bootstrap(self) -> bool:
        """Dial the first bootstrap source that answers; True if a peer was reached."""
        config, substrate = self.config, self.ctx.substrate
        sources = self._bootstrap_sources()
        named = [s for s in sources if s.addrs]
        if not named and (config.run_id is None or (self.mdns is None
                                                    and self.ctx.runs.get(config.run_id))):
            return False  # an entry point, or the run's first node: others will dial us
        self.ctx.phases.enter("connecting")
        outcome = await connect_first(substrate, sources)
        if outcome.reached:
            self.bootstrap_reached = outcome.reached
            return True
        run_id = config.run_id
        if run_id is not None and self.ctx.runs.get(run_id) is not None and (
                not config.bootstrap):
            log.warning("no bootstrap peer reached; this node holds run %s and starts alone "
                        "(peers that know it will dial in)", run_id)
            return False
        if not outcome.failures:
            mdns = (f"; no peer answered on mDNS within {config.mdns_wait_s:g} s"
                    if self.mdns is not None else "")
            raise NoBootstrapPeer(f"no bootstrap peer is known for run {run_id}{mdns}: "
                                  + how_to_give_one(run_id))
        raise BootstrapUnreachable(
            "could not reach any bootstrap peer:\n  " + "\n  ".join(outcome.failures)
            + "\nCheck the address (and that the peer is up), or pass another --bootstrap.")

    async def _dial_manifest_bootstrap(self, addrs: list[str]) -> None:
        """The run's own entry points (manifest `network.bootstrap`), once the manifest is
        known: dialed now where not yet connected, then kept by the redialer."""
        if not addrs:
            return
        self.redialer.add_bootstrap(addrs)
        connected = {p.to_base58() for p in self.ctx.substrate.connected_peers()}
        todo = [a for a in addrs if a.rsplit("/p2p/", 1)[-1] not in connected]
        if todo:
            outcome = await connect_first(self.ctx.substrate,
                                          [Source("the manifest's network.bootstrap", todo)],
                                          dial_timeout_s=5.0)
            if not outcome.reached:
                log.warning("none of the manifest's bootstrap peers answered; the redialer "
                            "keeps trying")

    def _peers_to_remember(self) -> dict[str, list[str]]:
        """The run's members (run document and heartbeats) and the bootstrap peers that
        answered: where the next `node join <run-id>` of this state directory starts."""
        out: dict[str, list[str]] = {}
        for addr in self.bootstrap_reached:
            peer = addr.rsplit("/p2p/", 1)[-1]
            out.setdefault(peer, []).append(addr)
        out.update(self.ctx.membership.addresses())
        return out

    def _rundoc_stamps(self) -> dict[str, list]:
        return stamps(self.ctx.run.document) if self.ctx.run else {}

    # -- status ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The node's identity and phase, the substrate's counters, then one entry per
        service: `{service.name: service.statistics()}`."""
        ctx, substrate = self.ctx, self.ctx.substrate
        dht = substrate.dht
        run = ctx.run
        return {
            "peer_id": self.peer_id,
            "role": self.config.role,
            "phase": ctx.phases.current,
            "phase_times": ctx.phases.times,
            "started_unix": round(self.started_unix, 3),
            "uptime_s": round(time.monotonic() - ctx.phases.started, 1),
            "run": self.config.run_id,
            "run_name": run.manifest.run.name if run else None,
            "addrs": substrate.addrs(),
            "announce": self.config.announce,
            "device": ctx.device if run else self.config.device,
            "attack": self.config.attack,
            "torch_import": preload.statistics(),
            "p2p": {
                "connections": len(substrate.connected_peers()),
                "dht_routing_table": dht.routing_table_size() if dht else 0,
                "dht_operations": dht.statistics() if dht else {},
                "handler_errors": substrate.handler_errors,
                "inbound": substrate.slots.statistics(),
                "host_restarts": substrate.stats.restarts,
                "gossip": vars(ctx.publisher.stats),
            },
            **{s.name: s.statistics() for s in self.services},
        }


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


async def run_node(config: NodeConfig) -> int | None:
    """Run until stopped; returns the signal that stopped the node (None: it just ended)."""
    node = Node(config)
    await node.run()
    return node.stop_signal
