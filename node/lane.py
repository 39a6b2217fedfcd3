"""A TCP bulk lane with the read/write/close surface of a libp2p stream (see protocols/lane.py).

The averaging adapter swaps a `LaneStream` in for the libp2p stream once the partner has
accepted, so the same pump and writers serve both paths.
"""

from __future__ import annotations

import secrets

import trio

from protocols.errors import RemoteProtocolError
from protocols.lane import KEY_BYTES, MAX_PLAINTEXT, Opener, Sealer

HELLO = b"peertrain-lane-1"
INITIATOR, RESPONDER = 0, 1


class LaneStream:
    accepts_memoryview = True  # write() seals straight from the caller's memory

    def __init__(self, stream: trio.SocketStream, key: bytes, me: int) -> None:
        self._stream = stream
        self._sealer = Sealer(key, me)
        self._opener = Opener(key, 1 - me)
        self._pending = bytearray()

    async def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            chunk = await self._stream.receive_some(min(n - got, 1 << 20))
            if not chunk:
                raise RemoteProtocolError("lane closed in the middle of a record")
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
        return buf

    async def read(self, n: int = -1) -> bytes:
        """The next opened record's plaintext (b"" at a clean end of stream)."""
        header = await self._stream.receive_some(4)
        if not header:
            return b""
        if len(header) < 4:
            header += await self._exactly(4 - len(header))
        record = await self._exactly(Opener.check_length(header))
        return self._opener.open(record)

    async def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), MAX_PLAINTEXT):
            header, sealed = self._sealer.seal_parts(view[start:start + MAX_PLAINTEXT])
            await self._stream.send_all(header)
            await self._stream.send_all(sealed)

    async def close(self) -> None:
        await self._stream.aclose()


class LaneListener:
    """The responder's side: one listener, one expected initiator, one key."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.key = secrets.token_bytes(KEY_BYTES)
        self._listeners: list[trio.SocketListener] = []

    async def open(self) -> int:
        self._listeners = await trio.open_tcp_listeners(0, host=self.host)
        return self._listeners[0].socket.getsockname()[1]

    async def accept(self, timeout: float) -> LaneStream:
        """The first connection that proves it holds the key; strangers are dropped."""
        with trio.fail_after(timeout):
            while True:
                stream = await self._listeners[0].accept()
                lane = LaneStream(stream, self.key, RESPONDER)
                try:
                    with trio.fail_after(2):
                        if await lane.read() == HELLO:
                            return lane
                except (RemoteProtocolError, trio.BrokenResourceError, trio.TooSlowError):
                    pass  # a stranger, or a peer without the key: drop it, keep waiting
                await stream.aclose()

    async def aclose(self) -> None:
        for listener in self._listeners:
            await listener.aclose()


async def connect_lane(host: str, port: int, key: bytes, timeout: float) -> LaneStream:
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(host, port)
    lane = LaneStream(stream, key, INITIATOR)
    await lane.write(HELLO)
    return lane
