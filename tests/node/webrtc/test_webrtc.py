"""WebRTC data channels (node/webrtc/): real aiortc on loopback, driven from trio through
the asyncio thread; the STUN codec and responder; the signalling protocol's bad input."""

from __future__ import annotations

import hashlib
import logging
import os

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.averaging.service import Averager
from node.checkpoints.exchange import CheckpointServer, pull
from node.checkpoints.store import CheckpointStore
from node.reach.relays import RelayService
from node.transport.transports import Transports
from node.webrtc import PATH_WEBRTC
from node.webrtc.bridge import AsyncioThread
from node.webrtc.service import WebRtcService
from node.webrtc.session import RtcSession, gather_only
from p2p.host import Substrate
from protocols import averaging as av
from protocols import ckpt_exchange as cx
from protocols import webrtc_signal as sig
from protocols.wire import Envelope, encode_envelope
from tests.conftest import await_until, node_context

NUMEL = 500_000  # 2 MB of fp32 each way

RUN = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"
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


# -- the service on real hosts: a relay between two private nodes ---------------------------

def _node(verdict: str):
    sub = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    relay = RelayService(lambda: verdict, want=1, tick_s=0.2, retry_s=600, direct=False)
    rtc = WebRtcService(lambda: verdict)
    return sub, relay, rtc


async def _relayed_pair(nursery):
    """R public (relay, STUN); A and B private, connected to each other through R only."""
    nodes = [_node("public"), _node("private"), _node("private")]
    for sub, relay, rtc in nodes:
        await nursery.start(sub.serve)
        await nursery.start(relay.run, node_context(substrate=sub))
        await nursery.start(rtc.run, node_context(substrate=sub))
    (r, _, rtc_r), (a, relay_a, _), (b, _, _) = nodes
    for sub in (a, b):
        await sub.connect(r.addrs()[0])
    rid = r.peer_id.to_base58()
    await await_until(lambda: rid in relay_a.held, 30, "A's reservation")
    relayed = next(x for x in a.addrs() if "/p2p-circuit" in x)
    await b.connect(relayed, timeout=30)
    await await_until(lambda: rtc_r.stun.address, 10, "R's STUN responder")
    return nodes


async def test_two_relayed_peers_get_a_webrtc_path_and_average_and_pull_over_it(
        caplog, tmp_path) -> None:
    caplog.set_level(logging.INFO, logger="node.webrtc")
    caplog.set_level(logging.DEBUG, logger="node.averaging")
    gather_only(["127.0.0.1"])
    async with trio.open_nursery() as nursery:
        (r, _, rtc_r), (a, _, rtc_a), (b, _, rtc_b) = await _relayed_pair(nursery)
        ids = [a.peer_id.to_base58(), b.peer_id.to_base58()]
        # the smaller id offers, through the relayed connection; STUN from R
        await await_until(lambda: all(rtc.paths() for rtc in (rtc_a, rtc_b)), 60,
                          "a webrtc path on both sides")
        assert rtc_a.paths() == {ids[1]: PATH_WEBRTC}
        assert rtc_b.paths() == {ids[0]: PATH_WEBRTC}
        assert rtc_r.stun.statistics()["answered"] >= 1
        offerer = rtc_a if ids[0] < ids[1] else rtc_b
        assert offerer.stun_server == rtc_r.stun.address
        assert a.peer_paths()[ids[1]].startswith("relayed via")

        # an averaging round over the data channel, both ways
        subs, rtcs = [a, b], [rtc_a, rtc_b]
        doors = [Transports(s) for s in subs]
        for door, rtc in zip(doors, rtcs, strict=True):
            door.attach(channels=rtc)  # the averager serves on the data channels too
        avgs = [Averager(s, "run", me, (lambda other=other: [other]), codecs=["fp32"],
                         step_time=lambda: 20.0, inner_steps=1, transports=door)
                for s, door, me, other in zip(subs, doors, ids, reversed(ids), strict=True)]
        assert all(av.PROTOCOL_ID in rtc.handlers for rtc in rtcs)
        vectors = [torch.full((NUMEL,), float(i)) for i in range(2)]
        outcomes: list = [None, None]

        async def one(i: int) -> None:
            outcomes[i] = await avgs[i].exchange(1, vectors[i])

        async with trio.open_nursery() as inner:
            for i in range(2):
                inner.start_soon(one, i)
        for i in range(2):
            assert torch.equal(outcomes[i].partner_thetas[0], vectors[1 - i]), outcomes[i]
            stats = avgs[i].partners[ids[1 - i]]
            assert set(stats.sent) == {"webrtc"} and stats.sent["webrtc"] >= NUMEL * 4
            assert stats.received["webrtc"] >= NUMEL * 4 and not stats.received["stream"]

        # a checkpoint pull over the data channel too: B serves, A pulls as a node does
        # (its streams from the webrtc service, lanes only on direct paths)
        source = CheckpointStore(tmp_path / "b")
        cid = source.save(RUN, 7, {"w": torch.randn(300_000)})
        server = CheckpointServer(source)
        rtc_b.set_handler(cx.PROTOCOL_ID, server.handle)

        def path_of(peer: str) -> str:
            return rtc_a.paths().get(peer) or a.peer_paths().get(peer, "direct")

        with trio.fail_after(60):
            pulled = await pull(a, [b.peer_id], cid, CheckpointStore(tmp_path / "a"),
                                open_stream=rtc_a.open_stream, path_of=path_of)
        assert pulled.paths == {ids[1]: "webrtc"} and pulled.fetched_bytes > 1_000_000
        assert server.served >= 2 and server.served_on_lanes == 0
        assert CheckpointStore(tmp_path / "a").latest_ok(cid)
        for sub in (r, a, b):
            assert sub.handler_errors == 0
        nursery.cancel_scope.cancel()
    gather_only(None)


async def test_garbage_and_oversized_offers_are_refused_with_a_reason_and_the_host_stays_up(
    caplog,
) -> None:
    """Garbage, an SDP over the limit, text that is no session description, and an offer
    from the side that should answer: each refused and logged; the node answers after."""
    caplog.set_level(logging.INFO, logger="node.webrtc")
    gather_only(["127.0.0.1"])
    subs = sorted((Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(3)),
                  key=lambda s: s.peer_id.to_base58())
    low, target, high = subs  # `low` may offer to `target`, `high` may not
    # answer_direct: these peers are directly connected (offers over a direct connection
    # are refused and scored: the next test)
    rtc = WebRtcService(lambda: "private", answer_direct=True)
    async with trio.open_nursery() as nursery:
        for sub in subs:
            await nursery.start(sub.serve)
        await nursery.start(rtc.run, node_context(substrate=target))
        for sub in (low, high):
            await sub.connect(target.addrs()[0])

        async def send(sub: Substrate, data: bytes) -> bytes:
            stream = await sub.open_stream(target.peer_id, sig.PROTOCOL_ID)
            await stream.write(data)
            got = b""
            with trio.fail_after(30):
                try:
                    while chunk := await stream.read(65536):
                        got += chunk
                except Exception:  # reset by the refusing side
                    pass
            await stream.close()
            return got

        await send(low, b"\x00\x00\x00\x05garbage and more")
        big = "v=0\r\n" + "a=x\r\n" * 4000
        await send(low, encode_envelope(Envelope("webrtc.offer", 1, {"sdp": big}),
                                        max_frame_bytes=1 << 20))
        await send(low, encode_envelope(Envelope("webrtc.offer", 2, {"sdp": "v=0" + "x" * 100})))
        await send(low, sig.encode_offer(3, "v=0\r\nno data channel here\r\n"))
        reply = await send(low, sig.encode_offer(3, "v=0\r\nm=application x\r\n"))
        assert b"bad-offer" in reply
        reply = await send(high, sig.encode_offer(4, "v=0\r\nm=application 9 x\r\n"))
        assert b"the peer with the smaller id offers" in reply

        text = caplog.text
        assert text.count(f"webrtc: refused an offer from {low.peer_id}") == 5
        assert "exceeds max_frame_bytes=17408" in text  # the oversized SDP, on its length
        assert "no data channel section (m=application)" in text
        assert "cannot answer the offer" in text
        assert rtc.statistics()["refused"] == 6 and not rtc.sessions
        # the host is up and answers: a real offer from `low` gets an answer
        session_svc = WebRtcService(lambda: "private")
        await nursery.start(session_svc.run, node_context(substrate=low))
        session = await session_svc.connect(target.peer_id.to_base58())
        assert session.up.is_set()
        nursery.cancel_scope.cancel()
    gather_only(None)


async def test_offers_over_a_direct_connection_are_refused_scored_and_start_no_session():
    """20 offers from directly connected peers made 17 aiortc sessions (+51 MB, 5 threads):
    a direct path needs no WebRTC. Each is refused before aiortc is loaded and scored
    (`unwanted`); a peer that keeps offering is banned."""
    subs = sorted((Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)),
                  key=lambda s: s.peer_id.to_base58())
    low, target = subs
    rtc = WebRtcService(lambda: "private")
    async with trio.open_nursery() as nursery:
        for sub in subs:
            await nursery.start(sub.serve)
        await nursery.start(rtc.run, node_context(substrate=target))
        await low.connect(target.addrs()[0])
        hostile = low.peer_id.to_base58()
        replies = []
        for i in range(40):
            if target.gate.banned(hostile):
                break
            try:
                with trio.fail_after(10):
                    stream = await low.open_stream(target.peer_id, sig.PROTOCOL_ID)
                    await stream.write(sig.encode_offer(i, "v=0\r\nm=application 9 x\r\n"))
                    replies.append(await stream.read(4096))
            except Exception:
                pass
        assert b"we are directly connected" in replies[0]
        assert target.gate.banned(hostile) is not None and len(replies) <= 24
        assert not rtc.sessions and rtc.bridge is None  # aiortc never even started
        assert target.gate.misbehaviour["unwanted"] >= 19
        nursery.cancel_scope.cancel()
