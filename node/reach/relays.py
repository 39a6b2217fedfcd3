"""RelayService: public nodes relay for the run; private nodes reserve on two and renew.

Every node speaks the stop side of circuit relay v2 (it accepts connections a relay brings
it). A node whose reachability verdict is `public` also relays (node/reach/relay.py, the
limits enforced); any other node refuses hop requests, so a relay is always a node others
could dial.

A `private` node (a symmetric or home NAT, no UPnP) keeps `want` reservations:

* candidates are the run's peers it is connected to (bootstrap peers, and the members it
  dialed from the run document and heartbeats) whose identify lists the hop protocol; a
  non-public candidate refuses and is retried after `retry_s`;
* each granted reservation adds `<relay addr>/p2p-circuit` to the node's addresses
  (identify, peer records, heartbeats, so the run document): a dialer tries the direct
  addresses first and falls back to these (`Substrate.connect` dials them);
* it is renewed at half its lifetime, and dropped (addresses withdrawn, another relay
  chosen) when the relay disconnects, refuses a renewal or expires.

A private node also dials directly every peer that reached it through a relay (a public
node that found only our relayed address): outbound dials work through our NAT. A peer
that advertises relayed addresses itself is private too: its own addresses are LAN ones,
and the hole-punch service (node/reach/punch.py) upgrades that path instead.

A node that turns public (a UPnP mapping) withdraws its relayed addresses.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import trio
from libp2p.peer.id import ID

from node.reach.relay import BoundedRelay, RelayLimits
from node.service import NodeContext
from p2p import circuit
from p2p.circuit import HOP_PROTOCOL, STOP_PROTOCOL
from p2p.host import Substrate

log = logging.getLogger("node.relay")


class RelayService:
    name = "relay"
    protocols = (HOP_PROTOCOL, STOP_PROTOCOL)

    def __init__(self, reachability: Callable[[], str], *, limits: RelayLimits | None = None,
                 want: int = 2, tick_s: float = 2.0, retry_s: float = 60.0,
                 reserve_timeout_s: float = 10.0, direct: bool = True) -> None:
        self.reachability = reachability  # the reach service's verdict
        self.server = BoundedRelay(limits or RelayLimits(),
                                   serving=lambda: self.reachability() == "public")
        self.want, self.tick_s, self.retry_s = want, tick_s, retry_s
        self.reserve_timeout_s = reserve_timeout_s
        self.held: dict[str, circuit.Reservation] = {}  # relay id -> our reservation
        self.announced: dict[str, list[str]] = {}  # relay id -> addresses we announced
        self.renewals = 0
        self.last_error: str | None = None
        self._retry_at: dict[str, float] = {}  # trio clock: when to ask a relay again
        self._renew_at: dict[str, float] = {}  # unix time: when to renew a reservation
        self._direct_at: dict[str, float] = {}  # trio clock: next direct dial to a peer
        self.upgraded = 0  # relayed peers we then reached directly
        self.direct = direct  # dial relayed peers directly (off: tests on loopback)
        self._paths: Callable[[], dict[str, str]] = dict

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sub = ctx.substrate
        self._paths = sub.peer_paths
        sub.set_handler(HOP_PROTOCOL, self._hop(sub))
        sub.set_handler(STOP_PROTOCOL, self._stop(sub))
        task_status.started()
        while True:
            await sub.ready.wait()
            try:
                await self._pass(sub)
            except Exception as e:  # a host restarting under us, a peer vanishing: the
                # node runs on; its reservations are checked again next pass
                self.last_error = f"{e!r}"
                log.warning("relay: %r (retrying in %.0f s)", e, self.tick_s)
            await trio.sleep(self.tick_s)

    async def _pass(self, sub: Substrate) -> None:
        self.server.attach(sub.host)
        if self.reachability() == "private":
            if self.direct:
                await self.go_direct(sub)
            await self.keep(sub)
        elif self.held:
            self._drop_all(sub, "this node is public now")

    def _hop(self, sub: Substrate):
        async def handle(stream) -> None:
            self.server.attach(sub.host)
            await self.server._handle_hop_stream(stream)
        return handle

    def _stop(self, sub: Substrate):
        async def handle(stream) -> None:
            self.server.attach(sub.host)
            await self.server._handle_stop_stream(stream)
        return handle

    # -- the client side: reservations ------------------------------------------------------

    async def keep(self, sub: Substrate) -> None:
        """One pass: drop lost reservations, renew those past half their life, reserve on
        new relays until `want` are held."""
        connected = {p.to_base58() for p in sub.connected_peers()}
        now = time.time()
        for relay in list(self.held):
            if relay not in connected:
                self._drop(sub, relay, "the relay disconnected")
            elif now >= self._renew_at.get(relay, 0.0):
                try:
                    self.held[relay] = await circuit.reserve(sub.require_host(),
                                                             ID.from_base58(relay),
                                                             self.reserve_timeout_s)
                    self._renew_at[relay] = _half_life(self.held[relay])
                    self.renewals += 1
                except circuit.CircuitError as e:
                    self._drop(sub, relay, f"renewal failed: {e}")
        if len(self.held) >= self.want:
            return
        for relay in self._candidates(sub, connected):
            if len(self.held) >= self.want:
                break
            await self._reserve(sub, relay)

    async def go_direct(self, sub: Substrate) -> None:
        """Peers that reached us through a relay (a public node dialing our relayed
        address) are dialed directly: outbound works through our NAT, the relay is spared,
        and the peer can become one of our relays (none relays over a relayed connection)."""
        now = trio.current_time()
        for peer, path in sub.peer_paths().items():
            if path == "direct" or self._direct_at.get(peer, 0.0) > now:
                continue
            if not sub.direct_addrs(ID.from_base58(peer)):
                continue  # identify has not told us yet; next pass
            if self._private(sub, peer):
                continue  # its addresses are LAN ones: the punch service's case
            self._direct_at[peer] = now + self.retry_s
            addr = await sub.connect_direct(ID.from_base58(peer))
            if addr is not None:
                self.upgraded += 1
                log.info("relay: %s reached us through a relay; now direct at %s", peer, addr)

    @staticmethod
    def _private(sub: Substrate, peer: str) -> bool:
        """A peer that advertises `/p2p-circuit` addresses holds reservations: private."""
        try:
            addrs = sub.host.get_peerstore().addrs(ID.from_base58(peer))  # type: ignore[union-attr]
        except Exception:
            return False
        return any("/p2p-circuit" in str(a) for a in addrs)

    def _candidates(self, sub: Substrate, connected: set[str]) -> list[str]:
        """Peers that might relay for us: directly connected (a relay refuses requests
        over a relayed connection), speaking hop, not refused lately."""
        store = sub.require_host().get_peerstore()
        now = trio.current_time()
        paths = sub.peer_paths()
        out = []
        for peer in connected - set(self.held):
            if paths.get(peer) != "direct":
                continue
            if self._retry_at.get(peer, 0.0) > now:
                continue
            try:
                protocols = store.get_protocols(ID.from_base58(peer))
            except Exception:
                continue
            if HOP_PROTOCOL in protocols:
                out.append(peer)
        random.shuffle(out)
        return out

    async def _reserve(self, sub: Substrate, relay: str) -> None:
        try:
            r = await circuit.reserve(sub.require_host(), ID.from_base58(relay),
                                      self.reserve_timeout_s)
        except circuit.CircuitError as e:
            self._retry_at[relay] = trio.current_time() + self.retry_s
            self.last_error = str(e)
            log.info("relay: no reservation on %s: %s (retry in %.0f s)", relay, e,
                     self.retry_s)
            return
        addrs = r.circuit_addrs() or self._fallback_addrs(sub, relay)
        self.held[relay] = r
        self._renew_at[relay] = _half_life(r)
        self.announced[relay] = addrs
        for a in addrs:
            sub.announce(a)
        self.last_error = None
        log.info("relay: reserved a slot on %s until %s; reachable at %s", relay,
                 time.strftime("%H:%M:%S", time.localtime(r.expires_unix)), " ".join(addrs))

    def _fallback_addrs(self, sub: Substrate, relay: str) -> list[str]:
        """The address we reached the relay at, for a relay that sent none."""
        out = []
        for conn in sub.require_host().get_network().get_connections(ID.from_base58(relay)):
            for a in conn.get_transport_addresses():
                if "/p2p-circuit" not in str(a):
                    out.append(f"{str(a).split('/p2p/')[0]}/p2p/{relay}/p2p-circuit")
        return out[:1]

    def _drop(self, sub: Substrate, relay: str, why: str) -> None:
        self.held.pop(relay, None)
        self._renew_at.pop(relay, None)
        for a in self.announced.pop(relay, []):
            sub.withdraw(a)
        self._retry_at[relay] = trio.current_time() + self.retry_s
        self.last_error = f"{relay}: {why}"
        log.info("relay: dropped the reservation on %s: %s", relay, why)

    def _drop_all(self, sub: Substrate, why: str) -> None:
        for relay in list(self.held):
            self._drop(sub, relay, why)

    def statistics(self) -> dict[str, Any]:
        return {
            "paths": self._paths(),
            "reservations": {relay: {"expires_unix": round(r.expires_unix),
                                     "addrs": self.announced.get(relay, []),
                                     "limit_s": r.limit_s, "limit_bytes": r.limit_bytes}
                             for relay, r in self.held.items()},
            "renewals": self.renewals,
            "direct_after_relay": self.upgraded,
            "error": self.last_error,
            "serving": self.server.statistics() if self.reachability() == "public" else None,
        }


def _half_life(r: circuit.Reservation) -> float:
    """When to renew: half way to the relay's expiry (its clock; a skewed clock at worst
    makes us renew early, or at once)."""
    now = time.time()
    return now + max(0.0, r.expires_unix - now) / 2
