"""Gossipsub's IDONTWANT only for messages worth it (p2p/gossipsub.py), between two real
hosts on loopback."""

from __future__ import annotations

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p.gossipsub import IDONTWANT_MIN_BYTES
from p2p.host import Substrate
from tests.conftest import await_until

TOPIC = "/peertrain/test/idontwant"


async def test_idontwant_is_sent_for_large_messages_only():
    """py-libp2p sent an IDONTWANT (an RPC of its own, with a signed peer record) to every
    mesh peer for every message, heartbeats of 245 bytes included."""
    a, b = (Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(2))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            await b.connect(a.addrs()[0])
            assert a.pubsub is not None and b.pubsub is not None
            await a.pubsub.subscribe(TOPIC)
            heard = await b.pubsub.subscribe(TOPIC)
            await await_until(lambda: b.peer_id in a.pubsub.router.mesh.get(TOPIC, ()), 30,
                              "b in a's mesh")
            await a.pubsub.publish(TOPIC, b"s" * 245)  # a heartbeat's size
            await a.pubsub.publish(TOPIC, b"L" * IDONTWANT_MIN_BYTES)
            ids = {}
            for _ in range(2):
                msg = await heard.get()
                ids[len(msg.data)] = msg.from_id + msg.seqno
            told = b.pubsub.router.dont_send_message_ids
            # IDONTWANTs travel in order: once the large message's is in, a small one's
            # would be too
            await await_until(lambda: told.get(a.peer_id), 30, "a's IDONTWANT")
            assert told[a.peer_id] == {ids[IDONTWANT_MIN_BYTES]}
            nursery.cancel_scope.cancel()
