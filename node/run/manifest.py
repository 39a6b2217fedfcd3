"""`/peertrain/manifest/1.0.0`: serve the manifests this node holds, provide their runs in the
DHT, and find a run's manifest when joining.

A run-id is the hash of its manifest's canonical bytes, so a joiner can take the manifest
from anyone: `resolve` asks the peers it is connected to and the run's DHT providers, all
at once, until one serves bytes that hash to the id.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from node.errors import ManifestRejected, RunNotFound
from node.run.store import RunStore
from node.service import NodeContext
from node.transport.streams import close_quietly, next_event
from p2p.host import Substrate
from protocols import manifest as mf
from protocols import manifest_exchange as mx
from protocols.errors import RemoteProtocolError
from protocols.wire import Envelope

log = logging.getLogger("node.run")
_req_ids = itertools.count(1)


def run_key(run_id: str) -> str:
    """The DHT key whose providers serve run `run_id`."""
    return f"run/{run_id}"


class ManifestService:
    name = "manifests"
    protocols = (mx.PROTOCOL_ID,)

    def __init__(self) -> None:
        self.served = 0
        self.unknown = 0
        # The peer whose manifest we took (a run member that provides it, or the node we
        # dialed): a joiner's first run-document sync asks it at once.
        self.source: str | None = None
        self._rejected = False  # resolve(): did any peer serve a manifest that failed?
        self._ctx: NodeContext | None = None

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._ctx = ctx
        ctx.substrate.set_handler(mx.PROTOCOL_ID, self._handle)
        task_status.started()
        await trio.sleep_forever()

    def statistics(self) -> dict[str, Any]:
        held = self._ctx.runs.run_ids() if self._ctx else []
        return {"runs_served": held, "served": self.served, "unknown_run": self.unknown}

    async def _handle(self, stream: INetStream) -> None:
        assert self._ctx is not None
        store: RunStore = self._ctx.runs
        try:
            with trio.fail_after(mx.REQUEST_LIMITS.deadline_s or 10.0):
                env = await next_event(stream, mx.REQUEST_LIMITS.decoder())
                if not isinstance(env, Envelope):
                    raise RemoteProtocolError("expected a request envelope")
                run_id = mx.parse_request(env)
                data = store.get(run_id)
                if data is None:
                    self.unknown += 1
                    await stream.write(mx.encode_error(env.id, "unknown-run",
                                                       f"this peer does not hold run {run_id}"))
                else:
                    self.served += 1
                    await stream.write(mx.encode_response(env.id, run_id, data))
        finally:
            await stream.close()

    async def provide(self, ctx: NodeContext, run_id: str) -> None:
        """Announce in the DHT that we serve `run_id` (re-provided by the DHT wrapper)."""
        dht = ctx.substrate.dht
        assert dht is not None
        dht.reprovide_interval = ctx.config.reprovide_s
        await dht.provide(run_key(run_id))

    async def provide_sampled(self, ctx: NodeContext, run_id: str,
                              clock: Callable[[], float] = time.time) -> None:
        """A member's provision of the run key: now (a joiner's view is empty, so it is in
        the sample), then each reprovide_s only while it is in the epoch's rendezvous sample
        of its live view (node/run/providers.py): ~20 members re-provide, not all N."""
        from node.run.providers import epoch_of, should_provide

        dht = ctx.substrate.dht
        assert dht is not None
        key = run_key(run_id)
        await self.provide(ctx, run_id)
        while True:
            await trio.sleep(ctx.config.reprovide_s)
            chosen = should_provide(run_id, epoch_of(clock()), ctx.peer_id,
                                    ctx.membership.live_peers())
            if chosen and not dht.providing(key):
                log.info("in this epoch's provider sample of run %s: providing it", run_id)
                await dht.provide(key)
            elif not chosen and dht.providing(key):
                log.info("out of this epoch's provider sample of run %s: the sample "
                         "provides it", run_id)
                dht.stop_providing(key)

    async def resolve(self, ctx: NodeContext, run_id: str) -> mf.Manifest:
        """The verified manifest of `run_id`: from our store, else from the swarm within
        the join timeout (RunNotFound / ManifestRejected with every peer's answer)."""
        local = ctx.runs.get(run_id)
        if local is not None:
            return mf.parse_canonical(local, expected_run_id=run_id)
        timeout = ctx.config.join_timeout_s
        reasons: dict[str, str] = {}
        self._rejected = False
        delay = 0.2
        with trio.move_on_after(timeout):
            while (manifest := await self._ask_round(ctx, run_id, reasons)) is None:
                await trio.sleep(delay)  # again: providers may appear as the run starts
                delay = min(delay * 2, 2.0)
            return manifest
        detail = "".join(f"\n  {p}: {r}" for p, r in sorted(reasons.items())) or \
            "\n  (no peer in the DHT provides it)"
        error = ManifestRejected if self._rejected else RunNotFound
        raise error(f"could not get the manifest of run {run_id} within {timeout:g} s:{detail}"
                    "\nCheck the run-id, and that a node holding the run is reachable.")

    async def _ask_round(self, ctx: NodeContext, run_id: str,
                         reasons: dict[str, str]) -> mf.Manifest | None:
        """Every connected peer at once, and the run's DHT providers as the lookup names
        them; the first verified manifest (the other asks are cancelled), else None.

        The connected peers are asked without waiting for the lookup: the peer we entered
        through usually holds the run (a `node bootstrap` serves the runs in its store, a
        remembered or mDNS peer is a member), and the lookup's round trips were most of
        a join's `discover` phase (0.7-1.4 s beside torch's import, `node bench join`)."""
        substrate, dht = ctx.substrate, ctx.substrate.dht
        assert dht is not None
        asked: set[ID] = {substrate.peer_id}
        found: list[mf.Manifest] = []
        async with trio.open_nursery() as nursery:

            def ask_each(peers: list[ID]) -> None:
                for peer in peers:
                    if peer not in asked:
                        asked.add(peer)
                        nursery.start_soon(ask, peer)

            async def ask(peer: ID) -> None:
                manifest = await self._ask(substrate, peer, run_id, reasons)
                if manifest is not None and not found:
                    found.append(manifest)
                    self.source = peer.to_base58()
                    nursery.cancel_scope.cancel()

            async def look_up() -> None:
                ask_each([p.peer_id for p in await dht.find_providers(run_key(run_id))])

            ask_each(substrate.connected_peers())
            nursery.start_soon(look_up)
        return found[0] if found else None

    async def _ask(self, substrate: Substrate, peer: ID, run_id: str,
                   reasons: dict[str, str]) -> mf.Manifest | None:
        """`peer`'s manifest of `run_id`, verified; None (its reason noted) if it has none."""
        name = peer.to_base58()
        try:
            return await fetch_manifest(substrate, peer, run_id)
        except mf.ManifestError as e:
            self._rejected = True
            reasons[name] = f"served a bad manifest: {e}"
            substrate.gate.penalize(name, "invalid")
            log.warning("peer %s served a bad manifest for %s: %s", peer, run_id, e,
                        extra={"peer": name, "reason": "bad manifest"})
        except (LookupError, RemoteProtocolError) as e:
            reasons[name] = str(e)
        except Exception as e:
            reasons[name] = f"no answer ({type(e).__name__})"
        return None


async def fetch_manifest(substrate: Substrate, peer: ID, run_id: str,
                         timeout: float = 10.0) -> mf.Manifest:
    """Ask one peer for the manifest; the result is verified against `run_id`."""
    req_id = next(_req_ids)
    with trio.fail_after(timeout):
        stream = await substrate.open_stream(peer, mx.PROTOCOL_ID, lazy=True)
        try:
            await stream.write(mx.encode_request(req_id, run_id))
            env = await next_event(stream, mx.RESPONSE_LIMITS.decoder())
        finally:  # also when another peer answered first and this ask is cancelled
            with trio.CancelScope(shield=True):
                await close_quietly(stream)
    if not isinstance(env, Envelope):
        raise RemoteProtocolError("expected a manifest envelope")
    return mx.parse_response(env, req_id, run_id)
