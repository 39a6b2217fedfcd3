"""The STUN codec (protocols/stun.py) and the run's STUN responder (node/webrtc/stun.py):
round trips, sizes checked before anything is read, hostile datagrams refused."""

from __future__ import annotations

import contextlib
import struct

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.webrtc.stun import MAX_ANSWERS_PER_S, StunResponder, probe
from protocols import stun
from protocols.errors import RemoteProtocolError

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
txids = st.binary(min_size=12, max_size=12)
ipv4 = st.ip_addresses(v=4).map(str)
ports = st.integers(0, 65535)


@FAST
@given(txid=txids, change=st.sampled_from([0, stun.CHANGE_IP, stun.CHANGE_PORT, 6]))
def test_a_binding_request_round_trips(txid: bytes, change: int) -> None:
    assert stun.parse_request(stun.encode_request(txid, change)) == \
        stun.BindingRequest(txid, change)


@FAST
@given(txid=txids, ip=st.one_of(ipv4, st.ip_addresses(v=6).map(str)), port=ports)
def test_a_binding_success_round_trips_through_the_xor_address(txid, ip, port) -> None:
    assert stun.parse_success(stun.encode_success(txid, ip, port), txid) == (ip, port)


@FAST
@given(data=st.binary(max_size=700))
def test_any_datagram_parses_or_is_refused_with_a_protocol_error(data: bytes) -> None:
    for parse in (stun.parse_request, lambda d: stun.parse_success(d, bytes(12))):
        with contextlib.suppress(RemoteProtocolError):
            parse(data)


@FAST
@given(txid=txids, cut=st.integers(1, 19))
def test_truncated_and_corrupted_messages_are_refused(txid: bytes, cut: int) -> None:
    good = stun.encode_request(txid, stun.CHANGE_IP)
    with pytest.raises(RemoteProtocolError):
        stun.parse_request(good[:-cut])
    # an attribute whose length runs past the message
    bad = bytearray(good)
    struct.pack_into("!H", bad, 22, 200)
    with pytest.raises(RemoteProtocolError, match="runs past"):
        stun.parse_request(bytes(bad))


def test_oversized_wrong_type_and_foreign_answers_are_refused() -> None:
    txid = bytes(12)
    huge = struct.pack("!HHI12s", stun.BINDING_REQUEST, 600, stun.MAGIC, txid) + bytes(600)
    with pytest.raises(RemoteProtocolError, match="more than 548"):
        stun.parse_request(huge)
    no_magic = struct.pack("!HHI12s", stun.BINDING_REQUEST, 0, 0, txid)
    with pytest.raises(RemoteProtocolError, match="magic"):
        stun.parse_request(no_magic)
    with pytest.raises(RemoteProtocolError, match="not a Binding Request"):
        stun.parse_request(stun.encode_success(txid, "1.2.3.4", 5))
    with pytest.raises(RemoteProtocolError, match="another transaction"):
        stun.parse_success(stun.encode_success(txid, "1.2.3.4", 5), b"x" * 12)


def test_the_responder_answers_only_while_public_and_only_so_often() -> None:
    public = [False]
    responder = StunResponder(lambda: public[0])
    request = stun.encode_request(bytes(12))
    assert responder.answer(request, ("198.19.1.2", 4000)) is None  # not public
    public[0] = True
    assert responder.answer(b"garbage", ("198.19.1.2", 4000)) is None
    replies = [responder.answer(request, ("198.19.1.2", 4000))
               for _ in range(MAX_ANSWERS_PER_S + 10)]
    assert stun.parse_success(replies[0], bytes(12)) == ("198.19.1.2", 4000)
    stats = responder.statistics()
    assert stats["ignored_not_public"] == 1 and stats["malformed"] == 1
    # within one second at most MAX_ANSWERS_PER_S (a second boundary may fall in between)
    assert stats["over_rate"] >= 1 or stats["answered"] == MAX_ANSWERS_PER_S + 10
    assert stats["answered"] <= 2 * MAX_ANSWERS_PER_S


async def test_a_probe_learns_its_address_from_a_live_responder_on_loopback() -> None:
    responder = StunResponder(lambda: True)
    async with trio.open_nursery() as nursery:
        await nursery.start(responder.serve, "127.0.0.1", 0)
        assert responder.address is not None
        seen = await probe(responder.address)
        assert seen is not None and seen[0] == "127.0.0.1"
        nursery.cancel_scope.cancel()
    # a port that answers nothing: None within the probe's timeout, no exception
    with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as quiet:
        await quiet.bind(("127.0.0.1", 0))
        assert await probe(quiet.getsockname(), timeout=0.3) is None
