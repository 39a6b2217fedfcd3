"""Serving and pulling checkpoints over `/peertrain/ckpt/1.0.0`.

`pull` fetches the manifest from the first provider whose bytes hash to the cid, then the
chunks from every provider in parallel: one worker per provider takes the next missing
chunk from a shared queue, and a chunk that fails (timeout, stall, wrong hash, refusal) goes
back into the queue while that provider is dropped. Chunks already on disk are skipped, so
an interrupted pull resumes where it stopped. Nothing is loaded that failed verification.

Chunks travel on a bulk lane (node/transport/lane.py) when the provider offers one, LANE_WINDOW
requests in flight; else (an older node, a lane that cannot be reached, a busy server) on
the libp2p stream, one request at a time. Why: the provider is usually a trainer, and
beside its trainer thread the stream served ~10 MB/s, 60% of it in Yamux/Noise writes and
the rest in one round trip per 4 MiB chunk (docs/benchmarks.md, "Joining mid-run").
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from node.checkpoints.holders import MAX_UPLOADS, UploadSlots
from node.checkpoints.store import CheckpointError, CheckpointStore
from node.service import NodeContext
from node.transport.lane import LaneListener, LaneStream, connect_lane, listen_host
from node.transport.streams import StreamEnded, next_event
from p2p.host import Substrate
from protocols import checkpoint as ck
from protocols import ckpt_exchange as cx
from protocols.errors import RemoteProtocolError
from protocols.wire import Envelope

log = logging.getLogger("node.ckpt")
_ids = itertools.count(1)

LANE_WINDOW = 4  # chunk requests in flight on one lane (16 MiB)
MAX_LANES = 4  # lanes a server serves at once (each holds ~16 MiB of buffers)
LANE_ACCEPT_S = 5.0  # how long an offered lane waits for its asker to connect
LANE_CONNECT_S = 2.0  # how long the asker tries to reach an offered lane


class CheckpointServer:
    """Serves the checkpoints in our store, on every node (a bootstrap too): one stream is
    a session of requests in sequence, each answered from disk in a worker thread."""

    name = "checkpoint_server"
    protocols = (cx.PROTOCOL_ID,)

    def __init__(self, store: CheckpointStore, lane_host: str = "127.0.0.1",
                 lanes: bool = True, max_uploads: int = MAX_UPLOADS) -> None:
        self.store = store
        # At most max_uploads askers served at once (a stream and a lane of one asker count
        # once); the next is refused as busy and its pull moves to its other holders.
        self.uploads = UploadSlots(max_uploads)
        self.lane_host, self.lanes = lane_host, lanes  # where lanes listen; offered at all?
        self.served = 0
        self.missing = 0
        self.served_on_lanes = 0  # of `served`: chunks sent on a bulk lane
        self.lanes_open = 0
        self.lanes_refused = 0  # asked while MAX_LANES were open: the stream carries on
        self.lane_dialable: Callable[[], bool] = lambda: True  # NodeContext's, once running

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.lane_host = listen_host(ctx.substrate)
        self.lane_dialable = ctx.transports.lane_dialable
        ctx.transports.serve(cx.PROTOCOL_ID, self.handle)
        task_status.started()
        await trio.sleep_forever()

    def statistics(self) -> dict[str, Any]:
        return {"served": self.served, "not_held": self.missing,
                "uploads": self.uploads.askers, "max_uploads": self.uploads.cap,
                "refused_busy": self.uploads.refused,
                "served_on_lanes": self.served_on_lanes, "lanes_open": self.lanes_open,
                "lanes_refused": self.lanes_refused}

    async def handle(self, stream: INetStream) -> None:
        decoder = cx.REQUEST_LIMITS.decoder()
        asker = _asker(stream)
        slot = False  # one of the `uploads` slots, taken on the first request
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
                if not slot:
                    if not self.uploads.acquire(asker):  # its pull asks its other holders
                        await stream.write(cx.refuse(
                            env, f"busy: serving {self.uploads.cap} askers", "busy"))
                        return
                    slot = True
                if kind == "ckpt.lane":
                    await self._offer_lane(stream, env, cid)
                    return  # the session goes on on the lane, if at all
                data = await trio.to_thread.run_sync(_read, self.store, kind, cid, index)
                if data is None:
                    self.missing += 1
                else:
                    self.served += 1
                await stream.write(cx.respond(env, data, index))
        finally:
            if slot:
                self.uploads.release(asker)
            await stream.close()

    async def _offer_lane(self, stream: INetStream, env: Envelope, cid: str) -> None:
        if not self.store.latest_ok(cid):
            self.missing += 1
            await stream.write(cx.refuse(env))
            return
        if not self.lanes or self.lanes_open >= MAX_LANES:
            self.lanes_refused += self.lanes
            await stream.write(cx.refuse(env, "no lane now: ask on the stream", "busy"))
            return
        if not self.lane_dialable():  # behind a NAT: the asker could not connect to it
            await stream.write(cx.refuse(env, "no lane here: ask on the stream", "busy"))
            return
        self.lanes_open += 1
        try:
            listener = LaneListener(self.lane_host)
            try:
                port = await listener.open()
                await stream.write(cx.respond_lane(env, port, listener.key))
                lane = await listener.accept(timeout=LANE_ACCEPT_S)
            finally:
                await listener.aclose()
            try:
                await self._serve_lane(lane)
            finally:
                await lane.close()
        finally:
            self.lanes_open -= 1

    async def _serve_lane(self, lane: LaneStream) -> None:
        """Answer chunk requests in order until the asker hangs up. Two chunk buffers: the
        next chunk is read from disk (in a worker thread) while this one is sealed from its
        buffer and sent; nothing is copied in between."""
        decoder = cx.REQUEST_LIMITS.decoder()
        free_in, free = trio.open_memory_channel[memoryview](2)
        for _ in range(2):
            free_in.send_nowait(memoryview(bytearray(ck.CHUNK_BYTES)))
        to_send, sending = trio.open_memory_channel[tuple[Envelope, memoryview, int | None]](1)

        async def read_requests() -> None:
            async with to_send:
                while True:
                    with trio.fail_after(cx.REQUEST_LIMITS.deadline_s or 30.0):
                        try:
                            env = await next_event(lane, decoder)
                        except StreamEnded:
                            return
                    if not isinstance(env, Envelope):
                        raise RemoteProtocolError("expected a request")
                    kind, cid, index = cx.parse_request(env)
                    if kind != "ckpt.chunk":
                        raise RemoteProtocolError(f"{kind} on a lane: only chunks go there")
                    buffer = await free.receive()
                    n = await trio.to_thread.run_sync(_read_into, self.store, cid, index,
                                                      buffer)
                    await to_send.send((env, buffer, n))

        async def send_chunks() -> None:
            async for env, buffer, n in sending:
                if n is None:
                    self.missing += 1
                    await lane.write(cx.refuse(env))
                else:
                    await lane.write(cx.chunk_header(env, n))
                    await lane.write(buffer[:n])
                    self.served += 1
                    self.served_on_lanes += 1
                free_in.send_nowait(buffer)

        errors = await _together(read_requests, send_chunks)
        if errors:
            raise errors[0]  # as one handler's error, for the guard to classify


def _asker(stream: Any) -> str:
    """The peer at the other end of `stream` (its id; a test's bare stream: its own id)."""
    peer = getattr(getattr(stream, "muxed_conn", None), "peer_id", None)
    return peer.to_base58() if peer is not None else f"stream-{id(stream)}"


async def _together(*tasks: Callable[[], Any]) -> list[Exception]:
    """Run `tasks` concurrently; the first to fail cancels the others. Their errors, plain
    (no exception group), first one first."""
    errors: list[Exception] = []

    async def guarded(task: Callable[[], Any], scope: trio.CancelScope) -> None:
        try:
            await task()
        except Exception as e:
            errors.append(e)
            scope.cancel()

    async with trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(guarded, task, nursery.cancel_scope)
    return errors


async def _lane_chunk(lane: LaneStream, req: int, index: int, size: int) -> bytearray:
    """Chunk `index` from a lane: its header (one envelope in one record, checked against
    the request and the manifest's `size`), then exactly `size` bytes opened in place."""
    plain = await lane.read()
    if not plain:
        raise StreamEnded(f"lane closed before chunk {index}")
    cx.parse_chunk_header_record(plain, req, index, size)
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = await lane.read_into(view[got:])
        if type(n) is not int:
            raise (RemoteProtocolError(f"chunk {index}: a record runs past its {size} bytes")
                   if n else StreamEnded(f"lane closed in the middle of chunk {index}"))
        got += n
    return data


def _read_into(store: CheckpointStore, cid: str, index: int | None,
               buffer: memoryview) -> int | None:
    """Chunk `index` of `cid` read into `buffer`; its size, or None if not held."""
    try:
        m = store.manifest(cid)
        if index is None or index >= len(m.chunks):
            return None
        with open(store.chunks / m.chunks[index], "rb") as f:
            n = f.readinto(buffer)
            if f.read(1):  # a chunk file larger than a chunk is not ours to send
                return None
        return n
    except (OSError, CheckpointError):
        return None


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

    def __init__(self, substrate: Substrate, peer: ID,
                 open_stream: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.substrate, self.peer = substrate, peer
        self.open_stream = open_stream or substrate.open_stream
        self.stream: INetStream | None = None
        self.decoder = cx.RESPONSE_LIMITS.decoder()

    async def ask(self, request: bytes, req_id: int, kind: str) -> bytes:
        return cx.parse_response(await self.ask_envelope(request), req_id, kind)

    async def ask_envelope(self, request: bytes) -> Envelope:
        if self.stream is None:
            self.stream = await self.open_stream(self.peer, cx.PROTOCOL_ID, lazy=True)
        await self.stream.write(request)
        env = await next_event(self.stream, self.decoder)
        if not isinstance(env, Envelope):
            raise RemoteProtocolError("expected a response envelope")
        return env

    async def open_lane(self, cid: str) -> LaneStream | None:
        """A bulk lane to the provider for `cid`'s chunks; None if it offers none now.
        LookupError if it does not hold `cid`."""
        req = next(_ids)
        try:
            env = await self.ask_envelope(cx.request_lane(req, cid))
            port, key = cx.parse_lane(env, req)
        except LookupError as e:
            if "no lane" in str(e):
                return None  # busy: the stream carries the chunks
            raise
        assert self.stream is not None
        remote = self.stream.get_remote_address()
        if remote is None:  # a data channel has no address to dial: the stream carries on
            return None
        return await connect_lane(remote[0], port, key, timeout=LANE_CONNECT_S)

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
    paths: dict[str, str] = field(default_factory=dict)  # peer -> "lane", "stream", "webrtc"
    asked: int = 0  # providers asked, the lookup's (more_providers) included

    @property
    def fetched_bytes(self) -> int:
        return sum(self.bytes_by_peer.values())


async def pull(substrate: Substrate, providers: list[ID], cid: str, store: CheckpointStore,
               *, chunk_timeout: float = 30.0,
               progress: Callable[[int, int], None] = lambda done, total: None,
               check: Callable[[ck.CheckpointManifest], None] | None = None,
               lanes: bool = True,
               more_providers: Callable[[], Awaitable[list[ID]]] | None = None,
               open_stream: Callable[..., Awaitable[Any]] | None = None,
               path_of: Callable[[str], str] | None = None) -> PullResult:
    """Fetch checkpoint `cid` into `store`; CheckpointError if no provider can serve it.

    `check` sees the verified manifest before any chunk is fetched and may refuse it by
    raising CheckpointError (`node ckpt pull --run` does, for another run's checkpoint).
    `lanes`: ask each provider for a bulk lane first (else the libp2p stream only).
    `more_providers`: a lookup (the DHT's) that runs while `providers` are pulled from;
    the peers it names are used too, as soon as it returns (or first, if none of
    `providers` serves the manifest). A joiner then does not wait for the lookup when the
    checkpoint's writer is at hand.
    `open_stream`: where streams come from (a node passes the webrtc service's: a data
    channel to a provider reached only through a relay); `path_of`: each provider's path
    kind (node/reach/paths.py), so lanes are asked of `direct` providers only (a lane is a
    new TCP dial to the provider's address: through a relay or a NAT it cannot connect).
    """
    started = time.monotonic()
    reasons: list[str] = []
    lacking: set[ID] = set()  # said "not held here": no chunk worker for them
    providers = list(providers)
    lookup: list[ID] | None = None  # what more_providers returned, once it has
    looked_up = trio.Event()

    async def look_up() -> None:
        nonlocal lookup
        assert more_providers is not None
        try:
            lookup = [p for p in await more_providers() if p not in providers]
        except Exception as e:  # the pull goes on with the providers it has
            log.info("checkpoint %s: provider lookup failed (%r)", cid, e)
            lookup = []
        looked_up.set()

    result: PullResult | None = None
    error: Exception | None = None
    ahead: dict[ID, Any] = {}  # _Pull's lanes asked beside a manifest request
    async with trio.open_nursery() as outer:
        if more_providers is not None:
            outer.start_soon(look_up)
        else:
            looked_up.set()
        try:
            result = await _Pull(
                lambda peer: _Session(substrate, peer, open_stream), providers, cid, store,
                chunk_timeout=chunk_timeout, progress=progress, check=check,
                lane_for=lambda name: lanes and (path_of is None or path_of(name) == "direct"),
                route_of=lambda name: ("webrtc" if path_of and path_of(name) == "webrtc"
                                       else "stream"),
                started=started, lacking=lacking, reasons=reasons, looked_up=looked_up,
                found=lambda: lookup or [], ahead=ahead).run()
        except Exception as e:  # raised below, plain: not in the nursery's exception group
            error = e
        finally:
            outer.cancel_scope.cancel()
            for lane in ahead.values():  # asked, then not taken (its manifest failed)
                if isinstance(lane, LaneStream):
                    with trio.CancelScope(shield=True), trio.move_on_after(2), \
                            contextlib.suppress(Exception):
                        await lane.close()
    if error is not None:
        raise error
    assert result is not None
    return result


class _Pull:
    """One checkpoint pull: the manifest from the first provider that serves it (its lane
    asked for beside), then every missing chunk from every provider at once, each worker
    taking the next index from one shared queue (on its lane, or on the stream one at a
    time); a provider that fails is dropped and its chunks go back to the queue.

    `lane_for(peer)`: ask it for a lane (only on direct paths); `route_of(peer)`: what
    carries its stream ("stream" or "webrtc"); `found()`: the providers the lookup returned
    once `looked_up` is set. `lacking` and `reasons` are the caller's, for its error;
    `ahead` holds the lanes asked beside the manifest (the caller closes what is left)."""

    def __init__(self, session_for: Callable[[ID], _Session], providers: list[ID], cid: str,
                 store: CheckpointStore, *, chunk_timeout: float,
                 progress: Callable[[int, int], None],
                 check: Callable[[ck.CheckpointManifest], None] | None,
                 lane_for: Callable[[str], bool], route_of: Callable[[str], str],
                 started: float, lacking: set[ID], reasons: list[str],
                 looked_up: trio.Event, found: Callable[[], list[ID]],
                 ahead: dict[ID, Any]) -> None:
        self.session_for, self.providers, self.cid, self.store = (
            session_for, providers, cid, store)
        self.chunk_timeout, self.progress, self.check = chunk_timeout, progress, check
        self.lane_for, self.route_of, self.started = lane_for, route_of, started
        self.lacking, self.reasons, self.looked_up = lacking, reasons, looked_up
        self.found, self.ahead = found, ahead
        self.finished = trio.Event()
        self.remaining: set[int] = set()
        self.done = self.total = 0
        self.send, self.receive = trio.open_memory_channel[int](0)  # sized in run()

    async def run(self) -> PullResult:
        manifest = self.manifest = await self._manifest()
        if self.check is not None:
            self.check(manifest)
        result = self.result = PullResult(manifest)
        store = self.store
        store.chunks.mkdir(parents=True, exist_ok=True)
        todo = [i for i, d in enumerate(manifest.chunks) if not (store.chunks / d).exists()]
        self.total, self.done = len(manifest.chunks), len(manifest.chunks) - len(todo)
        result.chunks_local = self.done
        self.progress(self.done, self.total)
        self.send, self.receive = trio.open_memory_channel[int](len(todo) + 1)
        for i in todo:
            self.send.send_nowait(i)
        self.remaining = set(todo)
        if not self.remaining:
            self.finished.set()
        async with trio.open_nursery() as nursery:
            for peer in self.providers:
                if peer not in self.lacking:
                    nursery.start_soon(self._worker, peer)
            nursery.start_soon(self._later_providers, nursery)
        if self.remaining:
            why = "".join(f"\n  {p}: {r}" for p, r in sorted(result.failures.items()))
            raise CheckpointError(f"checkpoint {self.cid}: {len(self.remaining)} of "
                                  f"{self.total} chunks could not be fetched from any "
                                  f"provider:{why}")
        store.put_manifest(self.cid, manifest.encode())
        result.seconds = time.monotonic() - self.started
        result.asked = len(self.providers)
        log.info("checkpoint %s: %d chunks in %.2f s (%s)", self.cid,
                 self.total - result.chunks_local, result.seconds,
                 ", ".join(f"{p[:12]}…: {n} on the {result.paths.get(p)}"
                           for p, n in result.chunks_by_peer.items()))
        return result

    # -- the manifest ----------------------------------------------------------------------

    async def _manifest(self) -> ck.CheckpointManifest:
        """From the providers in order, then the lookup's; CheckpointError if none serves
        bytes that hash to the cid."""
        asked: list[ID] = []
        providers = self.providers
        while True:
            todo_peers = [p for p in providers if p not in asked]
            if not todo_peers:
                if self.looked_up.is_set() and not [p for p in self.found() if p not in asked]:
                    break
                await self.looked_up.wait()
                providers += [p for p in self.found() if p not in providers]
                continue
            peer = todo_peers[0]
            asked.append(peer)
            session = self.session_for(peer)
            try:
                manifest = ck.decode(await self._manifest_of(peer, session),
                                     expected_cid=self.cid)
            except trio.TooSlowError:
                self.reasons.append(f"{peer}: no answer within {self.chunk_timeout:g} s")
            except LookupError as e:
                self.lacking.add(peer)
                self.reasons.append(f"{peer}: {e}")
            except Exception as e:
                self.reasons.append(f"{peer}: {e}")
            else:
                log.info("checkpoint %s: manifest from %s after %.2f s (%d chunks)", self.cid,
                         peer, time.monotonic() - self.started, len(manifest.chunks))
                return manifest
            finally:
                await session.close()
        raise CheckpointError(f"no provider served checkpoint {self.cid}:\n  "
                              + "\n  ".join(self.reasons or ["(no providers)"]))

    async def _manifest_of(self, peer: ID, session: _Session) -> bytes:
        """`peer`'s manifest bytes (its error raised), its lane asked for beside."""
        answer: list[Any] = []

        async def ask(both: trio.Nursery) -> None:
            try:
                with trio.fail_after(self.chunk_timeout):
                    req = next(_ids)
                    answer.append(await session.ask(cx.request_manifest(req, self.cid), req,
                                                    "ckpt.manifest"))
            except Exception as e:  # raised below, outside the nursery
                answer.append(e)
                both.cancel_scope.cancel()  # no lane from a provider that failed

        async with trio.open_nursery() as both:
            if self.lane_for(peer.to_base58()):
                both.start_soon(self._lane_ahead, peer)
            await ask(both)
        if isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0]

    async def _lane_ahead(self, peer: ID) -> None:
        """The lane of the provider asked for the manifest, asked for at once on a second
        stream: its round trips (the request, then the TCP connect) overlap the manifest's
        instead of following them (0.4-0.8 s beside 4 trainers, `node bench join`). Kept in
        `ahead` for that provider's worker: a lane, None ("no lane now") or the error."""
        session = self.session_for(peer)
        try:
            with trio.fail_after(self.chunk_timeout):
                self.ahead[peer] = await session.open_lane(self.cid)
        except Exception as e:
            self.ahead[peer] = e
        finally:
            with trio.CancelScope(shield=True):
                await session.close()

    # -- the chunks --------------------------------------------------------------------------

    def _failed(self, name: str, indices: list[int], e: BaseException) -> None:
        """A provider is dropped; its chunks go back to the queue for the others."""
        log.info("chunk(s) %s from %s failed (%r); another provider takes them",
                 indices, name, e)
        first = indices[0] if indices else None
        self.result.failures[name] = (
            f"chunk {first}: no answer within {self.chunk_timeout:g} s"
            if isinstance(e, trio.TooSlowError) else f"chunk {first}: {e}")
        for index in indices:
            self.send.send_nowait(index)

    def _fetched(self, name: str, index: int, size: int) -> None:
        result = self.result
        result.bytes_by_peer[name] = result.bytes_by_peer.get(name, 0) + size
        result.chunks_by_peer[name] = result.chunks_by_peer.get(name, 0) + 1
        self.remaining.discard(index)
        self.done += 1
        self.progress(self.done, self.total)
        if not self.remaining:
            self.finished.set()

    async def _next_index(self) -> int | None:
        with trio.move_on_after(0.2):  # only the wait for work is bounded this way
            return await self.receive.receive()
        return None

    async def _next_index_or_done(self) -> None:
        with trio.move_on_after(0.2):
            await self.finished.wait()

    async def _on_stream(self, session: _Session, name: str) -> None:
        while not self.finished.is_set():
            index = await self._next_index()
            if index is None:
                continue
            try:
                with trio.fail_after(self.chunk_timeout):  # a stalled provider is dropped
                    req = next(_ids)
                    data = await session.ask(cx.request_chunk(req, self.cid, index), req,
                                             "ckpt.chunk")
                self.store.put_chunk(self.manifest.chunks[index], data)
            except (Exception, trio.TooSlowError) as e:
                self._failed(name, [index], e)
                return
            self._fetched(name, index, len(data))

    async def _on_lane(self, lane: LaneStream, name: str) -> None:
        """LANE_WINDOW requests in flight; each chunk is verified and written in a worker
        thread while the next one arrives. On any failure, every chunk this provider had
        taken and not stored goes back to the queue."""
        inflight: deque[tuple[int, int]] = deque()  # (index, request id), in order
        pending: set[int] = set()  # taken from the queue, not yet stored
        to_store, storing = trio.open_memory_channel[tuple[int, bytearray]](1)
        manifest = self.manifest

        async def receive_chunks() -> None:
            async with to_store:
                while not self.finished.is_set():
                    while len(inflight) < LANE_WINDOW:  # keep the provider busy
                        index: int | None
                        try:
                            index = self.receive.receive_nowait()
                        except trio.WouldBlock:
                            index = (None if inflight or pending
                                     else await self._next_index())
                        if index is None:
                            break
                        req = next(_ids)
                        inflight.append((index, req))
                        pending.add(index)
                        await lane.write(cx.request_chunk(req, self.cid, index))
                    if not inflight:
                        if pending:  # the last chunks are being stored
                            await self._next_index_or_done()
                        continue
                    index, req = inflight[0]
                    with trio.fail_after(self.chunk_timeout):  # a stalled provider: dropped
                        data = await _lane_chunk(lane, req, index,
                                                 manifest.chunk_size(index))
                    inflight.popleft()
                    await to_store.send((index, data))

        async def store_chunks() -> None:
            async for index, data in storing:  # hash checked in put_chunk
                await trio.to_thread.run_sync(self.store.put_chunk, manifest.chunks[index],
                                              data)
                pending.discard(index)
                self._fetched(name, index, len(data))

        errors = await _together(receive_chunks, store_chunks)
        if errors:
            self._failed(name, sorted(pending), errors[0])

    async def _worker(self, peer: ID) -> None:
        """One provider's share: on its lane if it gives one, else on its stream."""
        name, result = peer.to_base58(), self.result
        session = self.session_for(peer)
        try:
            lane = None
            if self.lane_for(name):
                try:
                    if peer in self.ahead:  # asked beside the manifest request
                        lane = self.ahead.pop(peer)
                        if isinstance(lane, BaseException):
                            raise lane
                    else:
                        with trio.fail_after(self.chunk_timeout):
                            lane = await session.open_lane(self.cid)
                except LookupError as e:  # not held there after all
                    result.failures[name] = str(e)
                    return
                except trio.TooSlowError:  # a stalled provider is dropped, as for a chunk
                    result.failures[name] = f"no answer within {self.chunk_timeout:g} s"
                    return
                except Exception as e:
                    log.info("no bulk lane to %s (%r); the libp2p stream carries the chunks",
                             name, e)
                if lane is not None or session.stream is not None:
                    await session.close()  # the lane request ended that stream's session
                    session = self.session_for(peer)
            if lane is None:
                result.paths[name] = self.route_of(name)
                await self._on_stream(session, name)
                return
            result.paths[name] = "lane"
            log.info("checkpoint %s: lane to %s open after %.2f s", self.cid, name,
                     time.monotonic() - self.started)
            try:
                await self._on_lane(lane, name)
            finally:
                with trio.move_on_after(2):
                    with contextlib.suppress(Exception):
                        await lane.close()
        finally:
            await session.close()

    async def _later_providers(self, nursery: trio.Nursery) -> None:
        """The lookup's providers join in when it returns, unless we are done by then."""
        while not self.looked_up.is_set() and not self.finished.is_set():
            with trio.move_on_after(0.2):
                await self.looked_up.wait()
        for peer in self.found():
            if peer not in self.providers and not self.finished.is_set():
                self.providers.append(peer)
                nursery.start_soon(self._worker, peer)
