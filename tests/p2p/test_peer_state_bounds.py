"""A public node meets identities without end: its per-peer state must not grow with them
(issue 26). A real host on loopback takes a few hundred distinct identities, each
connecting, identifying, pinging once and leaving (the soak bench's cycle); the maps
py-libp2p keeps per peer that p2p/peer_state.py bounds are counted, not RSS."""

from __future__ import annotations

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from p2p import peer_state
from p2p.host import Substrate
from testnet.bench.soak import _bare_host, _cycle

IDENTITIES, WORKERS, CAP = 150, 6, 32


async def test_state_per_identity_met_stays_bounded(monkeypatch):
    monkeypatch.setattr(peer_state, "MAX_RECENT_DISCONNECTS", CAP)
    node = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    done: list[int] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(node.serve)
        info = PeerInfo(node.peer_id, [multiaddr.Multiaddr(node.addrs()[0])])
        send, receive = trio.open_memory_channel[int](IDENTITIES)
        for i in range(IDENTITIES):
            send.send_nowait(i)
        send.close()

        async def worker() -> None:
            async for i in receive:
                host = _bare_host(create_new_key_pair())
                async with host.run(listen_addrs=[]):
                    with trio.fail_after(60):
                        await _cycle(host, info)
                done.append(i)

        with trio.fail_after(600):  # ~30 s on a loaded 2-core machine
            async with trio.open_nursery() as workers:
                for _ in range(WORKERS):
                    workers.start_soon(worker)
        host = node.host
        service = _ping_service(host)
        connector = host.get_network().auto_connector
        assert len(done) == IDENTITIES
        assert len(service._inbound_streams) <= WORKERS, len(service._inbound_streams)
        assert len(connector._recent_disconnects) <= CAP, len(connector._recent_disconnects)
        nursery.cancel_scope.cancel()


def _ping_service(host):
    """py-libp2p's PingService behind the ping handler (it is the only one)."""
    import gc

    from libp2p.host.ping import PingService

    mine = [o for o in gc.get_objects() if type(o) is PingService and o._host is host]
    assert len(mine) == 1, mine
    return mine[0]
