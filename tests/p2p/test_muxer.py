"""A Yamux frame write cancelled half way (p2p/muxer.py), between two real hosts on
loopback. Noise numbers every message: a frame encrypted and then not sent (its write
cancelled while the socket was full) leaves the two ends a nonce apart, the receiver fails
to decrypt everything after it and closes the whole connection. On a relay link that was
issue 26 item 6: the relay cut a circuit's other direction mid-write (duplicate relayed
connections ending together) and the private node behind it lost its relay link."""

from __future__ import annotations

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p.host import Substrate
from tests.node.reach.test_relay import ECHO, _echo, _send

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


async def test_a_frame_write_cancelled_mid_send_leaves_the_connection_working():
    a, b = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(2))
    async with trio.open_nursery() as nursery:
        for s in (a, b):
            await nursery.start(s.serve)
            s.set_handler(ECHO, _echo)
        await a.connect(b.addrs()[0])
        assert await _send(a, b.peer_id, b"warm" * 10) == b"warm" * 10
        (conn,) = a.host.get_network().get_connections(b.peer_id)
        tcp = conn.muxed_conn.secured_conn.conn.read_writer.read_write_closer.stream
        send, stalled = tcp.write, trio.Event()

        async def slow_write(data: bytes) -> None:  # a full socket: the send waits
            stalled.set()
            await trio.sleep(0.5)
            await send(data)

        stream = await a.open_stream(b.peer_id, ECHO)
        tcp.write = slow_write
        with trio.move_on_after(0.1):  # as a relay cuts a circuit's other direction
            await stream.write(b"cut" * 100)
        assert stalled.is_set()
        tcp.write = send
        # the next frames on the same connection are still read by the other end
        assert await _send(a, b.peer_id, b"after" * 100) == b"after" * 100
        assert await _send(b, a.peer_id, b"back" * 100) == b"back" * 100
        assert not conn.is_closed and a.host.get_network().get_connections(b.peer_id) == [conn]
        nursery.cancel_scope.cancel()
