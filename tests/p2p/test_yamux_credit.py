"""Yamux receive credit (p2p/host.py): a stream read as gossipsub reads its messages (the
length prefix a byte at a time, then the body) does not send a WINDOW_UPDATE for every
read; py-libp2p's default did, a Noise-encrypted frame apiece."""

from __future__ import annotations

import trio

from tests.conftest import serving_pair

PROTO = "/test/gossip-like/1"
MESSAGES = 100
BODY = 40


async def test_a_message_read_in_two_reads_returns_credit_once():
    done = trio.Event()
    seen: dict[str, object] = {}

    async def read_messages(stream) -> None:
        for _ in range(MESSAGES):
            assert await stream.read(1) == bytes([BODY])  # a one-byte varint prefix
            body = b""
            while len(body) < BODY:
                body += await stream.read(BODY - len(body))
        seen["yamux"] = stream.muxed_stream
        done.set()
        await stream.close()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            _, other, peer = await serving_pair(nursery, PROTO, read_messages)
            stream = await other.open_stream(peer, PROTO)
            for _ in range(MESSAGES):
                await stream.write(bytes([BODY]) + b"x" * BODY)
            await done.wait()
            y = seen["yamux"]
            updates = (y._window_update_bytes_read_only + y._window_update_partial_slack
                       + y._window_update_pending_flush + y._window_update_full_grow)
            print("window updates for", MESSAGES, "messages:", updates)
            # py-libp2p's default (PY_YAMUX_RELEASE_ON_READ=1) sends one per read: 200+.
            assert updates <= MESSAGES * 1.2
            nursery.cancel_scope.cancel()
