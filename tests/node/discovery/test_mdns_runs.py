"""mDNS and the bootstrap sources, with real hosts and real zeroconf on loopback in one
process: a joiner takes only peers of its own run (two testnets on one machine advertise on
the same loopback), and a joiner whose first mDNS peers cannot be reached dials the next."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.discovery.mdns import MdnsService
from node.discovery.sources import Source, connect_first
from p2p.host import Substrate
from tests.conftest import await_until, node_context

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _ctx(sub: Substrate, run_id: str | None, serves: tuple[str, ...] = ()) -> SimpleNamespace:
    return node_context(substrate=sub, config={"run_id": run_id},
                        runs=SimpleNamespace(run_ids=lambda: list(serves)))


async def test_a_joiner_takes_only_mdns_peers_of_its_own_run():
    subs = [Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(4)]
    # a member of A, a member of B, a bootstrap serving B, a joiner of A
    ctxs = [_ctx(subs[0], "QmRunA"), _ctx(subs[1], "QmRunB"), _ctx(subs[2], None, ("QmRunB",)),
            _ctx(subs[3], "QmRunA")]
    services = [MdnsService(s.peer_id.to_base58(), [LOOPBACK]) for s in subs]
    ours, theirs, their_bootstrap, joiner = services
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for s, service, ctx in zip(subs, services, ctxs, strict=True):
                await nursery.start(s.serve)
                await nursery.start(service.run, ctx)
            others = {theirs.peer_id, their_bootstrap.peer_id}
            await await_until(lambda: {ours.peer_id, *others} <= set(joiner.found), 30,
                              "the joiner to hear every other node")
            # (other nodes on this machine's loopback may answer too: tests of other files,
            # testnets; only the ones named here are asserted on)
            handed = {a.rsplit("/p2p/", 1)[1] for a in await joiner.wait_for_peers(5.0)}
            assert ours.peer_id in handed and not handed & others
            assert others <= set(joiner.statistics()["other_runs"])
            # handed out once: asked again, the same peer is not dialed twice
            again = {a.rsplit("/p2p/", 1)[1] for a in await joiner.wait_for_peers(0.2)}
            assert ours.peer_id not in again and not again & others
            nursery.cancel_scope.cancel()


async def test_a_lookup_whose_peers_cannot_be_reached_is_asked_again():
    """Seen: a run-id-only joiner dialed the first mDNS peer that answered and, when that
    one failed, gave up though others of the run had answered since."""
    live, me = (Substrate(create_new_key_pair(), [LOOPBACK]) for _ in range(2))
    with socket.socket() as sock:  # a port nothing listens on: a peer that has left
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/{live.peer_id.to_base58()}"
    answers: list[list[str]] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for s in (live, me):
                await nursery.start(s.serve)
            target = live.addrs()[0]
            rounds = [[dead], [target], []]

            async def lookup() -> list[str]:
                answers.append(rounds[len(answers)])
                return answers[-1]

            outcome = await connect_first(me, [Source("mDNS", lookup=lookup)],
                                          dial_timeout_s=5.0)
            nursery.cancel_scope.cancel()
    assert outcome.source == "mDNS" and outcome.reached == [target]
    assert len(answers) == 2 and len(outcome.failures) == 1
