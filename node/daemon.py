"""The daemon: one trio loop composing the p2p substrate, run identity, membership and control.

`Node.run()` goes through phases that `node status` shows:

    starting -> connecting (bootstrap peers) -> discovering (run providers in the DHT,
    manifest fetched and verified) -> running (announced: DHT provider + heartbeats)

A bootstrap node (no run-id) skips discovery: it serves and provides the runs in its store.
Everything the node starts lives in one nursery; cancelling it (SIGINT/SIGTERM) stops all.
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
from libp2p.peer.id import ID

from node import ckpt_sync, manifest_service
from node.checkpoints import CheckpointStore
from node.config import NodeConfig
from node.control import serve_control
from node.data_check import check_training_data
from node.dht_records import VALIDATORS
from node.errors import (
    BootstrapUnreachable,
    ManifestRejected,
    NodeError,
    RunNotFound,
    StateDirError,
    TrainingFailed,
)
from node.memory import tune_malloc
from node.peering import Redialer
from node.rundoc_sync import RunDocSync
from node.rundoc_sync import topic as rundoc_topic
from node.runstore import RunStore, atomic_write
from node.training import TrainingService
from p2p.host import DialError, Substrate
from p2p.identity import IdentityError, load_or_create_identity
from p2p.peerbook import PeerBook
from p2p.pubsub import PacedPublisher
from protocols import heartbeat as hb
from protocols import keys, records
from protocols import manifest as mf
from protocols.errors import RemoteProtocolError
from protocols.rundoc import checkpoint_index, ckpt_key

log = logging.getLogger("node")

ADDRS_FILE = "addrs.json"
PROVIDER_LOOKUP_S = 3.0  # joining: how long the DHT may take to name checkpoint providers


SWITCH_INTERVAL_S = 0.0002


def run_key(run_id: str) -> str:
    return f"run/{run_id}"


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.started = time.monotonic()
        self.started_unix = time.time()
        self.phase_times: dict[str, float] = {}  # phase -> s after start it first began
        self.phase = "starting"
        self.first_peer_after_s: float | None = None
        self.manifest: mf.Manifest | None = None
        self.store = RunStore(config.state_dir)
        self.checkpoints = CheckpointStore(config.state_dir)
        self.peers = PeerBook(ttl=config.peer_ttl_s)
        self.device = config.device
        self.rejected_heartbeats = 0
        self._record_loop_started = False
        self.training: TrainingService | None = None
        self.rundoc: RunDocSync | None = None
        self.averager: Any = None  # node.averaging.Averager once training starts
        self.history: Any = None  # node.history_gossip.HistoryGossip (SybilWall runs)
        self._hb_seq = 0
        self.stop_signal: int | None = None  # SIGINT/SIGTERM that stopped us (cli: exit code)
        try:
            config.state_dir.mkdir(parents=True, exist_ok=True)
            key_pair = load_or_create_identity(config.state_dir)
        except (OSError, IdentityError) as e:
            raise StateDirError(f"cannot use state directory {config.state_dir}: {e}") from e
        self.signer = keys.Signer(key_pair.private_key.to_bytes()[:32])
        self.substrate = Substrate(key_pair, config.listen, dht_protocol_validators=VALIDATORS)
        self.peer_id = self.substrate.peer_id.to_base58()
        self.publisher = PacedPublisher(self.substrate)
        manifest_service.install(self.substrate, self.store)
        ckpt_sync.install(self.substrate, self.checkpoints)
        self.download: dict[str, Any] | None = None
        self.redialer = Redialer(
            self.substrate, config.bootstrap,
            lambda: {p: i.get("addrs") for p, i in self.rundoc.members(ttl_s=600).items()}
            if self.rundoc else {})

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        # timed, so `node status` (and the join benchmark) can tell where a join spends time
        self._phase = value
        self.phase_times.setdefault(value, round(time.monotonic() - self.started, 3))

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        tune_malloc()
        # The trainer thread holds the GIL between torch ops. With small models (many short
        # ops) the trio thread then waits up to the switch interval (5 ms by default) after
        # every socket call, and an exchange of hundreds of them takes seconds (measured:
        # every exchange of a 7-node digits testnet timed out, heartbeats arrived ~9 s late).
        # A forced switch costs nothing while trio sleeps in epoll, where it holds no GIL.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_on_signals, nursery.cancel_scope)
            await nursery.start(self.substrate.serve)
            await nursery.start(self.publisher.run)
            await nursery.start(serve_control, self.config.state_dir,
                                {"status": self.status, "ping": lambda: "pong",
                                 "rundoc": lambda: self.rundoc.stamps() if self.rundoc else {}})
            self._write_addrs()
            log.info("peer %s listening on %s", self.peer_id, " ".join(self.substrate.addrs()))
            await self._connect_bootstrap()
            await nursery.start(self.redialer.run)
            if self.config.run_id is None:
                await self._serve_as_bootstrap(nursery)
            else:
                await self._join(nursery, self.config.run_id)
            self.phase = "running"
            task_status.started()

    async def _stop_on_signals(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s; shutting down", signal.Signals(signum).name)
                self.phase = "stopping"
                self.stop_signal = signum
                scope.cancel()
                return

    def _write_addrs(self) -> None:
        atomic_write(self.config.state_dir / ADDRS_FILE, json.dumps(
            {"peer_id": self.peer_id, "addrs": self.substrate.addrs(), "pid": os.getpid()}
        ).encode())

    async def _connect_bootstrap(self) -> None:
        if not self.config.bootstrap:
            return
        self.phase = "connecting"
        failures: list[str] = []
        async with trio.open_nursery() as nursery:
            async def dial(addr: str) -> None:
                try:
                    await self.substrate.connect(addr)
                except DialError as e:
                    failures.append(str(e))

            for addr in self.config.bootstrap:
                nursery.start_soon(dial, addr)
        if len(failures) == len(self.config.bootstrap):
            raise BootstrapUnreachable(
                "could not reach any bootstrap peer:\n  " + "\n  ".join(failures)
                + "\nCheck the address (and that the peer is up), or pass another --bootstrap.")
        for failure in failures:
            log.warning("bootstrap: %s", failure)
        assert self.substrate.dht is not None
        await self.substrate.dht.bootstrap()

    # -- bootstrap role -----------------------------------------------------------------

    async def _serve_as_bootstrap(self, nursery: trio.Nursery) -> None:
        """Serve and provide every run in the store; relay their gossip."""
        for run_id in self.store.run_ids():
            await self._announce(nursery, run_id)
            log.info("serving run %s", run_id)

    # -- node role ------------------------------------------------------------------------

    async def _join(self, nursery: trio.Nursery, run_id: str) -> None:
        self.phase = "discovering"
        self.manifest = await self._resolve_manifest(run_id)
        if self.config.train:  # data that cannot train is refused before we announce
            await trio.to_thread.run_sync(check_training_data, self.manifest, self.config.data)
        self.store.put(mf.canonical_bytes(self.manifest))
        log.info("joined run %s (%s)", run_id, self.manifest.run.name)
        nursery.start_soon(self._heartbeat_loop, run_id)
        await self._announce(nursery, run_id)
        self.rundoc = RunDocSync(
            self.substrate, self.publisher, run_id, self.signer,
            list(self.manifest.network.admins), self.config.state_dir,
            own_entries=lambda: {"addrs": self.substrate.addrs(), "role": "node",
                                 "device": self.device, "stats": self.heartbeat_stats()},
            live_peers=lambda: [e.peer_id for e in self.peers.live(time.monotonic())])
        await nursery.start(self.rundoc.run)
        # torch takes a second or more to import: resolve the device after we are visible.
        self.device = await trio.to_thread.run_sync(_resolve_device, self.config.device)
        if self.config.train:
            await self._start_training(nursery)

    async def _start_training(self, nursery: trio.Nursery) -> None:
        from node.averaging import Averager  # imports torch: only nodes that train pay it
        from node.run_config import build_training, check_swarm_algorithm, neighbours

        manifest, device = self.manifest, self.device
        assert manifest is not None
        run_id = self.config.run_id
        assert run_id is not None
        # a clear error and exit, not a silent idle node
        check_swarm_algorithm(manifest, self.config.attack)
        self._nursery = nursery
        latest = self.checkpoints.latest(run_id) or await self._fetch_swarm_checkpoint(run_id)
        # Whatever we hold, written before a restart or just pulled, the next joiner can
        # fetch from us too (until retention drops it: _unannounce).
        for cid, _ in self.checkpoints.list(run_id):
            if self.substrate.dht is not None:
                nursery.start_soon(self.substrate.dht.provide, f"ckpt/{cid}")
        if manifest.outer.algorithm != "none":
            self.averager = Averager(
                self.substrate, run_id, self.peer_id,
                members=lambda: [e.peer_id for e in self.peers.live(time.monotonic())
                                 if e.info.get("role") == "node"],
                codecs=[manifest.outer.codec, "fp32"], group_size=manifest.outer.group_size,
                step_time=self._step_time, inner_steps=manifest.outer.inner_steps,
                neighbours=neighbours(manifest))
        self.training = TrainingService(
            lambda: build_training(manifest, self.peer_id, device, self.config.data,
                                   resume=(self.checkpoints, latest) if latest else None,
                                   attack=self.config.attack),
            exchange=self._exchange if self.averager else None,
            checkpoint_every=manifest.checkpoint.every_steps, on_snapshot=self._save_checkpoint,
            replay_to_align=self.config.attack is not None,
        )
        if self.averager is not None:
            self.averager.stats = self.training.stats
        if manifest.aggregate.method == "sybilwall" and manifest.outer.algorithm == "gossip":
            from node.history_gossip import HistoryGossip

            self.history = HistoryGossip(self.substrate, run_id, self.signer,
                                         lambda: self.training.outer if self.training else None)
        nursery.start_soon(self._supervise_training)
        nursery.start_soon(self._time_first_step)

    async def _time_first_step(self) -> None:
        """Note when the first step completes: the end of a join (docs/benchmarks.md)."""
        t = self.training
        while t is not None and t.stats.compute_s == 0 and t.stats.phase != "failed":
            await trio.sleep(0.02)
        if t is not None and t.stats.compute_s > 0:
            self.phase_times.setdefault("first step",
                                        round(time.monotonic() - self.started, 3))

    async def _exchange(self, r: int, snapshot: Any) -> Any:
        """A round's exchange, then (SybilWall) history gossip to the same neighbours."""
        assert self.averager is not None
        outcome = await self.averager.exchange(r, snapshot)
        if self.history is not None and outcome.peers:
            self._nursery.start_soon(self.history.after_round, list(outcome.peers))
        return outcome

    async def _fetch_swarm_checkpoint(self, run_id: str, sync_wait_s: float = 5.0) -> str | None:
        """Joining mid-run: the newest checkpoint in the run document, from its providers."""
        assert self.rundoc is not None
        self.phase = "syncing state"
        with trio.move_on_after(sync_wait_s):  # bounded: a first node has nobody to sync with
            while self.rundoc.syncs == 0:
                await trio.sleep(0.1)
        entries = checkpoint_index(self.rundoc.doc)
        if not entries:
            self.phase = "running"
            return None
        step, cid, writer = entries[-1]
        dht = self.substrate.dht
        assert dht is not None
        self.phase = "finding providers"
        # Bounded: the writer and our connected peers are asked anyway (below), and a
        # lookup that meets a dead peer would otherwise wait out the whole query timeout.
        found = await dht.find_providers(f"ckpt/{cid}", timeout=PROVIDER_LOOKUP_S)
        providers = [p.peer_id for p in found]
        for extra in [ID.from_base58(writer), *self.substrate.connected_peers()]:
            if extra not in providers and extra != self.substrate.peer_id:
                providers.append(extra)
        self.phase = "downloading checkpoint"
        self.download = {"cid": cid, "step": step, "done": 0, "total": 0,
                         "providers": len(providers)}

        def progress(done: int, total: int) -> None:
            assert self.download is not None
            self.download.update(done=done, total=total)

        try:
            pulled = await ckpt_sync.pull(self.substrate, providers, cid, self.checkpoints,
                                          progress=progress)
        except NodeError as e:
            log.warning("could not fetch checkpoint %s (%s); starting from scratch", cid, e)
            return None
        finally:
            self.phase = "running"
        # asked != served: in a NoLoCo swarm each node's checkpoint is its own
        self.download["served_by"] = len(pulled.bytes_by_peer)
        log.info("fetched checkpoint %s (step %d) from %d of %d providers asked", cid, step,
                 len(pulled.bytes_by_peer), len(providers))
        return cid

    async def _save_checkpoint(self, snapshot: Any) -> None:
        """Write the snapshot (in a worker thread), keep the newest few, announce it."""
        manifest, run_id = self.manifest, self.config.run_id
        assert manifest is not None and run_id is not None and self.training is not None
        store = self.checkpoints

        def write() -> tuple[str, set[str]]:
            cid = store.save(run_id, snapshot.step, snapshot.tensors,
                             {"peer": self.peer_id})
            before = {c for c, _ in store.list(run_id)}
            store.retain(run_id, manifest.checkpoint.keep)
            return cid, before - {c for c, _ in store.list(run_id)}

        try:
            cid, dropped = await trio.to_thread.run_sync(write)
        except NodeError as e:  # a full disk costs this checkpoint, never the node
            log.error("%s", e)
            return
        self.training.stats.checkpoints += 1
        self.training.stats.last_checkpoint = cid
        log.info("checkpoint %s at step %d", cid, snapshot.step)
        self._unannounce(run_id, dropped)
        if self.rundoc is not None:
            now = time.time_ns() // 1_000_000
            m = store.manifest(cid)
            delta = self.rundoc.doc.set(ckpt_key(self.peer_id, cid),
                                        {"hash": cid, "step": m.step, "size": m.size}, now)
            self.publisher.publish_nowait(rundoc_topic(run_id), delta)
        if self.substrate.dht is not None:
            await self.substrate.dht.provide(f"ckpt/{cid}")

    def _unannounce(self, run_id: str, dropped: set[str]) -> None:
        """Retention deleted these checkpoints: stop providing them, and delete our run
        document entries for them (so the index stays as small as what is held)."""
        for cid in dropped:
            if self.substrate.dht is not None:
                self.substrate.dht.stop_providing(f"ckpt/{cid}")
            key = ckpt_key(self.peer_id, cid)
            if self.rundoc is not None and self.rundoc.doc.get(key) is not None:
                delta = self.rundoc.doc.delete(key, time.time_ns() // 1_000_000)
                self.publisher.publish_nowait(rundoc_topic(run_id), delta)

    def _step_time(self) -> float:
        t = self.training.stats if self.training else None
        return t.compute_s / t.step if t and t.step else 0.2

    async def _supervise_training(self) -> None:
        assert self.training is not None
        try:
            await self.training.run()
        except Exception as e:  # a node asked to train that cannot: stop it, say why
            log.error("training stopped: %s: %s", type(e).__name__, e)
            raise TrainingFailed(f"training stopped: {type(e).__name__}: {e}") from e

    async def _resolve_manifest(self, run_id: str) -> mf.Manifest:
        local = self.store.get(run_id)
        if local is not None:
            return mf.parse_canonical(local, expected_run_id=run_id)
        dht = self.substrate.dht
        assert dht is not None
        tried: set[ID] = set()
        reasons: dict[str, str] = {}
        rejected = False
        delay = 0.2
        with trio.move_on_after(self.config.join_timeout_s):
            while True:
                providers = [p.peer_id for p in await dht.find_providers(run_key(run_id))]
                # Peers we are connected to are asked too: a bootstrap serving the run may
                # answer before its provider record has spread.
                candidates = [p for p in [*providers, *self.substrate.connected_peers()]
                              if p != self.substrate.peer_id and p not in tried]
                for peer in candidates:
                    tried.add(peer)
                    try:
                        return await manifest_service.fetch_manifest(self.substrate, peer, run_id)
                    except mf.ManifestError as e:
                        rejected = True
                        reasons[peer.to_base58()] = f"served a bad manifest: {e}"
                        log.warning("peer %s served a bad manifest for %s: %s", peer, run_id, e)
                    except (LookupError, RemoteProtocolError) as e:
                        reasons[peer.to_base58()] = str(e)
                    except Exception as e:
                        reasons[peer.to_base58()] = f"no answer ({type(e).__name__})"
                await trio.sleep(delay)  # retry: providers may appear as the run starts
                delay = min(delay * 2, 2.0)
                if tried and len(tried) >= len(self.substrate.connected_peers()) + len(providers):
                    tried.clear()  # ask everyone again: they may have joined the run since
        detail = "".join(f"\n  {p}: {r}" for p, r in sorted(reasons.items())) or \
            "\n  (no peer in the DHT provides it)"
        error = ManifestRejected if rejected else RunNotFound
        raise error(f"could not get the manifest of run {run_id} within "
                    f"{self.config.join_timeout_s:g} s:{detail}\n"
                    "Check the run-id, and that a node holding the run is reachable.")

    async def _announce(self, nursery: trio.Nursery, run_id: str) -> None:
        dht = self.substrate.dht
        assert dht is not None
        dht.reprovide_interval = self.config.reprovide_s
        await dht.provide(run_key(run_id))
        nursery.start_soon(self._listen_heartbeats, run_id)
        if not self._record_loop_started:
            self._record_loop_started = True
            nursery.start_soon(self._peer_record_loop)

    async def _peer_record_loop(self) -> None:
        """Keep our signed peer record (addresses, runs served) fresh in the DHT."""
        while True:
            await self.substrate.ready.wait()
            dht = self.substrate.dht
            assert dht is not None
            runs = [self.config.run_id] if self.config.run_id else self.store.run_ids()
            value = records.encode(self.signer, time.time_ns() // 1_000_000,
                                   self.substrate.addrs(), runs)
            try:
                await dht.put(records.peer_key(self.peer_id), value)
            except Exception as e:  # e.g. nobody to store it on yet; try again later
                log.debug("peer record put failed: %r", e)
            await trio.sleep(self.config.reprovide_s)

    async def _heartbeat_loop(self, run_id: str) -> None:
        topic = hb.topic(run_id)
        while True:
            self._hb_seq += 1
            beat = hb.Heartbeat(self.peer_id, self._hb_seq, tuple(self.substrate.addrs()),
                                role="node", device=self.device, stats=self.heartbeat_stats())
            self.publisher.publish_nowait(topic, beat.encode())
            await trio.sleep(self.config.heartbeat_s)

    def heartbeat_stats(self) -> dict[str, Any]:
        """Numbers gossiped to the swarm with each heartbeat."""
        stats: dict[str, Any] = {"uptime": round(time.monotonic() - self.started, 1)}
        if self.training is not None:
            t = self.training.stats
            stats.update(step=t.step, loss=t.loss, val=t.val_loss)
            stats = {k: v for k, v in stats.items() if v is not None}
        return stats

    async def _listen_heartbeats(self, run_id: str) -> None:
        topic = hb.topic(run_id)
        while True:  # re-subscribe if the host restarts
            await self.substrate.ready.wait()
            pubsub = self.substrate.pubsub
            assert pubsub is not None
            subscription = await pubsub.subscribe(topic)
            try:
                while True:
                    msg = await subscription.get()
                    sender = ID(msg.from_id).to_base58()
                    if sender == self.peer_id:
                        continue
                    try:
                        beat = hb.decode(msg.data, sender)
                    except RemoteProtocolError as e:
                        self.rejected_heartbeats += 1
                        log.info("rejected heartbeat from %s: %s", sender, e)
                        continue
                    self._on_heartbeat(beat)
            except Exception as e:
                log.warning("heartbeat subscription ended (%r); re-subscribing", e)
                await trio.sleep(0.5)

    def _on_heartbeat(self, beat: hb.Heartbeat) -> None:
        now = time.monotonic()
        if self.first_peer_after_s is None and beat.role == "node":
            self.first_peer_after_s = now - self.started
            log.info("first peer seen after %.2f s: %s", self.first_peer_after_s, beat.peer)
        elif self.peers.get(beat.peer) is None:
            log.info("peer joined: %s", beat.peer)
        self.peers.seen(beat.peer, now, list(beat.addrs),
                        {"role": beat.role, "device": beat.device, "stats": beat.stats})
        step = beat.stats.get("step")
        if self.training is not None and isinstance(step, int):
            self.training.swarm_step = max(self.training.swarm_step, step)

    # -- status -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        dht = self.substrate.dht
        live = [e for e in self.peers.live(now) if e.info.get("role") == "node"]
        return {
            "peer_id": self.peer_id,
            "role": self.config.role,
            "phase": self.phase,
            "phase_times": self.phase_times,
            "started_unix": round(self.started_unix, 3),
            "run": self.config.run_id,
            "run_name": self.manifest.run.name if self.manifest else None,
            "runs_served": self.store.run_ids(),
            "addrs": self.substrate.addrs(),
            "device": self.device,
            "uptime_s": round(now - self.started, 1),
            "first_peer_after_s": self.first_peer_after_s,
            "peers": [{"peer_id": e.peer_id, "last_seen_s": round(now - e.last_seen, 1),
                       "addrs": e.addrs, **e.info} for e in live],
            "connections": len(self.substrate.connected_peers()),
            "redial": self.redialer.statistics(),
            "dht_routing_table": dht.routing_table_size() if dht else 0,
            "handler_errors": self.substrate.stats.handler_errors,
            "host_restarts": self.substrate.stats.restarts,
            "rejected_heartbeats": self.rejected_heartbeats,
            "gossip": vars(self.publisher.stats),
            "training": self.training.stats.snapshot() if self.training else None,
            "download": self.download,
            "attack": self.config.attack,
            "history_gossip": self.history.status() if self.history else None,
            "members": self._members(),
            "run_document": self.rundoc.statistics() if self.rundoc else None,
        }

    def _members(self) -> list[dict[str, Any]]:
        """Membership as the run document has it (own entries signed by each peer)."""
        if self.rundoc is None:
            return []
        now = time.time_ns() // 1_000_000
        members = self.rundoc.members(ttl_s=3 * self.rundoc.announce_s + 2)
        return [{"peer_id": p, "last_seen_s": round((now - info.pop("last_seen_ms")) / 1000, 1),
                 **info} for p, info in sorted(members.items()) if p != self.peer_id]


def _resolve_device(device: str) -> str:
    """`auto` picks CUDA when torch sees a GPU. Imported lazily: torch costs ~1 s to import."""
    if device == "cpu":
        return "cpu"
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NodeError(f"--device {device}: torch sees no CUDA device on this machine")
    return device


async def run_node(config: NodeConfig) -> int | None:
    """Run until stopped; returns the signal that stopped the node (None: it just ended)."""
    node = Node(config)
    await node.run()
    return node.stop_signal
