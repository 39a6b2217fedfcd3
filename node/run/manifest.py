"""`/peertrain/manifest/1.0.0`: serve the manifests this node holds, provide their runs in the
DHT, and find a run's manifest when joining.

A run-id is the hash of its manifest's canonical bytes, so a joiner can take the manifest
from anyone: `resolve` asks the run's DHT providers (and every connected peer: a bootstrap
serving the run may answer before its provider record has spread) until one serves bytes
that hash to the id.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from node.errors import ManifestRejected, RunNotFound
from node.run.store import RunStore
from node.service import NodeContext
from node.streams import next_event
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

    async def resolve(self, ctx: NodeContext, run_id: str) -> mf.Manifest:
        """The verified manifest of `run_id`: from our store, else from the swarm within
        the join timeout (RunNotFound / ManifestRejected with every peer's answer)."""
        local = ctx.runs.get(run_id)
        if local is not None:
            return mf.parse_canonical(local, expected_run_id=run_id)
        substrate, dht = ctx.substrate, ctx.substrate.dht
        assert dht is not None
        timeout = ctx.config.join_timeout_s
        tried: set[ID] = set()
        reasons: dict[str, str] = {}
        rejected = False
        delay = 0.2
        with trio.move_on_after(timeout):
            while True:
                providers = [p.peer_id for p in await dht.find_providers(run_key(run_id))]
                candidates = [p for p in [*providers, *substrate.connected_peers()]
                              if p != substrate.peer_id and p not in tried]
                for peer in candidates:
                    tried.add(peer)
                    try:
                        manifest = await fetch_manifest(substrate, peer, run_id)
                        self.source = peer.to_base58()
                        return manifest
                    except mf.ManifestError as e:
                        rejected = True
                        reasons[peer.to_base58()] = f"served a bad manifest: {e}"
                        substrate.gate.penalize(peer.to_base58(), "invalid")
                        log.warning("peer %s served a bad manifest for %s: %s", peer, run_id, e,
                                    extra={"peer": peer.to_base58(), "reason": "bad manifest"})
                    except (LookupError, RemoteProtocolError) as e:
                        reasons[peer.to_base58()] = str(e)
                    except Exception as e:
                        reasons[peer.to_base58()] = f"no answer ({type(e).__name__})"
                await trio.sleep(delay)  # retry: providers may appear as the run starts
                delay = min(delay * 2, 2.0)
                if tried and len(tried) >= len(substrate.connected_peers()) + len(providers):
                    tried.clear()  # ask everyone again: they may have joined the run since
        detail = "".join(f"\n  {p}: {r}" for p, r in sorted(reasons.items())) or \
            "\n  (no peer in the DHT provides it)"
        error = ManifestRejected if rejected else RunNotFound
        raise error(f"could not get the manifest of run {run_id} within {timeout:g} s:{detail}"
                    "\nCheck the run-id, and that a node holding the run is reachable.")


async def fetch_manifest(substrate: Substrate, peer: ID, run_id: str,
                         timeout: float = 10.0) -> mf.Manifest:
    """Ask one peer for the manifest; the result is verified against `run_id`."""
    req_id = next(_req_ids)
    with trio.fail_after(timeout):
        stream = await substrate.open_stream(peer, mx.PROTOCOL_ID)
        try:
            await stream.write(mx.encode_request(req_id, run_id))
            env = await next_event(stream, mx.RESPONSE_LIMITS.decoder())
        finally:
            await stream.close()
    if not isinstance(env, Envelope):
        raise RemoteProtocolError("expected a manifest envelope")
    return mx.parse_response(env, req_id, run_id)
