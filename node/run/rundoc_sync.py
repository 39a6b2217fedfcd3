"""Keeps this node's replica of the run document (protocols/rundoc.py) in sync.

* Own entries (`peer/<me>/info`: addrs, role, device, stats in one value, and
  `peer/<me>/last_seen`, the stamp that lists us as a member) are rewritten every
  `heartbeat_interval_s(view size, announce_s, announce_target_per_s)` (2 s in a small
  run, N / target in a run of N: each node then receives about `announce_target_per_s`
  announces a second however large the run, protocols/heartbeat.py) and gossiped as one
  batched delta on `/peertrain/<run-id>/meta/1`; gossip is lossy, so re-announcing is what
  makes it reliable.
* Anti-entropy over `/peertrain/meta/1.0.0`: when a peer first appears and then every
  `anti_entropy_s` with a random live peer. One round trip each way:
      initiator -> meta.summary {summary}
      responder -> meta.delta   {delta: what the initiator lacks, summary: responder's}
      initiator -> meta.delta   {delta: what the responder lacks}
* The replica is saved atomically in the state directory every `persist_s` and at exit,
  and reloaded (every entry re-verified) on start. Before each save it is compacted
  (`compact`: departed peers' namespaces and old tombstones, protocols/rundoc.py
  `compactable`), but a fresh replica only once it has caught up with a peer: its first
  compaction raises the floor under which unknown keys are refused, and a joiner that
  raised it before holding the swarm's older entries (a stage plan, checkpoint entries)
  would refuse them for good and differ from everybody (docs/rundoc.md).
Merges that reject entries (bad signature, another peer's namespace, not an admin) are
logged with the reason; the document is unchanged by them.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from node.files import atomic_write
from node.service import NodeContext
from node.transport.streams import next_event
from protocols import rundoc
from protocols.errors import ProtocolError, RemoteProtocolError
from protocols.heartbeat import heartbeat_interval_s
from protocols.keys import Signer
from protocols.wire import Envelope, encode_envelope

log = logging.getLogger("node.rundoc")

PROTOCOL_ID = rundoc.PROTOCOL_ID
#: Own entries written one key each before issue 30: 6 entries a peer (with a checkpoint
#: entry) put 10,000 peers with 10%/h churn over the document's 65,536-entry cap. Now they
#: are one `info` entry; a node retires its old ones (tombstones, compacted after the
#: horizon) and readers take either shape (node/membership/view.py).
LEGACY_OWN = ("addrs", "role", "device", "stats")
#: Addresses an `info` entry carries at most (the entry's value is capped at 8 KiB).
MAX_INFO_ADDRS = 32


def own_announce(me: str, info: dict[str, Any], t: int) -> dict[str, Any]:
    """The entries an announce writes: 2 a peer, whatever `info` holds (the simulator
    sizes its document with this)."""
    info = {**info, "addrs": list(info.get("addrs", ()))[:MAX_INFO_ADDRS]}
    return {f"peer/{me}/info": info, f"peer/{me}/last_seen": t}


def retire_legacy(doc: rundoc.RunDocument, me: str, t: int) -> bytes | None:
    """Delete our own pre-`info` entries still in `doc`; the delta to gossip, or None."""
    entries = []
    for name in LEGACY_OWN:
        key = f"peer/{me}/{name}"
        e = doc.entry(key)
        if e is not None and not e.tombstone:
            doc.delete(key, t)
            if (gone := doc.entry(key)) is not None:
                entries.append(gone)
    return doc.encode_delta(entries) if entries else None


MAX_FRAME = rundoc.SYNC_LIMITS.max_envelope_bytes  # a delta is at most 1 MiB


def topic(run_id: str) -> str:
    return f"/peertrain/{run_id}/meta/1"


def now_ms() -> int:
    """Wall-clock milliseconds: the clock of the run document's stamps (protocols/rundoc.py
    reads none, its callers pass `now_ms`). The one definition: membership and checkpoints
    stamp the same document with it."""
    return time.time_ns() // 1_000_000


ANNOUNCE_S = 2.0
#: Announces (5 signed entries each: ~0.7 ms of Ed25519 checks) a node takes per second
#: from the whole run, once the run is large enough to stretch the interval.
ANNOUNCE_TARGET_PER_S = 10.0
RETRY_MIN_S, RETRY_MAX_S = 2.0, 60.0  # anti-entropy with a peer whose last round failed


def load_document(state_dir: Path, run_id: str, signer: Signer,
                  admins: list[str]) -> rundoc.RunDocument:
    """The replica saved by an earlier run of this node (every entry re-verified), or a new
    one. A corrupt file costs a resync from the swarm, never a crash."""
    path = document_path(state_dir, run_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return rundoc.RunDocument(run_id, signer, admins)
    try:
        doc = rundoc.RunDocument.from_bytes(data, run_id, signer, admins)
        log.info("loaded run document: %d entries", len(doc))
        return doc
    except ProtocolError as e:
        log.warning("run document %s unusable (%s); starting empty", path, e)
        return rundoc.RunDocument(run_id, signer, admins)


def document_path(state_dir: Path, run_id: str) -> Path:
    return Path(state_dir) / f"rundoc-{run_id}.bin"


def stamps(doc: rundoc.RunDocument) -> dict[str, list]:
    """key -> [wall_ms, counter, writer] of every entry: enough to tell whether two
    replicas hold the same versions (the partition test and benchmark compare them)."""
    return {e.key: [e.hlc.wall_ms, e.hlc.counter, e.hlc.node] for e in doc.entries()}


class RunDocSync:
    """Gossips our own entries, merges everybody's, repairs losses, persists the replica
    (`ctx.run.document`, shared with the services that write entries of their own)."""

    name = "run_document"
    protocols = (PROTOCOL_ID,)

    def __init__(self, *, announce_s: float = ANNOUNCE_S, anti_entropy_s: float = 10.0,
                 persist_s: float = 10.0, gc_horizon_s: float = 3600.0,
                 first_peers: list[str] | None = None,
                 announce_target_per_s: float = ANNOUNCE_TARGET_PER_S) -> None:
        self.announce_s, self.anti_entropy_s = announce_s, anti_entropy_s
        self.announce_target_per_s = announce_target_per_s
        self.compacted = 0  # entries dropped by gc (departed peers', old tombstones)
        # Set when an anti-entropy answer left us holding everything its peer summarized:
        # from then on a fresh replica may compact (raise its floor).
        self.caught_up = trio.Event()
        self.started = time.monotonic()
        self.persist_s, self.gc_horizon_ms = persist_s, int(gc_horizon_s * 1000)
        self.rejected = 0
        self.syncs = 0
        self._synced_with: set[str] = set()
        self._ctx: NodeContext | None = None
        # the run's size for the announce interval: run() counts the peers heard recently
        self.run_size: Callable[[], int] = lambda: len(self.live_peers())
        self.first_sync = trio.Event()  # a joiner's checkpoint service waits for it
        # Synced with before any heartbeat is heard (the peer that served our manifest):
        # waiting for a heartbeat (gossiped every 2 s) cost a joiner 0.5-4.8 s of its
        # start (`node bench join`, "sync state"), all before the checkpoint pull.
        self.first_peers = list(first_peers or [])

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        run = ctx.the_run()
        self._ctx = ctx
        self.substrate, self.publisher, self.signer = ctx.substrate, ctx.publisher, ctx.signer
        self.run_id, self.doc = run.run_id, run.document
        self.path = document_path(ctx.config.state_dir, run.run_id)
        self.live_peers = ctx.membership.live_peers
        self.run_size = ctx.membership.recent_count
        ctx.substrate.set_handler(PROTOCOL_ID, self._handle)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._listen)
            nursery.start_soon(self._announce_loop)
            nursery.start_soon(self._anti_entropy_loop)
            nursery.start_soon(self._persist_loop)
            task_status.started()

    def first_candidates(self) -> list[str]:
        """Until the first round succeeds: the peer that served our manifest, then every
        peer we are connected to. Live peers are those heard by heartbeat (gossiped every
        2 s, later under load: a joiner waited 7.6 s for one and then trained from scratch,
        `node bench join` at load 6). A connected peer outside the run fails the round at
        once: no protocol (a bootstrap), or a summary of another run (refused)."""
        me = self.signer.peer_id
        connected = [p.to_base58() for p in self.substrate.connected_peers()]
        return [p for p in dict.fromkeys([*self.first_peers, *connected])
                if p != me and self._may_speak(p)]

    def _may_speak(self, peer: str) -> bool:
        """False when identify says `peer` lacks our protocol (a bootstrap): no round
        that fails for sure (and py-libp2p's error about it). True while unknown."""
        protocols = self.substrate.protocols_of(ID.from_base58(peer))
        return not protocols or PROTOCOL_ID in protocols  # none yet: identify is under way

    def own_entries(self) -> dict[str, Any]:
        assert self._ctx is not None
        ctx = self._ctx
        return {"addrs": ctx.substrate.addrs(), "role": "node", "device": ctx.device,
                "stats": ctx.own_stats()}

    def publish(self, delta: bytes) -> None:
        """Gossip a delta written by another service (a checkpoint announcement)."""
        self.publisher.publish_nowait(topic(self.run_id), delta)


    def statistics(self) -> dict[str, Any]:
        if self._ctx is None:
            return {}
        st = self.doc.statistics()
        return {"entries": st.entries, "tombstones": st.tombstones, "rejected": self.rejected,
                "announce_interval_s": round(self.announce_interval_s(), 3),
                "compacted": self.compacted, "floor_ms": st.floor_ms,
                "anti_entropy_rounds": self.syncs, "digest": self.doc.digest().hex()[:16]}

    # -- writing and gossip -----------------------------------------------------------------

    def _merge(self, delta: bytes, source: str) -> None:
        result = self.doc.merge(delta, now_ms())
        for key, reason in result.rejected:
            self.rejected += 1
            log.warning("run document: rejected %s from %s: %s", key, source, reason,
                        extra={"peer": source, "reason": f"rundoc {reason}"})

    def announce_interval_s(self) -> float:
        """Seconds between our announces at the run's size (us included; peers heard
        recently, not only the live ones: Membership.recent_count says why)."""
        n = self.run_size() + 1
        return heartbeat_interval_s(n, self.announce_s, self.announce_target_per_s)

    async def _announce_loop(self) -> None:
        me = self.signer.peer_id
        while True:
            t = now_ms()
            own = own_announce(me, self.own_entries(), t)
            for key, value in own.items():
                self.doc.set(key, value, t)
            if (retired := retire_legacy(self.doc, me, t)) is not None:
                self.publisher.publish_nowait(topic(self.run_id), retired)
            # Only what this loop writes: other own entries (checkpoints) are published when
            # written, and anti-entropy repairs what gossip lost.
            entries = [e for key in own if (e := self.doc.entry(key)) is not None]
            self.publisher.publish_nowait(topic(self.run_id), self.doc.encode_delta(entries))
            # Own entries written once (checkpoint announcements) are re-signed before a
            # quarter of the horizon: a live peer's entry is then never under a replica's
            # compaction floor, where a replica that missed it would refuse it for good.
            if (refreshed := self.doc.refresh(t, self.horizon_ms() // 4)) is not None:
                self.publisher.publish_nowait(topic(self.run_id), refreshed)
            interval = self.announce_interval_s()
            assert self._ctx is not None
            self._ctx.membership.announce_interval_s = interval  # members' ttl follows it
            await trio.sleep(interval)

    async def _listen(self) -> None:
        while True:
            await self.substrate.ready.wait()
            assert self.substrate.pubsub is not None
            subscription = await self.substrate.pubsub.subscribe(topic(self.run_id))
            try:
                while True:
                    msg = await subscription.get()
                    sender = ID(msg.from_id).to_base58()
                    if sender == self.signer.peer_id:
                        continue
                    try:
                        self._merge(msg.data, sender)
                    except RemoteProtocolError as e:
                        self.rejected += 1
                        self.substrate.gate.penalize(sender, "invalid_gossip")
                        log.info("run document: bad delta from %s: %s", sender, e,
                                 extra={"peer": sender, "reason": "bad delta"})
            except Exception as e:
                log.warning("meta subscription ended (%r); re-subscribing", e)
                await trio.sleep(0.5)

    # -- anti-entropy -------------------------------------------------------------------------

    async def _anti_entropy_loop(self) -> None:
        last_full = 0.0
        in_flight: set[str] = set()
        # peer -> (when its last round failed, how long to wait before the next): 2 s,
        # doubling to 60 s. Without the backoff a loaded swarm retried every 2 s and the
        # retries (10 s each) crowded out the rounds that could succeed (seen under churn).
        failed: dict[str, tuple[float, float]] = {}

        def may_retry(peer: str, now: float) -> bool:
            failed_at, wait = failed.get(peer, (0.0, 0.0))
            return now - failed_at >= wait

        async def sync(peer: str) -> None:
            began = time.monotonic()
            try:
                with trio.fail_after(10):
                    await self._sync_with(peer)
                self.syncs += 1
                if not self.first_sync.is_set():
                    log.info("first anti-entropy round: with %s in %.2f s", peer,
                             time.monotonic() - began, extra={"peer": peer})
                self.first_sync.set()
                failed.pop(peer, None)
            except Exception as e:
                # retried while it stays live: right after a heal the first try can fail
                # while the connections are re-made
                self._synced_with.discard(peer)
                wait = min(RETRY_MAX_S, 2 * failed[peer][1]) if peer in failed else RETRY_MIN_S
                failed[peer] = (time.monotonic(), wait)
                log.info("anti-entropy with %s failed (next try in %.0f s): %r", peer, wait, e,
                         extra={"peer": peer, "reason": "anti-entropy failed"})
            finally:
                in_flight.discard(peer)

        async with trio.open_nursery() as nursery:
            for tick in itertools.count():
                if tick:  # a joiner's first pass is at once, and it looks again every
                    # 0.1 s until a round succeeds: its peers connect one by one (mDNS, the
                    # DHT), and each 0.5 s tick cost the checkpoint pull up to 0.5 s
                    await trio.sleep(0.5 if self.first_sync.is_set() else 0.1)
                now = time.monotonic()
                live = [p for p in self.live_peers() if p != self.signer.peer_id]
                if not self.first_sync.is_set():
                    live += [p for p in self.first_candidates() if p not in live]
                # A peer that left our view (a partition, a restart) is synced with as soon
                # as it is back: what it wrote meanwhile never reaches us by gossip again.
                self._synced_with.intersection_update(live)
                new = [p for p in live if p not in self._synced_with and p not in in_flight
                       and may_retry(p, now)]
                due = now - last_full >= self.anti_entropy_s
                idle = [p for p in live if p not in in_flight]
                targets = new[:4] if new else ([random.choice(idle)] if idle and due else [])
                if due:
                    last_full = now
                for p in [p for p, (t, _) in failed.items() if p not in live
                          and now - t > RETRY_MAX_S]:
                    del failed[p]
                # concurrently, so a stuck peer never delays the others; at most 4 start
                # per tick and each ends within 10 s: at most 80 in flight
                for peer in targets:
                    self._synced_with.add(peer)
                    in_flight.add(peer)
                    nursery.start_soon(sync, peer)

    async def _sync_with(self, peer: str) -> None:
        stream = await self.substrate.open_stream(ID.from_base58(peer), PROTOCOL_ID,
                                                 lazy=True)
        decoder = rundoc.SYNC_LIMITS.decoder()
        try:
            await stream.write(encode_envelope(
                Envelope("meta.summary", 1, {"summary": self.doc.summary()}),
                max_frame_bytes=MAX_FRAME))
            reply = _expect(await next_event(stream, decoder), "meta.delta")
            self._merge(reply["delta"], peer)
            if not self.caught_up.is_set() and self.doc.caught_up(reply["summary"]):
                self.caught_up.set()
            await stream.write(encode_envelope(
                Envelope("meta.delta", 1, {"delta": self.doc.delta_since(reply["summary"])}),
                max_frame_bytes=MAX_FRAME))
        finally:
            await stream.close()

    async def _handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        decoder = rundoc.SYNC_LIMITS.decoder()
        try:
            with trio.fail_after(rundoc.SYNC_LIMITS.deadline_s or 10.0):
                request = _expect(await next_event(stream, decoder), "meta.summary")
                await stream.write(encode_envelope(Envelope("meta.delta", 1, {
                    "delta": self.doc.delta_since(request["summary"]),
                    "summary": self.doc.summary()}), max_frame_bytes=MAX_FRAME))
                final = _expect(await next_event(stream, decoder), "meta.delta")
                self._merge(final["delta"], peer)
        finally:
            await stream.close()

    # -- persistence and compaction -----------------------------------------------------------

    def horizon_ms(self) -> int:
        """The compaction horizon: the configured one, but never under 10 announce
        intervals (a live peer rewrites its last_seen every interval; a horizon shorter
        than that would drop a live peer's namespace, and refuse its older keys after)."""
        return max(self.gc_horizon_ms, int(10_000 * self.announce_interval_s()))

    def may_compact(self, now: float | None = None) -> bool:
        """A replica with a floor already (it compacted before a restart), one caught up
        with a peer, or one that found nobody to catch up with for a quarter of the
        horizon (a run's first node) may compact."""
        now = time.monotonic() if now is None else now
        return (self.doc.floor_ms > 0 or self.caught_up.is_set()
                or now - self.started >= self.gc_horizon_ms / 4000)

    def compact(self, now: int) -> int:
        """Drop what the compaction rule names, if this replica may; returns the count."""
        if not self.may_compact():
            return 0
        dropped = self.doc.gc(now, self.horizon_ms())
        if dropped:
            log.info("run document: compacted %d entries (departed peers, old tombstones)",
                     dropped)
        self.compacted += dropped
        return dropped


    async def _persist_loop(self) -> None:
        try:
            await trio.sleep(2.0)  # a first save soon after joining, then every persist_s
            while True:
                self.compact(now_ms())
                await trio.to_thread.run_sync(atomic_write, self.path, self.doc.to_bytes())
                await trio.sleep(self.persist_s)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    atomic_write(self.path, self.doc.to_bytes())
                except OSError as e:
                    log.error("could not save the run document: %s", e)


def _expect(event: Any, kind: str) -> dict:
    if not isinstance(event, Envelope) or event.type != kind or not isinstance(event.body, dict):
        raise RemoteProtocolError(f"expected {kind}")
    return event.body
