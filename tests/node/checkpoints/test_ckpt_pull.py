"""Pulling a checkpoint from several real libp2p hosts: a stalling or lying provider costs
time, never correctness; chunks already on disk are not fetched again."""

from __future__ import annotations

from pathlib import Path

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.checkpoints import exchange as ckpt_sync
from node.checkpoints.store import CheckpointStore
from p2p.host import Substrate
from protocols import ckpt_exchange as cx
from protocols.checkpoint import CHUNK_BYTES
from tests.conftest import node_context

RUN = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def joining(doc, me: Substrate, state: Path):
    """A joiner's checkpoint service (first sync done) and the node context it pulls in:
    the run document `doc`, the host `me`, its store at `state`."""
    from types import SimpleNamespace

    from node.checkpoints.service import CheckpointService
    from node.transport.transports import Transports

    synced = trio.Event()
    synced.set()
    service = CheckpointService(publish=lambda delta: None, synced=synced)
    ctx = node_context(run=SimpleNamespace(run_id=RUN, document=doc), substrate=me,
                       transports=Transports(me), checkpoints=CheckpointStore(state))
    return service, ctx


async def test_pull_survives_a_stalling_and_a_lying_provider(tmp_path: Path):
    source = CheckpointStore(tmp_path / "honest")
    weights = {"w": torch.randn(3 * CHUNK_BYTES // 4 + 1000)}  # 4 chunks
    cid = source.save(RUN, 7, weights)
    honest, staller, liar, me = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(4))
    honest.set_handler(ckpt_sync.cx.PROTOCOL_ID, ckpt_sync.CheckpointServer(source).handle)

    async def stall(stream):  # reads requests, never answers
        await trio.sleep_forever()

    async def lie(stream):  # answers every request with garbage of the right shape
        from node.transport.streams import next_event

        decoder = cx.REQUEST_LIMITS.decoder()
        while True:
            env = await next_event(stream, decoder)
            if env.type == "ckpt.manifest":
                data = (source.manifests / cid).read_bytes()
            else:
                data = b"\x00" * 1000
            await stream.write(cx.respond(env, data, env.body.get("index")))

    staller.set_handler(cx.PROTOCOL_ID, stall)
    liar.set_handler(cx.PROTOCOL_ID, lie)
    target = CheckpointStore(tmp_path / "me")
    seen: list[tuple[int, int]] = []
    async with trio.open_nursery() as nursery:
        for s in (honest, staller, liar, me):
            await nursery.start(s.serve)
        providers = [await me.connect(s.addrs()[0]) for s in (staller, liar, honest)]
        with trio.fail_after(60):
            await ckpt_sync.pull(me, providers, cid, target, chunk_timeout=2.0,
                                 progress=lambda d, t: seen.append((d, t)))
        manifest, loaded = target.load(cid)
        assert manifest.step == 7 and torch.equal(loaded["w"], weights["w"])
        assert seen[-1] == (4, 4)
        # A second pull finds every chunk on disk and asks nobody for chunks.
        seen.clear()
        with trio.fail_after(30):
            await ckpt_sync.pull(me, [providers[2]], cid, target)
        nursery.cancel_scope.cancel()


async def test_a_lookup_beside_the_pull_is_not_waited_for_and_its_providers_are_used(
        tmp_path: Path):
    """The joiner's DHT lookup runs beside the pull (`more_providers`): a pull from the
    writer ends without it, and a pull whose first providers lack the checkpoint gets
    it from the providers the lookup names."""
    source = CheckpointStore(tmp_path / "holder")
    weights = {"w": torch.randn(CHUNK_BYTES // 4 + 1000)}  # 2 chunks
    cid = source.save(RUN, 3, weights)
    holder, empty, me = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(3))
    holder.set_handler(cx.PROTOCOL_ID, ckpt_sync.CheckpointServer(source).handle)
    empty.set_handler(cx.PROTOCOL_ID,
                      ckpt_sync.CheckpointServer(CheckpointStore(tmp_path / "empty")).handle)

    async def never() -> list:
        await trio.sleep_forever()
        return []

    async with trio.open_nursery() as nursery:
        for s in (holder, empty, me):
            await nursery.start(s.serve)
        has = await me.connect(holder.addrs()[0])
        lacks = await me.connect(empty.addrs()[0])
        with trio.fail_after(30):
            first = await ckpt_sync.pull(me, [has], cid, CheckpointStore(tmp_path / "a"),
                                         more_providers=never)
        assert first.chunks_by_peer == {has.to_base58(): 2}

        async def lookup() -> list:
            return [has]

        target = CheckpointStore(tmp_path / "b")
        with trio.fail_after(30):
            second = await ckpt_sync.pull(me, [lacks], cid, target, more_providers=lookup)
        assert second.chunks_by_peer == {has.to_base58(): 2} and second.asked == 2
        assert torch.equal(target.load(cid)[1]["w"], weights["w"])
        nursery.cancel_scope.cancel()


async def test_a_joiner_whose_checkpoint_was_dropped_takes_the_newer_one(tmp_path: Path,
                                                                         monkeypatch):
    """Retention on the writer can drop the checkpoint a joiner is pulling (a small model
    checkpointing every second on a loaded machine): the joiner takes the newer one the run
    document lists by then, instead of training from scratch. A checkpoint that stays the
    newest and unserved is asked for again after a pause (a provider too loaded to open a
    stream in time), PULL_TRIES times in all."""

    from node.checkpoints import service as ckpt_service
    from protocols import keys, rundoc

    kp = create_new_key_pair()
    writer = keys.Signer(kp.private_key.to_bytes()[:32])
    held = CheckpointStore(tmp_path / "writer")
    newer = held.save(RUN, 20, {"w": torch.randn(1000)})
    gone = "QmTfNwBtXU2GLyWAnYf3Sv7XjEUGArFL3QjRoW2rMunVhh"  # listed, no longer held
    holder, me = Substrate(kp, [LOOPBACK]), Substrate(create_new_key_pair(), [LOOPBACK])
    server = ckpt_sync.CheckpointServer(held)
    doc = rundoc.RunDocument(RUN, writer, [])
    doc.set(rundoc.ckpt_key(writer.peer_id, gone), {"hash": gone, "step": 10, "size": 1}, 1)

    async def serve(stream):  # the writer checkpoints again while we ask for the old one
        if rundoc.checkpoint_index(doc)[-1][1] != newer:
            doc.set(rundoc.ckpt_key(writer.peer_id, newer),
                    {"hash": newer, "step": 20, "size": 1}, 2)
        await server.handle(stream)

    holder.set_handler(cx.PROTOCOL_ID, serve)
    service, ctx = joining(doc, me, tmp_path / "me")
    async with trio.open_nursery() as nursery:
        for s in (holder, me):
            await nursery.start(s.serve)
        await me.connect(holder.addrs()[0])
        with trio.fail_after(30):
            assert await service._pull_newest(ctx) == newer
        assert service.download["served_by"] == 1 and service.download["step"] == 20
        assert torch.equal(ctx.checkpoints.load(newer)[1]["w"], held.load(newer)[1]["w"])
        # Nothing newer is listed after a failure: the same one again, then from scratch.
        monkeypatch.setattr(ckpt_service, "PULL_RETRY_S", 0.05)
        doc.set(rundoc.ckpt_key(writer.peer_id, gone), {"hash": gone, "step": 30, "size": 1}, 3)
        tries = []  # manifest requests (each try asks for its lane beside, on a stream too)
        asked = ckpt_sync.cx.request_manifest

        def count(req, cid):
            tries.append(cid)
            return asked(req, cid)

        monkeypatch.setattr(ckpt_sync.cx, "request_manifest", count)
        with trio.fail_after(30):
            assert await service._pull_newest(ctx) is None
        assert tries == [gone] * ckpt_service.PULL_TRIES
        nursery.cancel_scope.cancel()


async def test_a_joiner_asks_the_holders_the_run_document_lists_not_every_peer(
        tmp_path: Path):
    """Every connected peer was asked for the checkpoint too: a stream and a refusal from
    each peer that did not hold it, at every join (4-8 busy trainers in `node bench join`,
    every peer of a large swarm)."""

    from protocols import keys, rundoc

    kp = create_new_key_pair()
    writer = keys.Signer(kp.private_key.to_bytes()[:32])
    held = CheckpointStore(tmp_path / "writer")
    cid = held.save(RUN, 20, {"w": torch.randn(1000)})
    holder, bystander, me = (Substrate(k, [LOOPBACK]) for k in
                             (kp, create_new_key_pair(), create_new_key_pair()))
    holder.set_handler(cx.PROTOCOL_ID, ckpt_sync.CheckpointServer(held).handle)
    unheld = ckpt_sync.CheckpointServer(CheckpointStore(tmp_path / "bystander"))
    asked = []

    async def count(stream):
        asked.append(stream)
        await unheld.handle(stream)

    bystander.set_handler(cx.PROTOCOL_ID, count)
    doc = rundoc.RunDocument(RUN, writer, [])
    doc.set(rundoc.ckpt_key(writer.peer_id, cid), {"hash": cid, "step": 20, "size": 1}, 1)
    service, ctx = joining(doc, me, tmp_path / "me")
    async with trio.open_nursery() as nursery:
        for s in (holder, bystander, me):
            await nursery.start(s.serve)
        await me.connect(bystander.addrs()[0])
        await me.connect(holder.addrs()[0])
        with trio.fail_after(30):
            assert await service._pull_newest(ctx) == cid
        assert service.download["served_by"] == 1
        assert asked == [] and unheld.missing == 0
        nursery.cancel_scope.cancel()


async def test_the_lane_is_asked_for_beside_the_manifest_request(tmp_path: Path, autojump_clock):
    """The provider asked for the manifest is asked for its lane at once, on a second
    session, not after the manifest arrived: here it answers the manifest only once its
    lane was asked for (the old order waited for the manifest first: no provider served)."""
    from libp2p.peer.id import ID

    held = CheckpointStore(tmp_path / "held")
    cid = held.save(RUN, 1, {"w": torch.arange(1000.0)})
    manifest = held.manifest(cid)
    lane_asked = trio.Event()

    class Session:  # one provider's session: manifest, chunks, lanes
        stream = None

        async def ask(self, request: bytes, req_id: int, kind: str) -> bytes:
            decoder = cx.REQUEST_LIMITS.decoder()
            decoder.feed(request)
            _, _, index = cx.parse_request(decoder.next_event())
            if kind == "ckpt.manifest":
                await lane_asked.wait()
                return manifest.encode()
            return (held.chunks / manifest.chunks[index]).read_bytes()

        async def open_lane(self, cid: str) -> None:
            lane_asked.set()
            return None  # "no lane now": the chunks come on the stream

        async def close(self) -> None:
            pass

    provider = ID.from_pubkey(create_new_key_pair().public_key)
    looked_up = trio.Event()
    looked_up.set()
    mine = CheckpointStore(tmp_path / "me")
    with trio.fail_after(60):
        result = await ckpt_sync._Pull(
            lambda peer: Session(), [provider], cid, mine, chunk_timeout=30.0,  # type: ignore[arg-type, return-value]
            progress=lambda done, total: None, check=None, lane_for=lambda name: True,
            route_of=lambda name: "stream", started=0.0, lacking=set(), reasons=[],
            looked_up=looked_up, found=lambda: [], ahead={}).run()
    assert result.chunks_by_peer == {provider.to_base58(): len(manifest.chunks)}
    assert torch.equal(mine.load(cid)[1]["w"], torch.arange(1000.0))


async def test_the_trainer_does_not_wait_for_the_checkpoint_s_dht_provide(tmp_path: Path,
                                                                          autojump_clock):
    """The checkpoint service is ready once it holds its checkpoint; announcing it in the
    DHT (a lookup and a round of ADD_PROVIDER: 0.9 s of a join under load) follows."""
    from types import SimpleNamespace

    from node.checkpoints.service import CheckpointService, ckpt_provider_key

    store = CheckpointStore(tmp_path / "me")
    cid = store.save(RUN, 40, {"w": torch.randn(10)})
    provided: list[str] = []
    announced = trio.Event()

    async def provide(key: str) -> None:
        await trio.sleep(5)  # a slow DHT
        provided.append(key)
        announced.set()

    ctx = node_context(run=SimpleNamespace(run_id=RUN), checkpoints=store,
                       substrate=SimpleNamespace(dht=SimpleNamespace(provide=provide)))
    service = CheckpointService(publish=lambda delta: None, synced=trio.Event())
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run, ctx)
        assert (service.resume_from, trio.current_time(), provided) == (cid, 0.0, [])
        with trio.fail_after(10):
            await announced.wait()
        assert provided == [ckpt_provider_key(cid)]
        nursery.cancel_scope.cancel()
