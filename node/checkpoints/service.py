"""The checkpoint service of a training node: start from the swarm's newest checkpoint,
save the trainer's snapshots, and keep what we hold announced (and only that).

* Joining mid-run (nothing held locally): wait briefly for a first run-document sync,
  take the newest checkpoint in its index and pull it at once from the holders the index
  lists (its writer, and every node that pulled it before: `holders.SOURCES` of them,
  chosen by rendezvous hash, node/checkpoints/holders.py), the DHT's providers of it joining
  in when that lookup (bounded) returns (node/checkpoints/exchange.py). The service reports
  ready only then, so the trainer starts from it; once the pull is vetted the node
  announces itself as one more holder (`peer/<id>/ckpt/<cid>` naming the `writer`).
* Saving: snapshots are written in a worker thread, retention keeps the newest
  `checkpoint.keep`, and each checkpoint is announced under our own namespace of the run
  document (`peer/<id>/ckpt/<cid>`) and as a DHT provider record. Whatever retention
  deletes is unannounced on both, so the index stays as small as what is held.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.peer.id import ID

from node.checkpoints import exchange
from node.checkpoints.holders import SOURCES, choose_holders
from node.errors import NodeError
from node.run.rundoc_sync import now_ms
from node.service import NodeContext
from protocols.rundoc import checkpoint_holders, checkpoint_index, ckpt_key

log = logging.getLogger("node.ckpt")

PROVIDER_LOOKUP_S = 3.0  # joining: how long the DHT may take to name checkpoint providers
SYNC_WAIT_S = 5.0  # joining: how long to wait for a first run-document sync (a first node
# has nobody to sync with)
SYNC_WAIT_LOADING_S = 30.0  # ... and while torch still loads (the wait then costs nothing)
# or a training member has been heard (a run with members has checkpoints to start from)
PULL_TRIES = 3  # joining: pulls tried, of the newest listed checkpoint each time
# ... and the pause before the same one is asked for again. Under load a provider's host
# can take longer than py-libp2p's 10 s protocol negotiation: `node bench join` at load 12
# had 2 of 3 joiners train from scratch on one "failed to open a stream to peer <writer>".
PULL_RETRY_S = 3.0


def ckpt_provider_key(cid: str) -> str:
    return f"ckpt/{cid}"


class CheckpointService:
    name = "checkpoints"
    protocols = ()  # /peertrain/ckpt/1.0.0 is served by CheckpointServer on every node

    def __init__(self, publish: Callable[[bytes], None], synced: trio.Event,
                 still_loading: Callable[[], bool] = lambda: False,
                 members_heard: Callable[[], bool] = lambda: False,
                 vet: Callable[[str, str], Awaitable[str | None]] | None = None) -> None:
        self._publish = publish  # gossips a run-document delta (RunDocSync.publish)
        self._synced = synced  # set after the first anti-entropy exchange
        # True while the trainer could not start anyway (torch is still loading:
        # node/process/preload.py); the first sync may take longer then, up to SYNC_WAIT_LOADING_S.
        self._still_loading = still_loading
        # True once a live training node's heartbeat has been heard: the run has members
        # (and likely checkpoints), so their run document is worth waiting for.
        self._members_heard = members_heard
        # Checks a pulled checkpoint's claim of progress before the trainer may start from
        # it: (cid, writer) -> None (take it) or why not (node/checkpoints/vet.py)
        self._vet = vet
        self.refused: dict[str, str] = {}  # cid -> why its claim was not believed
        self.download: dict[str, Any] | None = None
        self.downloading = False  # a checkpoint pull under way (Prebuild waits for it)
        self.saved = 0
        self._writing = trio.Lock()
        self.failed = 0
        self.resume_from: str | None = None  # the checkpoint the trainer starts from
        self.pulled: tuple[str, int, str] | None = None  # (cid, step, writer) of a vetted pull
        self._ctx: NodeContext | None = None

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._ctx = ctx
        run_id = ctx.the_run().run_id
        self.resume_from = ctx.checkpoints.latest(run_id) or await self._pull_newest(ctx)
        task_status.started()  # the trainer starts from it now
        if self.pulled is not None and self.pulled[0] == self.resume_from:
            self._announce_holder(ctx, *self.pulled)
        # Whatever we hold, written before a restart or just pulled, the next joiner can
        # fetch from us too (until retention drops it). After `started`: a provide is a
        # DHT lookup and a round of ADD_PROVIDER, 0.9 s of a join under load before the
        # trainer could start.
        dht = ctx.substrate.dht
        if dht is not None:
            for cid, _ in ctx.checkpoints.list(run_id):
                await dht.provide(ckpt_provider_key(cid))
        await trio.sleep_forever()

    def statistics(self) -> dict[str, Any]:
        return {"download": self.download, "saved": self.saved, "failed": self.failed,
                "resumed_from": self.resume_from, "refused": dict(self.refused)}

    async def _pull_newest(self, ctx: NodeContext) -> str | None:
        run = ctx.the_run()
        ctx.phases.enter("syncing state")
        with trio.move_on_after(SYNC_WAIT_S):
            await self._synced.wait()
        # A joiner that gives up on the sync finds no checkpoint and trains from scratch:
        # measured on a loaded machine (load 9-20), the first sync of 3 of 3 joiners took
        # longer than 5 s, while their torch import took 15 s; and with torch in after 6 s
        # (py-spy beside 4 trainers) a joiner gave up while members were answering slowly.
        # Waiting while torch loads delays nothing; waiting while members are heard beats
        # starting from scratch in their run. A run's first node hears nobody: 5 s.
        with trio.move_on_after(SYNC_WAIT_LOADING_S - SYNC_WAIT_S):
            while not self._synced.is_set() and (self._still_loading()
                                                 or self._members_heard()):
                with trio.move_on_after(0.1):
                    await self._synced.wait()
        if not checkpoint_index(run.document):
            return None
        ctx.phases.enter("finding providers")
        tried: list[str] = []
        refused: set[str] = set()
        for _ in range(PULL_TRIES):
            # Its holders may have dropped it while we pulled (retention keeps the newest
            # `checkpoint.keep`: seconds of a small fast model on a loaded machine, CI of
            # 2026-11-26): the run document then lists a newer one, and that one is taken.
            # Else the same one again, after a pause (PULL_RETRY_S). One whose claim
            # failed the check is never taken again: the next newest is.
            listed = [e for e in checkpoint_index(run.document) if e[1] not in refused]
            if not listed:
                break
            if tried and listed[-1][1] in tried:
                await trio.sleep(PULL_RETRY_S)
                listed = [e for e in checkpoint_index(run.document) if e[1] not in refused]
                if not listed:
                    break
            step, cid, writer = listed[-1]
            # several holders announce it; the writer (the vet leaves its word out) is the
            # one that names no other writer
            writer = checkpoint_holders(run.document, cid)[1] or writer
            tried.append(cid)
            if not await self._pull(ctx, step, cid, writer):
                continue
            reason = await self._vet(cid, writer) if self._vet is not None else None
            if reason is None:
                self.pulled = (cid, step, writer)
                return cid
            refused.add(cid)
            self.refused[cid] = reason
            log.warning("checkpoint %s of %s claims step %d and is not used: %s", cid, writer,
                        step, reason)
            await trio.to_thread.run_sync(ctx.checkpoints.discard, cid)
        log.warning("no checkpoint taken (tried %s); starting from the run's initial weights "
                    "(our checkpoints claim the steps we train, not the swarm's)",
                    ", ".join(dict.fromkeys(tried)) or "none")
        return None

    async def _pull(self, ctx: NodeContext, step: int, cid: str, writer: str) -> bool:
        """Checkpoint `cid` pulled from the peers the run document says hold it and the
        DHT's providers of it; False (logged) if none of them served it."""
        dht = ctx.substrate.dht
        assert dht is not None
        # The holders the run document lists (its writer) are asked at once; the DHT's
        # providers (a joiner that pulled it before us) join the pull when the lookup
        # returns. Waiting for the lookup first cost its whole deadline (3 s) in `node
        # bench join`: in a NoLoCo swarm the writer is the only holder. Until 2026-11-27
        # every connected peer was asked too, a stream and a refusal from each peer that
        # did not hold it: 4-8 busy trainers per join in `node bench join`, every peer
        # of a large swarm.
        # With many holders (every joiner that pulled it announces itself), a few chosen by
        # rendezvous hash: 1,000 joiners spread over the holders instead of all on the
        # writer, or each on all of them. The DHT's providers are ranked the same way.
        me = ctx.substrate.peer_id.to_base58()
        holders = checkpoint_holders(ctx.the_run().document, cid)[0]
        chosen = choose_holders(cid, me, [writer, *holders], SOURCES)
        providers = [ID.from_base58(p) for p in chosen]

        async def dht_providers() -> list[ID]:
            found = await dht.find_providers(ckpt_provider_key(cid), timeout=PROVIDER_LOOKUP_S)
            more = choose_holders(cid, me, [p.peer_id.to_base58() for p in found], SOURCES,
                                  exclude=chosen)
            return [ID.from_base58(p) for p in more]

        ctx.phases.enter("downloading checkpoint")
        download = self.download = {"cid": cid, "step": step, "done": 0, "total": 0,
                                    "providers": len(providers)}

        def progress(done: int, total: int) -> None:
            download.update(done=done, total=total)

        self.downloading = True
        try:
            pulled = await exchange.pull(ctx.substrate, providers, cid, ctx.checkpoints,
                                         progress=progress, more_providers=dht_providers,
                                         open_stream=ctx.transports.open_stream,
                                         path_of=ctx.transports.path_of)
        except NodeError as e:
            log.warning("could not fetch checkpoint %s (%s)", cid, e)
            return False
        finally:
            self.downloading = False
        # asked != served: in a NoLoCo swarm each node's checkpoint is its own
        download["served_by"] = len(pulled.bytes_by_peer)
        download["providers"] = pulled.asked
        log.info("fetched checkpoint %s (step %d) from %d of %d providers asked", cid, step,
                 len(pulled.bytes_by_peer), pulled.asked)
        return True

    async def save(self, snapshot: Any) -> None:
        """Write a trainer snapshot (in a worker thread), keep the newest few, announce it.
        A full disk costs this checkpoint, never the node."""
        ctx = self._ctx
        assert ctx is not None
        run = ctx.the_run()
        store, keep = ctx.checkpoints, run.manifest.checkpoint.keep

        # The checkpoint claims the steps its weights were trained, not the round clock
        # (a node that started from scratch follows the swarm's clock; docs/checkpoints.md)
        trained = snapshot.step if snapshot.trained is None else min(snapshot.trained,
                                                                     snapshot.step)
        meta = {"peer": ctx.peer_id, "clock": snapshot.step, "parent": snapshot.parent or ""}

        def write() -> tuple[str, int, set[str]]:
            cid = store.save(run.run_id, trained, snapshot.tensors, meta)
            size = store.manifest(cid).size
            before = {c for c, _ in store.list(run.run_id)}
            store.retain(run.run_id, keep)
            return cid, size, before - {c for c, _ in store.list(run.run_id)}

        # One save at a time: two in worker threads at once each ran retention over the
        # other's half-done state, and one read back a manifest the other had just dropped
        # (a CheckpointError that stopped the trainer).
        async with self._writing:
            try:
                cid, size, dropped = await trio.to_thread.run_sync(write)
            except NodeError as e:
                self.failed += 1
                log.error("%s", e)
                return
        self.saved += 1
        run.progress.checkpoints += 1
        run.progress.last_checkpoint = cid
        log.info("checkpoint %s at step %d (%d steps trained)", cid, snapshot.step, trained)
        self._unannounce(ctx, dropped)
        if cid in dropped:  # it claims less than the `keep` we hold (we resumed from scratch
            return  # after a damaged checkpoint): nothing to announce
        self._publish(run.document.set(ckpt_key(ctx.peer_id, cid),
                                       {"hash": cid, "step": trained, "size": size}, now_ms()))
        if ctx.substrate.dht is not None:
            await ctx.substrate.dht.provide(ckpt_provider_key(cid))

    def _announce_holder(self, ctx: NodeContext, cid: str, step: int, writer: str) -> None:
        """We hold a checkpoint we pulled (and vetted): the next joiners may pull it from
        us. Our own namespace, the writer named; retention deletes it like our own."""
        try:
            size = ctx.checkpoints.manifest(cid).size
        except NodeError as e:
            log.warning("not announcing checkpoint %s: %s", cid, e)
            return
        value = {"hash": cid, "step": step, "size": size, "writer": writer}
        self._publish(ctx.the_run().document.set(ckpt_key(ctx.peer_id, cid), value, now_ms()))
        log.info("holding checkpoint %s (step %d) of %s for the next joiners", cid, step,
                 writer)

    def _unannounce(self, ctx: NodeContext, dropped: set[str]) -> None:
        doc = ctx.the_run().document
        for cid in dropped:
            if ctx.substrate.dht is not None:
                ctx.substrate.dht.stop_providing(ckpt_provider_key(cid))
            key = ckpt_key(ctx.peer_id, cid)
            if doc.get(key) is not None:
                self._publish(doc.delete(key, now_ms()))
