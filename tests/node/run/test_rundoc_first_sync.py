"""A joiner's first run-document sync (node/run/rundoc_sync.py): with the peer that served
its manifest and every peer it is connected to, at once, before any heartbeat is heard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from node.run.rundoc_sync import RunDocSync


def _peer(name: str) -> SimpleNamespace:
    return SimpleNamespace(to_base58=lambda: name)


@pytest.mark.parametrize(("first", "connected", "expected"), [
    # the manifest's source and the connected peers (the source among them asked once)
    (["QmSource"], ["QmBoot", "QmSource", "QmMember"], ["QmSource", "QmBoot", "QmMember"]),
    ([], ["QmBoot", "QmMember"], ["QmBoot", "QmMember"]),  # a source we do not know
    ([], [], []),  # the run's first node: nobody to sync with
])
async def test_a_joiner_syncs_at_once_with_its_source_and_connected_peers(
        autojump_clock, first, connected, expected):
    # A joiner hears no heartbeat for 2 s or more after it joins (7.6 s in `node bench
    # join` at load 6: that joiner trained from scratch). The bootstrap (no run document:
    # its round fails) is not asked again once a member's round succeeded.
    synced: list[tuple[str, float]] = []

    async def sync_with(peer: str) -> None:
        synced.append((peer, trio.current_time()))
        if peer == "QmBoot":
            raise ConnectionError("protocol not supported")

    rd = RunDocSync(first_peers=first)
    rd.live_peers, rd.signer = (lambda: []), SimpleNamespace(peer_id="QmMe")
    rd.substrate = SimpleNamespace(connected_peers=lambda: [_peer(p) for p in connected],
                                   protocols_of=lambda peer: [])
    rd._sync_with = sync_with  # type: ignore[method-assign]
    with trio.move_on_after(30):
        await rd._anti_entropy_loop()
    # once each, at the start (concurrently: in no particular order)
    assert sorted(synced) == sorted((p, 0.0) for p in expected)
    assert rd.first_sync.is_set() == bool(expected)


async def test_a_peer_whose_identify_lacks_the_protocol_is_not_asked(autojump_clock):
    """A bootstrap says in identify that it keeps no run document: no round is tried
    with it (py-libp2p would log its refusal on the terminal). A peer whose identify has
    not arrived yet (no protocols known) is asked."""
    synced: list[str] = []

    async def sync_with(peer: str) -> None:
        synced.append(peer)

    known = {"QmBoot": ["/ipfs/kad/1.0.0", "/peertrain/manifest/1.0.0"], "QmNew": []}
    rd = RunDocSync(first_peers=["QmBoot"])
    rd.live_peers, rd.signer = (lambda: []), SimpleNamespace(peer_id="QmMe")
    rd.substrate = SimpleNamespace(
        connected_peers=lambda: [_peer("QmBoot"), _peer("QmNew")],
        protocols_of=lambda peer: known[peer.to_base58()])
    rd._sync_with = sync_with  # type: ignore[method-assign]
    with trio.move_on_after(30):
        await rd._anti_entropy_loop()
    assert synced == ["QmNew"]
