"""A WebRTC data channel with the read/write/close surface of a libp2p stream.

Modelled on the averaging bulk lane (node/transport/lane.py's LaneStream): the averaging
adapter and the pump (node/transport/streams.py) take it wherever they take a libp2p stream, so an
averaging round runs over a data channel unchanged. One channel carries one stream; its
label is the protocol id (node/webrtc/session.py).

Back-pressure, both ways:
* writes: a write returns once its bytes are queued in aiortc, but it waits whenever the
  channel's `bufferedAmount` is above HIGH_WATER until aiortc says `bufferedamountlow`
  (below LOW_WATER), so a 100 MB vector is never queued whole (notes/stack.md §2,
  pitfall 3);
* reads: aiortc delivers each message as it arrives and has no way to pause a stream, so
  the messages wait here, and a peer that sends more than MAX_UNREAD bytes that we have
  not read yet (it ignores our pace) loses the channel with that reason.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import trio
from libp2p.peer.id import ID

from node.webrtc import PATH_WEBRTC
from node.webrtc.bridge import AsyncioThread, _soon

if TYPE_CHECKING:  # aiortc itself is imported by node/webrtc/session.py only
    from aiortc import RTCDataChannel

MESSAGE_BYTES = 64 * 1024  # what every WebRTC stack accepts (aiortc advertises 256 KiB)
HIGH_WATER = 4 << 20
LOW_WATER = 1 << 20
MAX_UNREAD = 64 << 20


class DataChannelStream:
    accepts_memoryview = True  # write() copies into 64 KiB messages itself
    path = PATH_WEBRTC

    def __init__(self, bridge: AsyncioThread, channel: RTCDataChannel, peer: ID,
                 token: trio.lowlevel.TrioToken) -> None:
        """Built on the asyncio thread, as the channel is created or announced, so that no
        message arrives before we listen."""
        self._bridge, self._ch, self._token = bridge, channel, token
        self.protocol = channel.label
        # What the averaging responder reads to learn who it talks to.
        self.muxed_conn = SimpleNamespace(peer_id=peer)
        self.peer = peer.to_base58()
        # trio side
        self._queue: deque[bytes] = deque()
        self._unread = 0
        self._closed = False
        self._error: str | None = None
        self._wakeup = trio.Event()
        self.bytes_sent = self.bytes_received = 0
        # asyncio side
        self._low = asyncio.Event()
        channel.bufferedAmountLowThreshold = LOW_WATER
        channel.on("message", lambda m: _soon(token, self._deliver, m))
        def closed() -> None:
            self._low.set()
            _soon(token, self._deliver, None)

        channel.on("close", closed)
        channel.on("bufferedamountlow", self._low.set)

    # -- trio side ----------------------------------------------------------------------

    def _deliver(self, message: bytes | str | None) -> None:
        if message is None:
            self._closed = True
        elif isinstance(message, str):
            self._fail("a text message on a binary stream")
        elif not self._closed:
            self._queue.append(message)
            self._unread += len(message)
            self.bytes_received += len(message)
            if self._unread > MAX_UNREAD:
                self._fail(f"the peer sent {self._unread} bytes we had not read "
                           f"(limit {MAX_UNREAD})")
        self._wakeup.set()

    def _fail(self, reason: str) -> None:
        self._error = self._error or reason
        self._queue.clear()
        self._unread = 0
        self._bridge.call_soon(self._ch.close)

    async def read(self, n: int = -1) -> bytes:
        """The next message (b"" once the channel is closed and drained)."""
        while True:
            if self._error is not None:
                raise trio.BrokenResourceError(f"data channel: {self._error}")
            if self._queue:
                message = self._queue.popleft()
                self._unread -= len(message)
                return message
            if self._closed:
                return b""
            self._wakeup = trio.Event()
            await self._wakeup.wait()

    async def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self._error is not None or self._closed:
            raise trio.BrokenResourceError(f"data channel: {self._error or 'closed'}")
        pieces = [bytes(view[i:i + MESSAGE_BYTES]) for i in range(0, len(view), MESSAGE_BYTES)]
        try:
            await self._bridge.run(self._send, pieces)
        except ConnectionError as e:
            raise trio.BrokenResourceError(f"data channel: {e}") from None
        self.bytes_sent += len(view)

    async def close(self) -> None:
        """Queued messages still go out before the stream is reset (aiortc sends pending
        data first, W3C WebRTC §6.2.4)."""
        self._closed = True
        self._wakeup.set()
        await self._bridge.run(self._close)

    def get_remote_address(self) -> None:
        return None  # no IP address a bulk lane could be dialed at

    # -- asyncio side ---------------------------------------------------------------------

    async def _send(self, pieces: list[bytes]) -> None:
        ch = self._ch
        for piece in pieces:
            while ch.readyState == "open" and ch.bufferedAmount > HIGH_WATER:
                self._low.clear()
                await self._low.wait()
            if ch.readyState != "open":
                raise ConnectionError(f"the channel is {ch.readyState}")
            ch.send(piece)

    async def _close(self) -> None:
        self._ch.close()


def channel_stats(stream: Any) -> dict[str, int]:
    return {"sent": stream.bytes_sent, "received": stream.bytes_received}
