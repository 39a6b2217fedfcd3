"""Per-peer state py-libp2p (0.8.1) keeps for every identity it ever met, bounded.

A public node meets identities without end. Measured in-process (issue 26: a bootstrap
node, thousands of identities each connecting, identifying, pinging, leaving), most of
py-libp2p's per-peer maps are capped (the peerstore's peers and peer records and the
resource manager's per-peer token buckets at 1,000 entries each) but two grow with every
identity and are never emptied:

* the ping service's `_inbound_streams` (peer -> set of open ping streams): its handler
  discards the finished stream from the peer's set and leaves the empty set behind;
* the auto-connector's `_recent_disconnects` (peer -> time of its last disconnect), a
  re-dial backoff of 60 s whose entries are only swept once there are over 500 of them and
  then only those older than twice the backoff.

No upstream issue names these two leftovers (searched 2026-11-27); py-libp2p#1414 added the
ping service's per-peer stream limit that leaves the sets, and #1451 (PR #1426) pruned
other auto-connector caches.

`install(host)` wraps both where they are written: the ping handler drops a peer's set
once its last stream ends, and each recorded disconnect forgets the entries whose backoff
is over, and the oldest beyond `MAX_RECENT_DISCONNECTS`.
"""

from __future__ import annotations

import time
from typing import Any

from libp2p.abc import INetStream
from libp2p.host.ping import ID as PING_ID

# A disconnect's re-dial backoff outlives it this long at most; more disconnects than this
# within one backoff window (a flood of identities) forget the oldest first: a peer that
# is re-dialed a little early is no harm, memory without end is.
MAX_RECENT_DISCONNECTS = 1024


def install(host: Any) -> None:
    """Bound the per-peer maps of `host` (before its handlers are guarded by the gate)."""
    _bound_ping(host)
    _bound_recent_disconnects(host.get_network().auto_connector)


def _bound_ping(host: Any) -> None:
    handler = host.get_mux().handlers.get(PING_ID)
    service = getattr(handler, "__self__", None)
    streams = getattr(service, "_inbound_streams", None)
    if not isinstance(streams, dict):
        return  # not py-libp2p's PingService (a newer version): nothing to bound here

    async def handle_ping(stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            await handler(stream)
        finally:
            # no await here (py-libp2p's own clean-up awaits its lock, and a cancelled
            # stream skips it): done at once, atomic between trio's checkpoints
            mine = streams.get(peer)
            if mine is not None:
                mine.discard(stream)
                if not mine:
                    del streams[peer]

    host.set_stream_handler(PING_ID, handle_ping)


def _bound_recent_disconnects(connector: Any) -> None:
    recent = getattr(connector, "_recent_disconnects", None)
    if not isinstance(recent, dict):
        return
    record = connector.record_disconnect

    def record_disconnect(peer_id: Any) -> None:
        record(peer_id)
        forget_stale(recent, connector._disconnect_backoff, MAX_RECENT_DISCONNECTS)

    connector.record_disconnect = record_disconnect


def forget_stale(times: dict[Any, float], max_age_s: float, cap: int,
                 now: float | None = None) -> None:
    """Drop the entries of `times` (key -> wall time) older than `max_age_s`, then the
    oldest until at most `cap` remain. Below half the cap nothing is swept (cheap)."""
    if len(times) <= cap // 2:
        return
    now = time.time() if now is None else now
    for key in [k for k, t in times.items() if now - t > max_age_s]:
        del times[key]
    if len(times) > cap:
        for key in sorted(times, key=times.__getitem__)[: len(times) - cap]:
            del times[key]
