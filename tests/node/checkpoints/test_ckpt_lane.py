"""Checkpoint chunks on the bulk lane (node/checkpoints/exchange.py): real libp2p hosts and
real lanes on loopback. Every chunk is still verified against the manifest's sha256, a
provider that lies on its lane is dropped and its chunks go to the others, a cut lane
leaves only verified chunks behind and the next pull resumes from them, and a provider
without a lane serves on the libp2p stream as before."""

from __future__ import annotations

import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.checkpoints import exchange as ckpt_sync
from node.checkpoints.store import CheckpointError, CheckpointStore
from node.transport.lane import LaneListener, LaneStream, connect_lane
from node.transport.streams import next_event
from p2p.host import Substrate
from protocols import checkpoint as ck
from protocols import ckpt_exchange as cx
from protocols.checkpoint import CHUNK_BYTES
from protocols.wire import Envelope

RUN = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"

Answer = Callable[[LaneStream, Envelope, ck.CheckpointManifest, CheckpointStore],
                  Awaitable[None]]


def honest_store(tmp_path: Path) -> tuple[CheckpointStore, str, dict]:
    store = CheckpointStore(tmp_path / "honest")
    weights = {"w": torch.randn(3 * CHUNK_BYTES // 4 + 1000)}  # 4 chunks, the last short
    return store, store.save(RUN, 7, weights), weights


def only_verified_chunks(store: CheckpointStore) -> list[str]:
    """What is on disk: every chunk file must hash to its name (nothing unverified)."""
    names = sorted(p.name for p in store.chunks.glob("*")) if store.chunks.exists() else []
    for name in names:
        assert ck.sha256_hex((store.chunks / name).read_bytes()) == name
    return names


def lane_server(source: CheckpointStore, cid: str, answer: Answer):
    """A provider that offers a lane like ours and answers each chunk request on it with
    `answer` (the hostile part); the manifest it serves on the stream is the true one."""
    manifest = source.manifest(cid)

    async def handle(stream) -> None:
        decoder = cx.REQUEST_LIMITS.decoder()
        while True:
            env = await next_event(stream, decoder)
            if env.type == "ckpt.manifest":
                await stream.write(cx.respond(env, (source.manifests / cid).read_bytes()))
                continue
            listener = LaneListener("127.0.0.1")
            port = await listener.open()
            await stream.write(cx.respond_lane(env, port, listener.key))
            lane = await listener.accept(timeout=5.0)
            await listener.aclose()
            requests = cx.REQUEST_LIMITS.decoder()
            try:
                while True:
                    await answer(lane, await next_event(lane, requests), manifest, source)
            finally:
                await lane.close()

    return handle


def chunk_bytes(source: CheckpointStore, m: ck.CheckpointManifest, env: Envelope) -> bytes:
    return (source.chunks / m.chunks[env.body["index"]]).read_bytes()


async def oversized(lane, env, m, source):  # announces one byte more than the manifest says
    data = chunk_bytes(source, m, env)
    await lane.write(cx.chunk_header(env, len(data) + 1))
    await lane.write(data + b"\0")


async def wrong_index(lane, env, m, source):
    wrong = Envelope(env.type, env.id, {**env.body, "index": env.body["index"] ^ 1})
    await lane.write(cx.chunk_header(wrong, len(chunk_bytes(source, m, env))))


async def overrun(lane, env, m, source):  # the right size, then a record past the end
    data = chunk_bytes(source, m, env)
    await lane.write(cx.chunk_header(env, len(data)))
    await lane.write(data[:100])
    await lane.write(data[100:] + b"x" * 64)


async def cut_short(lane, env, m, source):
    data = chunk_bytes(source, m, env)
    await lane.write(cx.chunk_header(env, len(data)))
    await lane.write(data[: len(data) // 2])
    await lane.close()


async def stall(lane, env, m, source):  # a header, then nothing
    await lane.write(cx.chunk_header(env, len(chunk_bytes(source, m, env))))
    await trio.sleep_forever()


async def not_held(lane, env, m, source):
    await lane.write(cx.refuse(env))


async def glued(lane, env, m, source):  # a header with more behind it in its record
    await lane.write(cx.chunk_header(env, len(chunk_bytes(source, m, env))) + b"\0\0\0")


@pytest.mark.parametrize(("answer", "why"), [
    (oversized, "the manifest says"),
    (wrong_index, "expected chunk"),
    (overrun, "runs past"),
    # (a reset when our unanswered requests were still in its receive buffer)
    (cut_short, "lane closed in the middle of chunk|Connection reset by peer"),
    (stall, "no answer within 2 s"),
    (not_held, "not held here"),
    (glued, "one envelope in one record"),
])
async def test_a_provider_lying_on_its_lane_is_dropped_and_the_others_finish(
        tmp_path: Path, answer: Answer, why: str):
    source, cid, weights = honest_store(tmp_path)
    honest, liar, me = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(3))
    honest.set_handler(cx.PROTOCOL_ID, ckpt_sync.CheckpointServer(source).handle)
    liar.set_handler(cx.PROTOCOL_ID, lane_server(source, cid, answer))
    target = CheckpointStore(tmp_path / "me")
    async with trio.open_nursery() as nursery:
        for s in (honest, liar, me):
            await nursery.start(s.serve)
        bad = await me.connect(liar.addrs()[0])
        good = await me.connect(honest.addrs()[0])
        with trio.fail_after(30), pytest.raises(CheckpointError) as failed:
            await ckpt_sync.pull(me, [bad], cid, target, chunk_timeout=2.0)
        assert re.search(why, str(failed.value))
        assert only_verified_chunks(target) == []
        with trio.fail_after(30):
            result = await ckpt_sync.pull(me, [bad, good], cid, target, chunk_timeout=2.0)
        nursery.cancel_scope.cancel()
    assert result.paths[good.to_base58()] == "lane"
    assert result.chunks_by_peer.get(bad.to_base58(), 0) == 0
    assert target.verify(cid) == []
    assert torch.equal(target.load(cid)[1]["w"], weights["w"])


async def test_bad_bytes_on_a_lane_fail_their_hash_and_nothing_unverified_is_kept(
        tmp_path: Path):
    """Our own server, serving a store whose chunk files were damaged on disk (same size):
    the lane carries them faithfully and the asker refuses every one on its sha256."""
    source, cid, weights = honest_store(tmp_path)
    damaged = CheckpointStore(tmp_path / "damaged")
    shutil.copytree(source.root, damaged.root)
    for path in damaged.chunks.glob("*"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    honest, liar, me = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(3))
    liar_server = ckpt_sync.CheckpointServer(damaged)
    honest.set_handler(cx.PROTOCOL_ID, ckpt_sync.CheckpointServer(source).handle)
    liar.set_handler(cx.PROTOCOL_ID, liar_server.handle)
    target = CheckpointStore(tmp_path / "me")
    async with trio.open_nursery() as nursery:
        for s in (honest, liar, me):
            await nursery.start(s.serve)
        bad = await me.connect(liar.addrs()[0])
        good = await me.connect(honest.addrs()[0])
        with trio.fail_after(30), pytest.raises(CheckpointError, match="does not match its hash"):
            await ckpt_sync.pull(me, [bad], cid, target, chunk_timeout=5.0)
        assert liar_server.served_on_lanes >= 1  # it did go over the lane
        assert only_verified_chunks(target) == []
        with trio.fail_after(30):
            result = await ckpt_sync.pull(me, [bad, good], cid, target, chunk_timeout=5.0)
        nursery.cancel_scope.cancel()
    # Beside an honest provider the liar may serve nothing before the pull is done (the
    # first pull above proved its chunks are refused); when it did, that is why it dropped.
    assert result.paths[good.to_base58()] == "lane"
    why = result.failures.get(bad.to_base58())
    assert why is None or "does not match its hash" in why, why
    assert torch.equal(target.load(cid)[1]["w"], weights["w"])


async def test_a_lane_cut_off_after_two_chunks_leaves_them_and_the_next_pull_resumes(
        tmp_path: Path):
    source, cid, weights = honest_store(tmp_path)
    served = 0

    async def two_then_silence(lane, env, m, source_):  # the connection goes dead
        nonlocal served
        if served == 2:
            await trio.sleep_forever()
        served += 1
        data = chunk_bytes(source_, m, env)
        await lane.write(cx.chunk_header(env, len(data)))
        await lane.write(data)

    cutter, honest, me = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(3))
    cutter.set_handler(cx.PROTOCOL_ID, lane_server(source, cid, two_then_silence))
    honest.set_handler(cx.PROTOCOL_ID, ckpt_sync.CheckpointServer(source).handle)
    target = CheckpointStore(tmp_path / "me")
    async with trio.open_nursery() as nursery:
        for s in (cutter, honest, me):
            await nursery.start(s.serve)
        first = await me.connect(cutter.addrs()[0])
        with trio.fail_after(30), pytest.raises(CheckpointError, match="2 of 4 chunks"):
            await ckpt_sync.pull(me, [first], cid, target, chunk_timeout=2.0)
        assert len(only_verified_chunks(target)) == 2
        good = await me.connect(honest.addrs()[0])
        with trio.fail_after(30):
            result = await ckpt_sync.pull(me, [good], cid, target)
        nursery.cancel_scope.cancel()
    assert result.chunks_local == 2 and result.chunks_by_peer == {good.to_base58(): 2}
    assert torch.equal(target.load(cid)[1]["w"], weights["w"])


async def test_a_server_without_lanes_serves_on_the_stream_and_refuses_lane_misuse(
        tmp_path: Path):
    source, cid, _ = honest_store(tmp_path)
    laneless_server = ckpt_sync.CheckpointServer(source, lanes=False)
    server = ckpt_sync.CheckpointServer(source)
    laneless, lanes, me = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(3))
    laneless.set_handler(cx.PROTOCOL_ID, laneless_server.handle)
    lanes.set_handler(cx.PROTOCOL_ID, server.handle)
    async with trio.open_nursery() as nursery:
        for s in (laneless, lanes, me):
            await nursery.start(s.serve)
        old = await me.connect(laneless.addrs()[0])
        with trio.fail_after(30):
            result = await ckpt_sync.pull(me, [old], cid, CheckpointStore(tmp_path / "a"))
        assert result.paths == {old.to_base58(): "stream"}
        assert laneless_server.served == 5 and laneless_server.served_on_lanes == 0  # + manifest

        # A lane asker that asks for anything but chunks on the lane loses the lane; the
        # server goes on serving the next asker.
        peer = await me.connect(lanes.addrs()[0])
        stream = await me.open_stream(peer, cx.PROTOCOL_ID)
        await stream.write(cx.request_lane(1, cid))
        port, key = cx.parse_lane(await next_event(stream, cx.RESPONSE_LIMITS.decoder()), 1)
        lane = await connect_lane("127.0.0.1", port, key, timeout=2.0)
        await lane.write(cx.request_manifest(2, cid))
        with trio.fail_after(10):
            assert await lane.read() == b""  # closed on us
        await lane.close()
        with trio.fail_after(30):
            result = await ckpt_sync.pull(me, [peer], cid, CheckpointStore(tmp_path / "b"))
        assert result.paths == {peer.to_base58(): "lane"}
        assert server.served_on_lanes == 4
        with trio.fail_after(10):  # the server sees our lane close, and frees its slot
            while server.lanes_open:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


async def test_a_provider_behind_a_nat_offers_no_lane_and_serves_on_the_stream(
        tmp_path: Path):
    # A lane is a fresh TCP port of the provider's: behind a NAT nobody can connect to it,
    # so the provider says so at once (NodeContext.lane_dialable) instead of letting the
    # asker's dial time out.
    source, cid, _ = honest_store(tmp_path)
    server = ckpt_sync.CheckpointServer(source)
    server.lane_dialable = lambda: False
    natted, me = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(2))
    natted.set_handler(cx.PROTOCOL_ID, server.handle)
    async with trio.open_nursery() as nursery:
        for s in (natted, me):
            await nursery.start(s.serve)
        peer = await me.connect(natted.addrs()[0])
        with trio.fail_after(30):
            result = await ckpt_sync.pull(me, [peer], cid, CheckpointStore(tmp_path / "a"))
        assert result.paths == {peer.to_base58(): "stream"}
        assert server.served_on_lanes == 0 and server.lanes_open == 0
        nursery.cancel_scope.cancel()
