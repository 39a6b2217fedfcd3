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

from node import roles
from node.checkpoints.exchange import CheckpointServer
from node.checkpoints.store import CheckpointStore
from node.config import NodeConfig
from node.discovery.entry import EntryPoints
from node.discovery.mdns import MdnsService
from node.errors import (
    StateDirError,
    TrainingFailed,
)
from node.files import atomic_write
from node.guard.service import GuardService, classify
from node.membership.records import VALIDATORS
from node.membership.redial import Redialer
from node.membership.view import Membership
from node.metrics.service import MetricsService
from node.process import preload
from node.process.memory import tune_malloc
from node.reach.paths import PathService
from node.reach.punch import HolePunchService
from node.reach.relays import RelayService
from node.reach.service import ReachabilityService
from node.roles import resolve_device_name
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
        redialer = Redialer(substrate, config.bootstrap, self.ctx.membership.addresses,
                            want_peers=config.want_peers,
                            # a bootstrap is where everybody meets: it trims nobody
                            max_peers=config.max_peers if config.run_id else 1 << 30,
                            live=self.ctx.membership.live_peers)
        mdns = MdnsService(signer.peer_id, config.listen) if config.mdns else None
        self.entry = EntryPoints(self.ctx, redialer, mdns)
        self._prep: roles.TrainerPrep | None = None  # a data-parallel trainer's, at the join
        self.metrics = MetricsService(self.status, config.metrics,
                                      fallback=config.metrics_fallback,
                                      progress_s=config.progress_s)
        reach = ReachabilityService(upnp=config.upnp)
        punch = HolePunchService(reach.verdict)
        # WebRTC data channels to peers reached only through a relay (node/webrtc/); path
        # kinds labelled by the services that open connections of their own kind (the
        # punch's). Both go behind the context's one door to every peer.
        self.webrtc = WebRtcService(reach.verdict)
        self.paths = PathService([punch.label], upnp_mapped=reach.mapped)
        self.ctx.transports.attach(channels=self.webrtc, kinds=self.paths,
                                   lane_dialable=reach.lane_dialable)
        checkpoint_server = CheckpointServer(self.ctx.checkpoints)
        self.services: list[Service] = [
            ControlService({"status": self.status, "ping": lambda: "pong",
                            "rundoc": self._rundoc_stamps,
                            "api_status": self.metrics.api_status}),
            self.metrics,
            GuardService(gate),
            self.manifests,
            checkpoint_server,
            redialer,
            reach,
            RelayService(reach.verdict),
            *([punch] if config.punch else []),
            self.webrtc,
            self.paths,
            *([mdns] if mdns else []),
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
            if self._prep is not None:
                self._prep.prebuilt.cancel()

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        ctx = self.ctx
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_on_signals, nursery.cancel_scope)
            if self.config.run_id is not None and self.config.train:
                preload.start()  # torch loads while the node joins (node/process/preload.py)
            await nursery.start(ctx.substrate.serve)
            await nursery.start(ctx.publisher.run)
            for service in self.services:
                await nursery.start(service.run, ctx)
            self._write_addrs()
            log.info("peer %s listening on %s", self.peer_id, " ".join(ctx.substrate.addrs()))
            if await self.entry.connect():
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
                more = roles.bootstrap_services(self.config, runs)
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
        await self.entry.dial_manifest_bootstrap(list(manifest.network.bootstrap))
        # In the background: a DHT provide is a lookup and a round of ADD_PROVIDER, ~1 s of
        # a testnet node's start that held its first heartbeat; peers find us through the
        # run's other providers meanwhile. Re-provided only while this node is in the
        # epoch's provider sample (node/run/providers.py): ~20 of N, not all.
        nursery.start_soon(self.manifests.provide_sampled, ctx, run_id)
        from node.training.rounds import TrainingStats

        document = load_document(config.state_dir, run_id, ctx.signer,
                                 list(manifest.network.admins))
        ctx.membership.attach(document)
        ctx.device = config.device  # what was asked ("auto"), until torch says what it is
        ctx.run = RunContext(run_id, manifest, document, TrainingStats())
        rundoc = RunDocSync(first_peers=[self.manifests.source] if self.manifests.source
                            else [], gc_horizon_s=config.rundoc_horizon_s)
        services = roles.member_services(ctx, rundoc, self.entry.to_remember)
        if config.train:
            from node.training.build import check_swarm_algorithm

            check_swarm_algorithm(manifest, config.attack)  # a clear error, not an idle node
        if config.train and manifest.pipeline is None:  # a stage host pulls no checkpoint
            self._prep = roles.prepare_trainer(ctx, rundoc)
            services.append(self._prep.checkpoints)
        return services

    async def _trainer_services(self) -> list[Service]:
        """Once torch is loaded (`preload.ready()`) and the device known: node/roles.py."""
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
        return (roles.trainer_services(ctx, self._prep, self.entry.redialer) if config.train
                else [])

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


async def run_node(config: NodeConfig) -> int | None:
    """Run until stopped; returns the signal that stopped the node (None: it just ended)."""
    node = Node(config)
    await node.run()
    return node.stop_signal
