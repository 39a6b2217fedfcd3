"""The bulk lane: AES-GCM records refuse tampering, replay and strangers."""

from __future__ import annotations

import contextlib
import os

import pytest
import trio

from node.transport.lane import LaneListener, connect_lane
from node.transport.streams import pump, write_chunks
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.lane import HEADER_BYTES, MAX_PLAINTEXT, MAX_RECORD, TAG_BYTES, Opener, Sealer
from protocols.wire import FrameDecoder, TensorFrame, encode_tensor_frame, make_tensor_header


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


def test_records_sealed_and_opened_in_place_are_the_same_records():
    key = os.urandom(32)
    out = bytearray(HEADER_BYTES + 100 + TAG_BYTES + 7)  # room to spare is fine
    sealer = Sealer(key, 1)
    n = sealer.seal_into(b"x" * 100, out)
    assert n == HEADER_BYTES + 100 + TAG_BYTES
    assert bytes(out[:n]) == Sealer(key, 1).seal(b"x" * 100)  # same bytes on the wire
    second = bytes(out[: sealer.seal_into(b"second", out)])
    opener, plain = Opener(key, 1), memoryview(bytearray(200))
    record = memoryview(Sealer(key, 1).seal(b"x" * 100))[HEADER_BYTES:]
    assert opener.open_into(record, plain) == 100 and bytes(plain[:100]) == b"x" * 100
    with pytest.raises(RemoteProtocolError):  # a replay fails its tag
        opener.open_into(record, plain)
    tampered = bytearray(second[HEADER_BYTES:])
    tampered[0] ^= 1
    with pytest.raises(RemoteProtocolError, match="authentication"):
        opener.open_into(tampered, plain)
    with pytest.raises(RemoteProtocolError, match="no room for a tag"):
        opener.open_into(b"short", plain)
    with pytest.raises(LocalProtocolError, match="needs a buffer"):
        sealer.seal_into(b"x" * 100, bytearray(100))
    with pytest.raises(LocalProtocolError, match="at most"):
        sealer.seal_into(bytes(MAX_PLAINTEXT + 1), bytearray(MAX_RECORD + 8))
    with pytest.raises(LocalProtocolError, match="room"):
        Opener(key, 1).open_into(second[HEADER_BYTES:], memoryview(bytearray(2)))


async def lane_pair():
    listener = LaneListener("127.0.0.1")
    port = await listener.open()
    lanes = []
    async with trio.open_nursery() as nursery:
        async def accept():
            lanes.append(await listener.accept(timeout=10))

        nursery.start_soon(accept)
        writer = await connect_lane("127.0.0.1", port, listener.key, timeout=5)
    await listener.aclose()
    return writer, lanes[0]


async def test_read_into_opens_a_record_in_place_when_it_fits():
    writer, reader = await lane_pair()
    with trio.fail_after(10):
        await writer.write(b"a" * 10)
        await writer.write(b"b" * 100)
        await writer.close()
        buffer = memoryview(bytearray(50))
        assert await reader.read_into(buffer) == 10  # in place
        assert bytes(buffer[:10]) == b"a" * 10
        assert await reader.read_into(buffer) == b"b" * 100  # too big: handed back
        assert await reader.read_into(buffer) == b""  # a clean end
        await reader.close()


async def test_a_pump_with_into_receives_a_payload_on_the_lane_without_feeding_it():
    writer, reader = await lane_pair()
    target = bytearray(4 << 20)
    payload = os.urandom(4 << 20)
    decoder = FrameDecoder(
        allowed_codecs=frozenset({"raw"}),
        require_crc32=False,
        payload_buffer=lambda header: memoryview(target),
    )
    fed = []

    def feed(data):
        fed.append(len(data))
        decoder.feed(data)

    header = make_tensor_header("w", "uint8", [len(payload)], "raw", payload, crc32=False)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_chunks, writer, encode_tensor_frame(header, payload))
            event = await pump(reader, decoder.next_event, feed, into=decoder)
        await writer.close()
        await reader.close()
    assert isinstance(event, TensorFrame)
    assert bytes(target) == payload
    assert sum(fed) < 200  # only the envelope went through feed; the payload was opened in place
