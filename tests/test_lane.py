"""The bulk lane: AES-GCM records refuse tampering, replay and strangers."""

from __future__ import annotations

import contextlib
import os

import pytest
import trio

from node.lane import LaneListener, connect_lane
from protocols.errors import RemoteProtocolError
from protocols.lane import MAX_RECORD, Opener, Sealer


def test_records_open_in_order_and_refuse_tampering():
    key = os.urandom(32)
    sealer, opener = Sealer(key, 0), Opener(key, 0)
    first, second = sealer.seal(b"hello"), sealer.seal(b"world")
    assert opener.open(first[4:]) == b"hello"
    with pytest.raises(RemoteProtocolError):  # replaying the first record
        opener.open(first[4:])
    tampered = bytearray(second[4:])
    tampered[3] ^= 1
    with pytest.raises(RemoteProtocolError):
        Opener(key, 0).open(tampered)
    with pytest.raises(RemoteProtocolError):  # our own direction echoed back
        Opener(key, 1).open(first[4:])
    with pytest.raises(RemoteProtocolError, match="limit"):
        Opener.check_length((MAX_RECORD + 1).to_bytes(4, "big"))


async def test_listener_ignores_a_stranger_and_takes_the_key_holder():
    listener = LaneListener("127.0.0.1")
    port = await listener.open()
    got = []
    async with trio.open_nursery() as nursery:
        async def accept():
            lane = await listener.accept(timeout=10)
            got.append(await lane.read())
            await lane.close()

        nursery.start_soon(accept)
        stranger = await connect_lane("127.0.0.1", port, os.urandom(32), timeout=5)
        with contextlib.suppress(trio.BrokenResourceError):  # cut off: what we want
            await stranger.write(b"let me in")
        friend = await connect_lane("127.0.0.1", port, listener.key, timeout=5)
        await friend.write(b"payload")
        await friend.close()
        await stranger.close()
    await listener.aclose()
    assert got == [b"payload"]
