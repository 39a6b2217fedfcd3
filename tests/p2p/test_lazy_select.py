"""Lazy multistream-select (p2p/lazy_select.py) between two real hosts on loopback, in
this process: the request leaves with the protocol's proposal and the answer is read as
usual; a decline shows at the first read; a peer whose identify does not list the
protocol is negotiated with first, as before."""

from __future__ import annotations

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure

from p2p import lazy_select
from p2p.host import Substrate
from tests.conftest import await_until, serving_pair

ECHO = "/test/reverse/1"


async def _reverse(stream) -> None:
    data = await stream.read(4)
    await stream.write(data[::-1])
    await stream.close()


async def _pair(nursery: trio.Nursery) -> tuple[Substrate, Substrate, object]:
    """`node` serves ECHO; `other` is connected to it and has its identify."""
    node, other, peer = await serving_pair(nursery, ECHO, _reverse)
    await await_until(lambda: ECHO in other.protocols_of(peer), 20, "identify")
    return node, other, peer


async def test_the_request_leaves_with_the_proposal_and_the_answer_reads_as_usual():
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            _, other, peer = await _pair(nursery)
            stream = await other.open_stream(peer, ECHO, lazy=True)
            assert isinstance(stream, lazy_select.LazyStream)
            await stream.write(b"ping")
            assert await stream.read(4) == b"gnip"
            assert stream.get_protocol() == ECHO
            nursery.cancel_scope.cancel()


async def test_a_decline_shows_at_the_first_read():
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            node, other, peer = await _pair(nursery)
            node.host.remove_stream_handler(TProtocol(ECHO))  # after its identify said it
            stream = await other.open_stream(peer, ECHO, lazy=True)
            await stream.write(b"ping")
            with pytest.raises(StreamFailure, match=f"answered 'na' to {ECHO}"):
                await stream.read(4)
            nursery.cancel_scope.cancel()


async def test_a_peer_whose_identify_lacks_it_is_negotiated_with_first():
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            _, other, peer = await _pair(nursery)
            with pytest.raises(StreamFailure):  # at the open, as py-libp2p always did
                await other.open_stream(peer, "/test/unknown/1", lazy=True)
            nursery.cancel_scope.cancel()
