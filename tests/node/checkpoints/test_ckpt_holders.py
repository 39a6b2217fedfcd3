"""Checkpoint provision over many holders (issue 30): a joiner that pulled and vetted a
checkpoint announces itself as a holder, a joiner asks a few holders chosen by rendezvous
hash (node/checkpoints/holders.py), and a holder serves at most `max_uploads` askers at
once, refusing the next as busy (node/checkpoints/exchange.py)."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

import pytest
import torch
import trio
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair

from node.checkpoints import exchange
from node.checkpoints.holders import (
    SOURCES,
    UploadSlots,
    choose_holders,
    holder_weight,
    rank_holders,
)
from node.checkpoints.store import CheckpointStore
from p2p.host import Substrate
from protocols import ckpt_exchange as cx
from protocols import keys, rundoc

RUN = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@given(holders=st.lists(st.text("abcdef", min_size=1, max_size=6), max_size=30),
       asker=st.text("abcdef", min_size=1, max_size=6), k=st.integers(0, 10))
def test_the_choice_is_a_deterministic_subset_without_the_asker(holders, asker, k):
    chosen = choose_holders("Qmcid", asker, holders, k)
    assert chosen == choose_holders("Qmcid", asker, list(reversed(holders)), k)
    assert len(chosen) == len(set(chosen)) == min(k, len(set(holders) - {asker}))
    assert asker not in chosen and set(chosen) <= set(holders)
    assert chosen == rank_holders("Qmcid", asker, holders)[:k]


def test_a_thousand_joiners_spread_evenly_over_the_holders():
    """10% of a swarm of 10,000 joins at once: 1,000 joiners, 50 holders, 4 each."""
    holders = [f"holder{i}" for i in range(50)]
    load = Counter(h for j in range(1000)
                   for h in choose_holders("QmX", f"joiner{j}", holders, SOURCES))
    mean = 1000 * SOURCES / len(holders)  # 80
    assert set(load) == set(holders)
    assert max(load.values()) <= 1.5 * mean and min(load.values()) >= 0.5 * mean
    assert statistics.pstdev(load.values()) <= 0.2 * mean
    # the writer alone would have served all 1,000; with one more holder, few choices move
    moved = sum(choose_holders("QmX", f"joiner{j}", holders, SOURCES)
                != choose_holders("QmX", f"joiner{j}", [*holders, "new"], SOURCES)
                for j in range(1000))
    assert moved <= 2 * 1000 * SOURCES / 51


def test_weights_are_fixed_and_rejects_a_negative_k():
    assert holder_weight("a", "b", "c") == holder_weight("a", "b", "c")
    assert holder_weight("a", "b", "c") != holder_weight("a", "c", "b")
    with pytest.raises(ValueError):
        choose_holders("a", "b", ["c"], -1)


def test_upload_slots_count_askers_not_sessions():
    slots = UploadSlots(2)
    assert slots.acquire("a") and slots.acquire("a") and slots.acquire("b")
    assert not slots.acquire("c") and slots.refused == 1
    slots.release("a")
    assert not slots.acquire("c")  # a still has a session
    slots.release("a")
    assert slots.acquire("c") and slots.askers == 2
    with pytest.raises(ValueError):
        UploadSlots(0)


def test_the_run_document_names_the_holders_and_the_writer():
    writer, h1, h2 = (keys.Signer(bytes([i]) * 32) for i in (1, 2, 3))
    doc = rundoc.RunDocument(RUN, h2, [])
    cid = "QmTfNwBtXU2GLyWAnYf3Sv7XjEUGArFL3QjRoW2rMunVhh"
    for s, extra in ((h1, {"writer": writer.peer_id}), (writer, {})):
        d = rundoc.RunDocument(RUN, s, [])
        doc.merge(d.set(rundoc.ckpt_key(s.peer_id, cid), {"hash": cid, "step": 5, **extra},
                        1), 1)
    holders, who = rundoc.checkpoint_holders(doc, cid)
    assert holders == sorted([writer.peer_id, h1.peer_id]) and who == writer.peer_id
    # only holders listed (the writer dropped it): the writer they name
    doc.merge(rundoc.RunDocument(RUN, writer, []).delete(
        rundoc.ckpt_key(writer.peer_id, cid), 2), 2)
    assert rundoc.checkpoint_holders(doc, cid) == ([h1.peer_id], writer.peer_id)
    assert rundoc.checkpoint_holders(doc, "QmOther") == ([], None)


async def test_a_holder_serves_max_uploads_askers_and_refuses_the_next_as_busy(
        tmp_path: Path):
    held = CheckpointStore(tmp_path / "holder")
    cid = held.save(RUN, 3, {"w": torch.randn(1000)})
    server = exchange.CheckpointServer(held, max_uploads=1)
    holder, a, b = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(3))
    holder.set_handler(cx.PROTOCOL_ID, server.handle)
    async with trio.open_nursery() as nursery:
        for s in (holder, a, b):
            await nursery.start(s.serve)
        await a.connect(holder.addrs()[0])
        await b.connect(holder.addrs()[0])
        first = exchange._Session(a, holder.peer_id)
        assert await first.ask(cx.request_manifest(1, cid), 1, "ckpt.manifest")
        assert server.statistics()["uploads"] == 1
        second = exchange._Session(b, holder.peer_id)
        with pytest.raises(LookupError, match="busy"):
            await second.ask(cx.request_manifest(2, cid), 2, "ckpt.manifest")
        await second.close()
        # a's second stream (a lane asked beside, say) is the same asker: served
        again = exchange._Session(a, holder.peer_id)
        assert await again.ask(cx.request_manifest(3, cid), 3, "ckpt.manifest")
        await again.close()
        await first.close()
        with trio.fail_after(10):  # the holder sees the streams end, and frees the slot
            while server.uploads.askers:
                await trio.sleep(0.01)
        third = exchange._Session(b, holder.peer_id)
        assert await third.ask(cx.request_manifest(4, cid), 4, "ckpt.manifest")
        await third.close()
        assert server.statistics()["refused_busy"] == 1
        nursery.cancel_scope.cancel()


async def test_a_joiner_asks_a_few_of_many_holders_and_then_holds_it_too(tmp_path: Path):
    """Six peers hold the checkpoint (its writer and five earlier joiners); the joiner
    asks SOURCES of them, the ones its rendezvous ranking names, then announces itself."""
    from types import SimpleNamespace

    from node.checkpoints.service import CheckpointService
    from node.service import Phases
    from node.transport.transports import Transports

    kps = [create_new_key_pair() for _ in range(6)]
    signers = [keys.Signer(kp.private_key.to_bytes()[:32]) for kp in kps]
    source = CheckpointStore(tmp_path / "source")
    cid = source.save(RUN, 20, {"w": torch.randn(1000)})
    hosts = [Substrate(kp, [LOOPBACK]) for kp in kps]
    asked: list[str] = []
    for h, s in zip(hosts, signers, strict=True):
        server = exchange.CheckpointServer(source, lanes=False)

        async def serve(stream, server=server, name=s.peer_id):
            asked.append(name)
            await server.handle(stream)

        h.set_handler(cx.PROTOCOL_ID, serve)
    me_kp = create_new_key_pair()
    me_signer = keys.Signer(me_kp.private_key.to_bytes()[:32])
    me = Substrate(me_kp, [LOOPBACK])
    doc = rundoc.RunDocument(RUN, me_signer, [])
    for i, s in enumerate(signers):
        extra = {"writer": signers[0].peer_id} if i else {}
        doc.merge(rundoc.RunDocument(RUN, s, []).set(
            rundoc.ckpt_key(s.peer_id, cid), {"hash": cid, "step": 20, "size": 1, **extra},
            1), 1)
    published: list[bytes] = []
    synced = trio.Event()
    synced.set()
    vetted: list[tuple[str, str]] = []

    async def vet(c: str, writer: str) -> None:
        vetted.append((c, writer))

    service = CheckpointService(publish=published.append, synced=synced, vet=vet)
    ctx = SimpleNamespace(the_run=lambda: SimpleNamespace(run_id=RUN, document=doc),
                          phases=Phases(), substrate=me, transports=Transports(me),
                          peer_id=me_signer.peer_id,
                          checkpoints=CheckpointStore(tmp_path / "me"))
    expected = choose_holders(cid, me_signer.peer_id, [s.peer_id for s in signers], SOURCES)
    async with trio.open_nursery() as nursery:
        for s in (*hosts, me):
            await nursery.start(s.serve)
        for h in hosts:
            await me.connect(h.addrs()[0])
        with trio.fail_after(30):
            assert await service._pull_newest(ctx) == cid
        nursery.cancel_scope.cancel()
    assert set(asked) <= set(expected) and len(set(asked)) >= 1
    assert vetted == [(cid, signers[0].peer_id)]  # the writer's word left out, not a holder's
    assert service.pulled == (cid, 20, signers[0].peer_id)
    service._announce_holder(ctx, *service.pulled)
    value = doc.get(rundoc.ckpt_key(me_signer.peer_id, cid))
    assert value["hash"] == cid and value["writer"] == signers[0].peer_id
    assert published and me_signer.peer_id in rundoc.checkpoint_holders(doc, cid)[0]
