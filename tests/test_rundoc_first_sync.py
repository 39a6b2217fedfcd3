"""A joiner's first run-document sync (node/run/rundoc_sync.py): with the peer that served
its manifest, at once, before any heartbeat is heard."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from node.run.rundoc_sync import RunDocSync


async def test_a_joiner_syncs_with_its_manifest_source_before_any_heartbeat(autojump_clock):
    # A joiner hears no heartbeat for up to 2 s after it joins; the peer that served its
    # manifest is a run member it can sync with at once (`node bench join`: "sync state").
    synced: list[tuple[str, float]] = []

    async def sync_with(peer: str) -> None:
        synced.append((peer, trio.current_time()))

    for first, expected in (["QmSource"], [("QmSource", 0.0)]), ([], []):
        synced.clear()
        rd = RunDocSync(first_peers=first)
        rd.live_peers, rd.signer = (lambda: []), SimpleNamespace(peer_id="QmMe")
        rd._sync_with = sync_with  # type: ignore[method-assign]
        with trio.move_on_after(5):
            await rd._anti_entropy_loop()
        assert synced == expected  # once, at the start: the source is no member after
        assert rd.first_sync.is_set() == bool(first)
