"""Opening a stream without waiting for multistream-select's answers (its "lazy" mode).

py-libp2p's `new_stream` negotiates before it returns: it sends the multistream header and
waits for its echo, then proposes the protocol and waits for that echo, two round trips
before the caller's first byte leaves. A join opens its streams one after another (the
manifest, the run document, the checkpoint), and on a loaded machine one round trip
between two Python nodes took 0.3-1 s (`node bench join`, 4 trainers on 2 cores).
go-libp2p proposes lazily to peers whose identify lists the protocol; so do we: the
header, the protocol and the caller's request leave together, and the two answers are
checked when the caller first reads.

For request/response protocols only, where the opener reads before it is done: a stream
that is only written would never learn that the peer declined.
"""

from __future__ import annotations

import contextlib
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.peer.id import ID
from libp2p.utils.varint import encode_delim, read_varint_prefixed_bytes_limited

MULTISTREAM = "/multistream/1.0.0"
MAX_ANSWER = 1024  # a protocol id, or "na": a longer answer is a broken peer


async def open_lazily(host: Any, peer: ID, protocol: str) -> LazyStream:
    """A stream to `peer` (on its connection, dialing if needed) with `protocol` proposed
    and not yet confirmed: see the module doc."""
    stream = await host.get_network().new_stream(peer)
    try:
        await stream.write(encode_delim(MULTISTREAM.encode()) + encode_delim(protocol.encode()))
    except BaseException:
        with trio.CancelScope(shield=True), contextlib.suppress(Exception):
            await stream.reset()
        raise
    stream.set_protocol(TProtocol(protocol))
    return LazyStream(stream, peer, protocol)


class LazyStream:
    """A py-libp2p stream whose first read first checks multistream-select's two answers
    (the header's echo, then the protocol's, or "na": StreamFailure, as py-libp2p raises
    when it negotiates first). Everything else is the stream's own."""

    def __init__(self, stream: Any, peer: ID, protocol: str) -> None:
        self._stream, self._peer, self._protocol = stream, peer, protocol
        self._confirmed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        if not self._confirmed:
            await self._confirm()
        return await self._stream.read(n)

    async def _confirm(self) -> None:
        answers = []
        for _ in range(2):
            try:
                line = await read_varint_prefixed_bytes_limited(self._stream, MAX_ANSWER)
            except Exception as e:
                raise StreamFailure(f"failed to open a stream to peer {self._peer}: no "
                                    f"multistream answer for {self._protocol} ({e!r})") from e
            answers.append(bytes(line).removesuffix(b"\n").decode(errors="replace"))
        if answers != [MULTISTREAM, self._protocol]:
            raise StreamFailure(f"failed to open a stream to peer {self._peer}: it answered "
                                f"{answers[1]!r:.80} to {self._protocol}")
        self._confirmed = True
