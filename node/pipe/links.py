"""The `/peertrain/pipe/1.0.0` stream adapter: protocols/pipeline.py's sans-IO receiver
pumped from libp2p streams, bounded queues both ways, deadlines on every write.

Inbound (`serve_stream`): each message is decoded and checked by `PipeReceiver` before
anything is allocated, then the sender is checked against the stage map (`claim`: a peer
sending activations to stage s must host stage s - 1, and so on), then it is offered to
the stage's `Inbox`, which holds at most `capacity` messages: one more is refused with a
logged reason and never queued (a flood costs the flooder its micro-batches, not our
memory). A message refused for its values (NaN, inf, targets outside the vocabulary) is
dropped and its micro-batch reported lost. Any other violation closes the stream with a
`RemoteProtocolError` naming it.

Outbound (`Outbox`): one writer task per peer, fed by a bounded channel, opens its
stream when it has something to send and keeps it; a write that fails or outlives its
deadline closes the stream, and every message that was queued for that peer is reported
lost (`on_lost`), so the worker drops those micro-batches at once instead of waiting.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import trio

from node.transport.lane import LaneListener, LaneStream, connect_lane
from node.transport.streams import StreamEnded, close_quietly, next_event, pump, write_chunks
from protocols import pipeline as pipe
from protocols.errors import RemoteProtocolError

log = logging.getLogger("node.pipeline")

IDLE_S = 300.0  # an inbound stream with no message for this long is closed
# Generous: a live peer on a loaded machine (a testnet of many nodes on 2 cores) took
# more than 5 s to answer a stream's negotiation; a dead one leaves the stage map anyway.
OPEN_S = 15.0  # opening a stream to the next stage
WRITE_S = 30.0  # one message's write
LANE_ACCEPT_S = 5.0  # a receiver waits this long for the sender's lane to connect
LANE_CONNECT_S = 2.0  # ... and a sender this long to connect it
LANE_RETRY_S = 300.0  # a peer whose lane failed gets the libp2p stream this long


@dataclass(frozen=True, slots=True)
class Message:
    """What the worker gets: a checked tensor, its header and who sent it."""

    kind: str
    step: int
    mb: int
    tensor: Any
    sender: str
    hop: int  # the micro-batch's visit it is for (protocols/pipeline.py)
    origin: str = ""  # the first-stage replica that cut the micro-batch ("" not given)


@dataclass(frozen=True, slots=True)
class Lost:
    """A micro-batch that will not come back: a refused or unsendable message."""

    kind: str
    step: int
    mb: int
    reason: str
    origin: str = ""


class Inbox:
    """The stage's bounded queue between the trio thread and the trainer thread."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._q: queue.Queue[Message | Lost] = queue.Queue(maxsize=capacity)
        self.refused: Counter[str] = Counter()

    def offer(self, item: Message | Lost) -> str | None:
        """Queue `item`; the reason it was refused, or None."""
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self.refused["queue full"] += 1
            return f"the stage's queue holds {self.capacity} messages"
        return None

    def get(self, timeout: float) -> Message | Lost | None:
        try:
            return self._q.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def qsize(self) -> int:
        return self._q.qsize()


async def messages(stream: Any, receiver: pipe.PipeReceiver, idle_s: float = IDLE_S
                   ) -> AsyncIterator[pipe.Event]:
    """Every event of one inbound stream, until it ends between two messages (a clean
    close); an end inside a message is `StreamEnded`, a violation `RemoteProtocolError`."""
    while True:
        with trio.move_on_after(idle_s) as idle:
            try:
                event = await pump(stream, receiver.next_event, receiver.receive_data)
            except StreamEnded:
                if receiver.between_messages:
                    return
                raise
        if idle.cancelled_caught:
            return
        yield event


async def serve_stream(stream: Any, peer: str, expect: pipe.Expect,
                       claim: Callable[[str, pipe.MessageHeader], str | None], inbox: Inbox,
                       counters: Counter[str], lane_host: str | None = None) -> None:
    """Feed one inbound stream's messages to `inbox` (see the module docstring).
    `claim(peer, header)` returns why `peer` may not send this message here (its stage
    map says it hosts no stage the micro-batch's previous or next visit is on, or we host
    another stage now). A sender that asks for a bulk lane first gets one where
    `lane_host` is given (we listen there), and its messages are then read from the lane,
    as `peer`'s: the libp2p stream authenticated it, and the lane's key was handed over
    that stream only."""
    receiver = pipe.PipeReceiver(expect)
    async for event in messages(stream, receiver):
        if isinstance(event, pipe.LaneAsked):
            if lane_host is None:
                await stream.write(pipe.encode_no_lane("this node offers no lanes"))
                continue
            listener, lane = LaneListener(lane_host), None
            try:
                port = await listener.open()
                await stream.write(pipe.encode_lane_offer(port, listener.key))
                lane = await listener.accept(timeout=LANE_ACCEPT_S)
            except (OSError, trio.TooSlowError) as e:  # the sender goes on on the stream
                counters["lanes failed"] += 1
                log.info("pipe lane from %s not connected (%r)", peer, e)
            finally:
                await listener.aclose()
            if lane is None:
                continue
            counters["lanes accepted"] += 1
            try:
                await _feed(lane, pipe.PipeReceiver(expect), peer, claim, inbox, counters)
            finally:
                await close_quietly(lane)
            return
        _offer(event, peer, claim, inbox, counters)


async def _feed(source: Any, receiver: pipe.PipeReceiver, peer: str,
                claim: Callable[[str, pipe.MessageHeader], str | None], inbox: Inbox,
                counters: Counter[str]) -> None:
    async for event in messages(source, receiver):
        if isinstance(event, pipe.LaneAsked):  # the receiver allows it first only
            raise RemoteProtocolError("a lane inside a lane")
        _offer(event, peer, claim, inbox, counters)


def _offer(event: pipe.TensorReceived | pipe.Refused, peer: str,
           claim: Callable[[str, pipe.MessageHeader], str | None], inbox: Inbox,
           counters: Counter[str]) -> None:
    h = event.header
    problem = claim(peer, h)
    if problem is not None:
        counters["refused: stage claim"] += 1
        raise RemoteProtocolError(problem)
    if isinstance(event, pipe.Refused):
        counters["refused: values"] += 1
        log.warning("refused %s from %s: %s", h.kind, peer, event.reason,
                    extra={"peer": peer, "reason": "pipe values"})
        inbox.offer(Lost(h.kind, h.step, h.mb, event.reason, h.origin))
        return
    nbytes = event.tensor.numel() * (8 if h.kind == "tgt" else 2)
    counters[f"received {h.kind}"] += 1
    counters[f"received bytes {h.kind}"] += nbytes
    reason = inbox.offer(Message(h.kind, h.step, h.mb, event.tensor, peer, h.hop, h.origin))
    if reason is not None:
        log.warning("refused %s of step %d micro-batch %d from %s: %s", h.kind, h.step,
                    h.mb, peer, reason, extra={"peer": peer, "reason": "pipe full"})


@dataclass(frozen=True, slots=True)
class Outgoing:
    kind: pipe.Kind
    stage: int  # the receiver's stage
    step: int
    mb: int
    tensor: Any
    hop: int | None = None  # the receiver's visit (protocols/pipeline.py); None: `stage`
    origin: str = ""  # the first-stage replica that cut the micro-batch


class Outbox:
    """Writer tasks, one per peer, each with a bounded queue of `capacity` messages."""

    def __init__(self, substrate: Any, run_id: str, capacity: int,
                 on_lost: Callable[[Outgoing, str], None], *, lanes: bool = True,
                 path_of: Callable[[str], str] = lambda peer: "direct",
                 stalls: Any = None) -> None:
        self.substrate = substrate
        self.run_id = run_id
        self.capacity = capacity
        self.on_lost = on_lost
        # Bulk lanes to peers on a direct path (`path_of`, node/reach/paths.py): a lane
        # is a fresh TCP dial to the address the stream came from, which a relay or a
        # punched NAT would not forward. One that failed is not asked for again for
        # LANE_RETRY_S; the libp2p stream carries the messages meanwhile.
        self.lanes = lanes
        self.path_of = path_of
        self.lane_failed: dict[str, float] = {}
        self.paths: dict[str, str] = {}  # peer -> "lane" or "stream", as last opened
        self._queues: dict[str, trio.MemorySendChannel[Outgoing]] = {}
        self._nursery: trio.Nursery | None = None
        self.counters: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # peer -> failed writes
        # node/pipe/fetch.Stalls: a peer whose streams only time out gets a fresh connection
        self.stalls = stalls

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await trio.sleep_forever()

    def send(self, peer: str, msg: Outgoing) -> None:
        """Queue `msg` for `peer` (trio thread, never blocks); a full queue loses it."""
        chan = self._queues.get(peer)
        if chan is None:
            if self._nursery is None:
                self.on_lost(msg, "the outbox is not running")
                return
            chan, receive = trio.open_memory_channel[Outgoing](self.capacity)
            self._queues[peer] = chan
            self._nursery.start_soon(self._writer, peer, receive)
        try:
            chan.send_nowait(msg)
        except trio.WouldBlock:
            self.counters["lost: queue full"] += 1
            self.on_lost(msg, f"{self.capacity} messages already queued for {peer}")

    async def _writer(self, peer: str, receive: trio.MemoryReceiveChannel[Outgoing]) -> None:
        from libp2p.peer.id import ID

        stream = lane = None
        async for msg in receive:
            try:
                if stream is None:
                    with trio.fail_after(OPEN_S):
                        stream = await self.substrate.open_stream(ID.from_base58(peer),
                                                                  pipe.PROTOCOL_ID)
                    lane = await self._ask_lane(peer, stream)
                    self.paths[peer] = "lane" if lane is not None else "stream"
                chunks = pipe.encode(msg.kind, self.run_id, msg.stage, msg.step, msg.mb,
                                     msg.tensor, msg.hop, msg.origin)
                t0 = time.monotonic()
                with trio.fail_after(WRITE_S):
                    await write_chunks(lane or stream, chunks)
                self.counters[f"sent {msg.kind}"] += 1
                self.counters[f"sent bytes {msg.kind}"] += sum(
                    len(memoryview(c).cast("B")) for c in chunks[2:])
                self.counters["write_ms"] += int((time.monotonic() - t0) * 1000)
                if self.stalls is not None:
                    self.stalls.ok(peer)
            except Exception as e:  # a dead or slow peer: this message and the queue lost
                self.failures[peer] += 1
                if isinstance(e, trio.TooSlowError) and self.stalls is not None:
                    await self.stalls.timed_out(peer)
                log.info("pipe to %s failed (%r): %s of step %d micro-batch %d lost", peer, e,
                         msg.kind, msg.step, msg.mb)
                self.on_lost(msg, f"send to {peer} failed: {e!r}")
                for open_ in (lane, stream):
                    if open_ is not None:
                        await close_quietly(open_)
                stream = lane = None
                while True:  # what waited behind it would only time out too
                    try:
                        self.on_lost(receive.receive_nowait(), f"send to {peer} failed")
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break

    async def _ask_lane(self, peer: str, stream: Any) -> LaneStream | None:
        """A bulk lane to `peer`, asked for on the fresh `stream`; None where there is
        none to be had (not a direct path, refused, failed lately, unreachable)."""
        failed = self.lane_failed.get(peer)
        if failed is not None and time.monotonic() - failed < LANE_RETRY_S:
            return None
        if not self.lanes or self.path_of(peer) != "direct":
            return None
        self.lane_failed[peer] = time.monotonic()  # until it connects
        try:
            with trio.fail_after(pipe.LANE_REPLY_LIMITS.deadline_s or 5.0):
                await stream.write(pipe.encode_lane_request(self.run_id))
                reply = pipe.parse_lane_reply(
                    await next_event(stream, pipe.LANE_REPLY_LIMITS.decoder()))
            if isinstance(reply, str):
                log.info("pipe to %s: no lane (%s); the stream carries it", peer, reply)
                return None
            lane = await connect_lane(stream.get_remote_address()[0], *reply,
                                      timeout=LANE_CONNECT_S)
        except (OSError, trio.TooSlowError, RemoteProtocolError, StreamEnded, TypeError) as e:
            log.info("pipe to %s: lane failed (%r); the stream for %.0f s", peer, e,
                     LANE_RETRY_S)
            return None
        del self.lane_failed[peer]
        return lane

    def statistics(self) -> dict[str, Any]:
        return {"queued": {p: c.statistics().current_buffer_used
                           for p, c in self._queues.items()},
                "failures": dict(self.failures), "paths": dict(self.paths)}

