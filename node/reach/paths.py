"""PathService: how this node reaches each connected peer, and the round-trip time there.

A peer's path is the best of its open connections, as a kind:

| kind | the connection |
|---|---|
| `punched` | opened by a DCUtR hole punch (node/reach/punch.py labels it) |
| `upnp` | came in through our gateway's UPnP mapping (inbound while we hold one) |
| `webrtc` | (reserved: a labeller for WebRTC data channels plugs in like the punch's) |
| `direct` | any other TCP connection, either direction |
| `relayed via X` | only through the circuit relay X |

A labeller is a callable connection -> kind or None; services that open connections of a
kind of their own hand theirs to the daemon, which passes them here (`labellers`), in
order of preference. A dialer sees a peer's UPnP mapping as `direct`: nothing in a
peer's addresses says which one is a mapping.

RTT is measured with libp2p ping (`/ipfs/ping/1.0.0`, which every host serves) every
`every_s` on each connected peer, over the connection new streams take (the best path),
and smoothed (EWMA, 1/4 weight per sample). 32 bytes each way per peer and period.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from node.service import NodeContext
from p2p.host import Substrate, is_relayed, relay_of

log = logging.getLogger("node.paths")

KINDS = ("punched", "upnp", "webrtc", "direct", "relayed")  # best first
PING = TProtocol("/ipfs/ping/1.0.0")

Labeller = Callable[[Any], "str | None"]


def _inbound(conn: Any) -> bool:
    return str(getattr(getattr(conn, "direction", None), "name", "")).upper() == "INBOUND"


class PathService:
    name = "peer_paths"  # (`paths` in /api/status is the metrics service's direct/relayed map)
    protocols = ()

    def __init__(self, labellers: Sequence[Labeller] = (), *,
                 upnp_mapped: Callable[[], bool] = lambda: False, every_s: float = 10.0,
                 timeout_s: float = 5.0, max_peers: int = 64) -> None:
        self.labellers = list(labellers)
        self.upnp_mapped = upnp_mapped  # the reach service: do we hold a mapping now?
        self.every_s, self.timeout_s, self.max_peers = every_s, timeout_s, max_peers
        self.rtt_ms: dict[str, float] = {}
        self.rtt_at: dict[str, float] = {}  # unix time of the last sample
        self.ping_errors = 0
        self._sub: Substrate | None = None

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._sub = ctx.substrate
        task_status.started()
        while True:
            await trio.sleep(self.every_s)
            if ctx.substrate.host is not None:
                await self.measure(ctx.substrate)

    # -- the kind of each path ------------------------------------------------------------

    def kind(self, conn: Any) -> str:
        """One connection's kind: `relayed via X`, a labeller's kind, `upnp` or `direct`."""
        if is_relayed(conn):
            return f"relayed via {relay_of(conn) or '?'}"
        for label in self.labellers:
            try:
                k = label(conn)
            except Exception:
                k = None
            if k:
                return k
        if _inbound(conn) and self.upnp_mapped():
            return "upnp"
        return "direct"

    def paths(self, sub: Substrate | None = None) -> dict[str, str]:
        """Each connected peer's best path kind."""
        sub = sub or self._sub
        if sub is None or sub.host is None:
            return {}
        out = {}
        for peer, conns in sub.host.get_network().get_connections_map().items():
            kinds = [self.kind(c) for c in conns]
            if kinds:
                out[peer.to_base58()] = min(kinds, key=_rank)
        return out

    # -- RTT ---------------------------------------------------------------------------------

    async def measure(self, sub: Substrate) -> None:
        """One ping to each connected peer (at most `max_peers`), concurrently."""
        peers = sub.connected_peers()[:self.max_peers]
        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(self._ping, sub, peer)
        live = {p.to_base58() for p in sub.connected_peers()}
        for gone in set(self.rtt_ms) - live:
            self.rtt_ms.pop(gone, None)
            self.rtt_at.pop(gone, None)

    async def _ping(self, sub: Substrate, peer: ID) -> None:
        key = peer.to_base58()
        try:
            with trio.fail_after(self.timeout_s):
                rtt = await ping(sub, peer)
        except Exception as e:  # a peer going away, one without ping: no sample
            self.ping_errors += 1
            log.debug("ping %s: %r", key, e)
            return
        ms = rtt * 1000
        old = self.rtt_ms.get(key)
        self.rtt_ms[key] = ms if old is None else 0.75 * old + 0.25 * ms
        self.rtt_at[key] = time.time()

    def statistics(self) -> dict[str, Any]:
        paths = self.paths()
        by_kind = {k: 0 for k in KINDS}
        for p in paths.values():
            by_kind[_family(p)] += 1
        return {
            "peers": {peer: {"path": path, "rtt_ms": (round(self.rtt_ms[peer], 1)
                                                      if peer in self.rtt_ms else None)}
                      for peer, path in sorted(paths.items())},
            "by_kind": by_kind,
            "ping_errors": self.ping_errors,
        }


async def ping(sub: Substrate, peer: ID) -> float:
    """One libp2p ping round trip to `peer`, in seconds, on the connection new streams
    take."""
    assert sub.host is not None
    stream = await sub.host.new_stream(peer, [PING])
    try:
        payload = os.urandom(32)
        start = time.perf_counter()
        await stream.write(payload)
        got = b""
        while len(got) < 32:
            chunk = await stream.read(32 - len(got))
            if not chunk:
                raise ConnectionError("the peer closed the ping stream")
            got += chunk
        rtt = time.perf_counter() - start
        if got != payload:
            raise ValueError("the pong does not match the ping")
        return rtt
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await stream.close()


def _family(path: str) -> str:
    return "relayed" if path.startswith("relayed") else path if path in KINDS else "direct"


def _rank(path: str) -> int:
    return KINDS.index(_family(path))
