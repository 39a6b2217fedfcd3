"""A TCP bulk lane with the read/write/close surface of a libp2p stream (see protocols/lane.py).

The averaging adapter swaps a `LaneStream` in for the libp2p stream once the partner has
accepted, so the same pump and writers serve both paths; the checkpoint exchange serves
chunks on one (node/checkpoints/exchange.py).

Both directions of a 100 MB exchange run on the same few cores as the training, so the lane
costs as little CPU per byte as it can (measured in docs/benchmarks.md, "exchange"): each
record is received with `recv_into` into one buffer per lane and opened (`read_into`)
straight into the memory the decoder names, for fp32 the receive vector; records are sealed
into another buffer and sent with one `send_all`. Nothing is allocated per record.
"""

from __future__ import annotations

import secrets
from typing import Any

import trio

from protocols.errors import RemoteProtocolError
from protocols.lane import (
    HEADER_BYTES,
    KEY_BYTES,
    MAX_PLAINTEXT,
    MAX_RECORD,
    TAG_BYTES,
    Opener,
    Sealer,
)

HELLO = b"peertrain-lane-2"
INITIATOR, RESPONDER = 0, 1


class LaneStream:
    accepts_memoryview = True  # write() seals straight from the caller's memory

    def __init__(self, stream: trio.SocketStream, key: bytes, me: int) -> None:
        self._stream = stream
        self._sealer = Sealer(key, me)
        self._opener = Opener(key, 1 - me)
        # One buffer each way, reused for every record (see the module doc).
        self._out = bytearray(HEADER_BYTES + MAX_RECORD)
        self._record = memoryview(bytearray(MAX_RECORD))
        self._plain = memoryview(bytearray(MAX_PLAINTEXT))

    async def _fill(self, view: memoryview) -> int:
        """Receive into all of `view`; return how much arrived before a clean EOF."""
        sock, got = self._stream.socket, 0
        while got < len(view):
            try:
                n = await sock.recv_into(view[got:])
            except OSError as exc:  # as trio's receive_some would say it
                raise trio.BrokenResourceError(f"lane: {exc}") from exc
            if not n:
                break
            got += n
        return got

    async def read(self, n: int = -1) -> memoryview | bytes:
        """The next opened record's plaintext (b"" at a clean end of stream).

        The view is of a buffer the next read() reuses: use or copy it before then (the
        pump feeds it to a decoder, which copies it at once).
        """
        record = await self._next_record()
        if record is None:
            return b""
        return self._plain[: self._opener.open_into(record, self._plain)]

    async def _next_record(self) -> memoryview | None:
        """The next sealed record, received whole (None at a clean end of stream)."""
        header = self._record[:HEADER_BYTES]
        got = await self._fill(header)
        if got == 0:
            return None
        if got < HEADER_BYTES:
            raise RemoteProtocolError("lane closed in the middle of a record")
        record = self._record[: Opener.check_length(header)]
        if await self._fill(record) < len(record):
            raise RemoteProtocolError("lane closed in the middle of a record")
        return record

    async def read_into(self, buffer: memoryview) -> int | memoryview | bytes:
        """The next record opened into `buffer` if its plaintext fits there: then how many
        bytes it wrote (an int). Otherwise what read() returns (b"" at a clean end)."""
        record = await self._next_record()
        if record is None:
            return b""
        if len(record) - TAG_BYTES <= len(buffer):
            return self._opener.open_into(record, buffer)
        return self._plain[: self._opener.open_into(record, self._plain)]

    async def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        out = memoryview(self._out)
        for start in range(0, len(view), MAX_PLAINTEXT):
            size = self._sealer.seal_into(view[start:start + MAX_PLAINTEXT], out)
            await self._stream.send_all(out[:size])

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


def listen_host(substrate: Any) -> str:
    """Lanes listen where the node listens (loopback in a testnet, all interfaces else).
    `substrate`: a p2p.host.Substrate (its `listen` multiaddrs)."""
    for addr in substrate.listen:
        try:
            return addr.value_for_protocol("ip4")
        except Exception:
            continue
    return "0.0.0.0"


async def connect_lane(host: str, port: int, key: bytes, timeout: float) -> LaneStream:
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(host, port)
    lane = LaneStream(stream, key, INITIATOR)
    await lane.write(HELLO)
    return lane
