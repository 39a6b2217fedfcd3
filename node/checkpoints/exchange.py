"""Serving and pulling checkpoints over `/peertrain/ckpt/1.0.0`.

`pull` fetches the manifest from the first provider whose bytes hash to the cid, then the
chunks from every provider in parallel: one worker per provider takes the next missing
chunk from a shared queue, and a chunk that fails (timeout, stall, wrong hash, refusal) goes
back into the queue while that provider is dropped. Chunks already on disk are skipped, so
an interrupted pull resumes where it stopped. Nothing is loaded that failed verification.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from node.checkpoints.store import CheckpointError, CheckpointStore
from node.service import NodeContext
from node.streams import StreamEnded, next_event
from p2p.host import Substrate
from protocols import checkpoint as ck
from protocols import ckpt_exchange as cx
from protocols.errors import RemoteProtocolError
from protocols.wire import Envelope

log = logging.getLogger("node.ckpt")
_ids = itertools.count(1)


class CheckpointServer:
    """Serves the checkpoints in our store, on every node (a bootstrap too): one stream is
    a session of requests in sequence, each answered from disk in a worker thread."""

    name = "checkpoint_server"
    protocols = (cx.PROTOCOL_ID,)

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.served = 0
        self.missing = 0

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        ctx.substrate.set_handler(cx.PROTOCOL_ID, self.handle)
        task_status.started()
        await trio.sleep_forever()

    def statistics(self) -> dict[str, Any]:
        return {"served": self.served, "not_held": self.missing}

    async def handle(self, stream: INetStream) -> None:
        decoder = cx.REQUEST_LIMITS.decoder()
        try:
            while True:
                with trio.fail_after(cx.REQUEST_LIMITS.deadline_s or 30.0):
                    try:
                        env = await next_event(stream, decoder)
                    except StreamEnded:
                        return  # the asker hung up: end of session (garbage goes to the guard)
                if not isinstance(env, Envelope):
                    raise RemoteProtocolError("expected a request")
                kind, cid, index = cx.parse_request(env)
                data = await trio.to_thread.run_sync(_read, self.store, kind, cid, index)
                if data is None:
                    self.missing += 1
                else:
                    self.served += 1
                await stream.write(cx.respond(env, data, index))
        finally:
            await stream.close()


def _read(store: CheckpointStore, kind: str, cid: str, index: int | None) -> bytes | None:
    try:
        if kind == "ckpt.manifest":
            return (store.manifests / cid).read_bytes() if store.latest_ok(cid) else None
        m = store.manifest(cid)
        if index is None or index >= len(m.chunks):
            return None
        return (store.chunks / m.chunks[index]).read_bytes()
    except (OSError, CheckpointError):
        return None


class _Session:
    """One stream to one provider, requests in sequence."""

    def __init__(self, substrate: Substrate, peer: ID) -> None:
        self.substrate, self.peer = substrate, peer
        self.stream: INetStream | None = None
        self.decoder = cx.RESPONSE_LIMITS.decoder()

    async def ask(self, request: bytes, req_id: int, kind: str) -> bytes:
        if self.stream is None:
            self.stream = await self.substrate.open_stream(self.peer, cx.PROTOCOL_ID)
        await self.stream.write(request)
        env = await next_event(self.stream, self.decoder)
        if not isinstance(env, Envelope):
            raise RemoteProtocolError("expected a response envelope")
        return cx.parse_response(env, req_id, kind)

    async def close(self) -> None:
        if self.stream is not None:
            with trio.move_on_after(2):
                with contextlib.suppress(Exception):
                    await self.stream.close()


@dataclass
class PullResult:
    """What a pull moved, and from whom (`node ckpt pull` prints it)."""

    manifest: ck.CheckpointManifest
    seconds: float = 0.0
    chunks_local: int = 0  # already on disk, not fetched
    bytes_by_peer: dict[str, int] = field(default_factory=dict)
    chunks_by_peer: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # peer -> why it was dropped

    @property
    def fetched_bytes(self) -> int:
        return sum(self.bytes_by_peer.values())


async def pull(substrate: Substrate, providers: list[ID], cid: str, store: CheckpointStore,
               *, chunk_timeout: float = 30.0,
               progress: Callable[[int, int], None] = lambda done, total: None,
               check: Callable[[ck.CheckpointManifest], None] | None = None) -> PullResult:
    """Fetch checkpoint `cid` into `store`; CheckpointError if no provider can serve it.

    `check` sees the verified manifest before any chunk is fetched and may refuse it by
    raising CheckpointError (`node ckpt pull --run` does, for another run's checkpoint).
    """
    started = time.monotonic()
    manifest, reasons = None, []
    lacking: set[ID] = set()  # said "not held here": no chunk worker for them
    for peer in providers:
        session = _Session(substrate, peer)
        try:
            with trio.fail_after(chunk_timeout):
                req = next(_ids)
                data = await session.ask(cx.request_manifest(req, cid), req, "ckpt.manifest")
            manifest = ck.decode(data, expected_cid=cid)
            break
        except trio.TooSlowError:
            reasons.append(f"{peer}: no answer within {chunk_timeout:g} s")
        except LookupError as e:
            lacking.add(peer)
            reasons.append(f"{peer}: {e}")
        except Exception as e:
            reasons.append(f"{peer}: {e}")
        finally:
            await session.close()
    if manifest is None:
        raise CheckpointError(f"no provider served checkpoint {cid}:\n  "
                              + "\n  ".join(reasons or ["(no providers)"]))
    if check is not None:
        check(manifest)
    result = PullResult(manifest)
    store.chunks.mkdir(parents=True, exist_ok=True)
    todo = [i for i, d in enumerate(manifest.chunks) if not (store.chunks / d).exists()]
    total, done = len(manifest.chunks), len(manifest.chunks) - len(todo)
    result.chunks_local = done
    progress(done, total)
    send, receive = trio.open_memory_channel[int](len(todo) + 1)
    for i in todo:
        send.send_nowait(i)
    remaining = set(todo)
    finished = trio.Event()
    if not remaining:
        finished.set()

    async def worker(peer: ID) -> None:
        nonlocal done
        name = peer.to_base58()
        session = _Session(substrate, peer)
        try:
            while not finished.is_set():
                index = None
                with trio.move_on_after(0.2):  # only the wait for work is bounded this way
                    index = await receive.receive()
                if index is None:
                    continue
                try:
                    with trio.fail_after(chunk_timeout):  # a stalled provider is dropped
                        req = next(_ids)
                        data = await session.ask(cx.request_chunk(req, cid, index), req,
                                                 "ckpt.chunk")
                    store.put_chunk(manifest.chunks[index], data)
                except (Exception, trio.TooSlowError) as e:
                    log.info("chunk %d from %s failed (%r); another provider takes it",
                             index, peer, e)
                    result.failures[name] = (f"chunk {index}: no answer within "
                                             f"{chunk_timeout:g} s"
                                             if isinstance(e, trio.TooSlowError)
                                             else f"chunk {index}: {e}")
                    send.send_nowait(index)
                    return
                result.bytes_by_peer[name] = result.bytes_by_peer.get(name, 0) + len(data)
                result.chunks_by_peer[name] = result.chunks_by_peer.get(name, 0) + 1
                remaining.discard(index)
                done += 1
                progress(done, total)
                if not remaining:
                    finished.set()
        finally:
            await session.close()

    async with trio.open_nursery() as nursery:
        for peer in providers:
            if peer not in lacking:
                nursery.start_soon(worker, peer)
    if remaining:
        why = "".join(f"\n  {p}: {r}" for p, r in sorted(result.failures.items()))
        raise CheckpointError(f"checkpoint {cid}: {len(remaining)} of {total} chunks could not "
                              f"be fetched from any provider:{why}")
    store.put_manifest(cid, manifest.encode())
    result.seconds = time.monotonic() - started
    return result
