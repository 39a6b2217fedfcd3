"""Recovery's weight fetches (node/pipe/fetch.py): real hosts on loopback."""

from __future__ import annotations

from contextlib import asynccontextmanager

import torch
import trio

from node.pipe.fetch import Stalls, WeightsFetcher
from node.transport.streams import next_event
from protocols import pipeline as pipe

RUN = "QmRun"
STATE = {"blocks.0.w": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
         "blocks.0.b": torch.ones(64)}
SHAPES = {k: tuple(v.shape) for k, v in STATE.items()}


@asynccontextmanager
async def hosts(serve):
    """An asker connected to a stage host whose weights requests `serve(stream, n)`
    answers (n: how many it was asked before)."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p.host import Substrate

    asker, host = (Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
                   for _ in range(2))
    asked = [0]

    async def handle(stream):
        assert pipe.check_weights_request(
            await next_event(stream, pipe.WEIGHTS_REQUEST_LIMITS.decoder()), RUN) == (2, "blocks")
        asked[0] += 1
        await serve(stream, asked[0] - 1)

    host.set_handler(pipe.WEIGHTS_PROTOCOL_ID, handle)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for s in (asker, host):
                await nursery.start(s.serve)
            peer = await asker.connect(host.addrs()[0])
            yield asker, peer, asked
            nursery.cancel_scope.cancel()


def answer() -> bytes:
    return b"".join(bytes(memoryview(c).cast("B"))
                    for c in pipe.encode_weights(RUN, 2, 40, 0.5, STATE))


async def test_a_weights_stream_cut_short_is_tried_again():
    """The host's first answer ends inside a tensor (a reset, churn): StreamEnded, which
    counted as a refusal and sent the rebuild to the seed's weights (issue 27); it is
    tried again and the second, whole answer is the one used."""
    async def serve(stream, n):
        data = answer()
        await stream.write(data[:len(data) // 2] if n == 0 else data)
        await stream.close()

    async with hosts(serve) as (asker, peer, asked):
        got = await WeightsFetcher(asker, RUN).fetch(peer.to_base58(), 2, "blocks", SHAPES)
    assert asked[0] == 2 and got.step == 40
    assert all(torch.equal(got.tensors[k], STATE[k]) for k in STATE)


async def test_a_refusal_is_not_tried_again_and_the_next_replica_is_asked():
    """A host without the stage says so (not retried); `first` goes on to the next
    replica and brings back every failure's reason (the log said "cannot be rebuilt ()")."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    async def serve(stream, n):
        await stream.write(pipe.encode_no_weights("this node hosts stage 1, not 2"))
        await stream.close()

    gone = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
    async with hosts(serve) as (asker, peer, asked):
        fetcher = WeightsFetcher(asker, RUN, tries=2)
        got, failed = await fetcher.first([peer.to_base58(), gone], 2, "blocks", SHAPES)
    assert got is None and asked[0] == 1
    assert len(failed) == 2 and "hosts stage 1, not 2" in failed[0]
    assert all(reason.split(": ", 1)[1] for reason in failed)  # never an empty reason


async def test_a_connection_whose_streams_only_time_out_is_reset():
    """A host that takes every request and never answers: after RESET_AFTER timed-out
    streams in a row the connection is closed, so the next stream dials a fresh one (the
    redialer leaves connected peers alone)."""
    async def serve(stream, n):
        await trio.sleep_forever()

    async with hosts(serve) as (asker, peer, asked):
        stalls = Stalls(asker, after=2)
        fetcher = WeightsFetcher(asker, RUN, stalls, deadline_s=1.0, tries=2)
        assert asker.host.get_network().get_connections(peer)
        got, failed = await fetcher.first([peer.to_base58()], 2, "blocks", SHAPES)
        assert got is None and failed == [f"{peer.to_base58()[-6:]}: timed out"]
        assert asked[0] == 2
        assert stalls.resets[peer.to_base58()] == 1
        assert not asker.host.get_network().get_connections(peer)
