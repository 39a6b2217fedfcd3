"""The thin pump between a libp2p stream and a sans-IO frame decoder (protocols/wire.py)."""

from __future__ import annotations

from collections.abc import Iterable

from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamEOF

from protocols.errors import RemoteProtocolError
from protocols.wire import NEED_DATA, Envelope, FrameDecoder, TensorFrame

READ_SIZE = 1 << 20


async def next_event(stream: INetStream, decoder: FrameDecoder) -> Envelope | TensorFrame:
    """Read until the decoder yields one event; EOF mid-message is the peer's fault."""
    while True:
        event = decoder.next_event()
        if event is not NEED_DATA:
            return event
        try:
            data = await stream.read(READ_SIZE)
        except StreamEOF:
            data = b""
        if not data:
            raise RemoteProtocolError("stream ended in the middle of a message")
        decoder.feed(data)


async def write_chunks(stream: INetStream, chunks: Iterable[bytes | memoryview]) -> None:
    """Write a gather list; large payloads go out in 1 MiB slices of the caller's memory."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), READ_SIZE):
            await stream.write(bytes(view[start:start + READ_SIZE]))
