"""The thin pump between a libp2p stream and a sans-IO frame decoder (protocols/wire.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import trio
from libp2p.network.stream.exceptions import StreamEOF

from p2p.gate import discard_unread
from protocols.errors import RemoteProtocolError
from protocols.wire import NEED_DATA, Envelope, FrameDecoder, TensorFrame

READ_SIZE = 1 << 20


class StreamEnded(RemoteProtocolError):
    """The stream ended where a message was expected: churn (a peer that left) as often as
    misbehaviour, so the guard scores it as a broken stream, not an invalid message."""


class InPlace(Protocol):
    """A core that can take bytes written straight into its memory (FrameDecoder,
    averaging.Exchange): see FrameDecoder.receive_buffer."""

    def receive_buffer(self) -> memoryview | None: ...

    def received_into(self, n: int) -> None: ...


class ByteStream(Protocol):
    """A stream as the services use it, whichever transport carries it: a libp2p stream
    (INetStream, or p2p/lazy_select.py's proxy of one), the bulk lane
    (node/transport/lane.LaneStream) and a WebRTC data channel
    (node/webrtc/channel.DataChannelStream) all read, write and close alike."""

    async def read(self, n: int = ...) -> bytes | memoryview: ...
    async def write(self, data: bytes) -> Any: ...
    async def close(self) -> None: ...


async def pump(stream: ByteStream, next_event: Callable[[], Any],
               feed: Callable[[bytes], None], into: InPlace | None = None) -> Any:
    """Read from `stream` into a sans-IO core until it yields an event (not NEED_DATA).

    With `into` (the core) and a stream that has `read_into` (node/transport/lane.LaneStream),
    whatever lands where the core wants it (a tensor payload: for fp32 the receive vector
    itself) is opened there, not copied in by `feed`.

    EOF before a whole message is the peer's doing: StreamEnded (a RemoteProtocolError).
    """
    read_into = getattr(stream, "read_into", None) if into is not None else None
    while True:
        event = next_event()
        if event is not NEED_DATA:
            return event
        buffer = into.receive_buffer() if into is not None and read_into is not None else None
        if buffer is not None:
            assert into is not None and read_into is not None
            data = await read_into(buffer)
            if type(data) is int:  # that many bytes are in place
                into.received_into(data)
                continue
        else:
            try:
                data = await stream.read(READ_SIZE)
            except StreamEOF:
                data = b""
        if not data:
            raise StreamEnded("stream ended in the middle of a message")
        feed(data)


async def next_event(stream: ByteStream, decoder: FrameDecoder) -> Envelope | TensorFrame:
    return await pump(stream, decoder.next_event, decoder.feed)


async def write_chunks(stream: Any, chunks: Iterable[bytes | memoryview],
                       slice_timeout: float = 10.0) -> None:
    """Write a gather list; large payloads go out in 1 MiB slices of the caller's memory.

    Each slice is written shielded from cancellation (with its own deadline): py-libp2p's
    Yamux cancelled in the middle of a frame leaves half a frame on the connection, and the
    whole connection, not just this stream, is then lost. Cancellation takes effect
    between slices instead.
    """
    zero_copy = getattr(stream, "accepts_memoryview", False)  # py-libp2p wants bytes
    step = 4 * READ_SIZE if zero_copy else READ_SIZE  # a lane seals up to 4 MiB per record
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), step):
            await trio.lowlevel.checkpoint_if_cancelled()
            with trio.CancelScope(shield=True) as scope:
                scope.relative_deadline = slice_timeout
                piece = view[start:start + step]
                await stream.write(piece if zero_copy else bytes(piece))
            if scope.cancelled_caught:
                raise trio.TooSlowError("a 1 MiB write took longer than "
                                        f"{slice_timeout:g} s; the peer is not reading")


async def close_quietly(stream: Any) -> None:
    """Close a stream whose exchange is over (or failed), within 2 s and without raising:
    the peer may be gone already, and the caller has its answer or its error. What it sent
    that we did not read is dropped (p2p.gate.discard_unread: else it counts against the
    peer's budget for a minute)."""
    try:
        with trio.move_on_after(2):
            await stream.close()
    except Exception:
        pass
    discard_unread(stream)
