"""WebRTC data channels (node/webrtc/): real aiortc on loopback, driven from trio through
the asyncio thread; the STUN codec and responder; the signalling protocol's bad input."""

from __future__ import annotations

import hashlib
import os

import trio
from libp2p.peer.id import ID

from node.webrtc.bridge import AsyncioThread
from node.webrtc.session import RtcSession, gather_only

A = ID.from_base58("12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo")
B = ID.from_base58("12D3KooWGzh3wB7XLHMDVHRrS9dphnHxfYaPZfvV8ZDa6nRA4ELt")


async def _pair(stun: tuple[str, int] | None = None):
    gather_only(["127.0.0.1"])
    inbound_send, inbound = trio.open_memory_channel(8)
    bridges = [AsyncioThread(), AsyncioThread()]
    a = RtcSession(bridges[0], B, stun, lambda s: None)
    b = RtcSession(bridges[1], A, stun, inbound_send.send_nowait)
    offer = await a.offer()
    answer = await b.answer(offer)
    await a.accept(answer)
    await a.connected(20)
    await b.connected(20)
    return bridges, a, b, inbound


async def _close(bridges, *sessions) -> None:
    for s in sessions:
        await s.close()
    for br in bridges:
        br.stop()
    gather_only(None)


async def test_a_data_channel_between_two_endpoints_on_loopback_carries_a_payload_intact() -> None:
    bridges, a, b, inbound = await _pair()
    try:
        assert "127.0.0.1" in (a.pair or "")
        out = await a.open_stream("/test/echo/1")
        stream = await inbound.receive()
        assert stream.protocol == "/test/echo/1" and stream.peer == A.to_base58()
        payload = os.urandom(8 << 20)
        got = bytearray()

        async def reader() -> None:
            while len(got) < len(payload):
                data = await stream.read()
                assert data
                got.extend(data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await out.write(memoryview(payload))
        assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
        # both directions, then a clean end of stream
        await stream.write(b"back")
        assert await out.read() == b"back"
        await out.close()
        with trio.fail_after(10):
            assert await stream.read() == b""
    finally:
        await _close(bridges, a, b)
