"""Adapter for `/peertrain/manifest/1.0.0`: serve the manifests we hold, fetch the ones we need."""

from __future__ import annotations

import itertools
import logging

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from node.runstore import RunStore
from node.streams import next_event
from p2p.host import Substrate
from protocols import manifest as mf
from protocols import manifest_exchange as mx
from protocols.errors import RemoteProtocolError
from protocols.wire import Envelope

log = logging.getLogger(__name__)
_req_ids = itertools.count(1)


def install(substrate: Substrate, store: RunStore) -> None:
    async def handle(stream: INetStream) -> None:
        try:
            with trio.fail_after(10):
                env = await next_event(stream, mx.REQUEST_LIMITS.decoder())
                if not isinstance(env, Envelope):
                    raise RemoteProtocolError("expected a request envelope")
                run_id = mx.parse_request(env)
                data = store.get(run_id)
                if data is None:
                    await stream.write(mx.encode_error(env.id, "unknown-run",
                                                       f"this peer does not hold run {run_id}"))
                else:
                    await stream.write(mx.encode_response(env.id, run_id, data))
        finally:
            await stream.close()

    substrate.set_handler(mx.PROTOCOL_ID, handle)


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
