"""Redialing: keeps a node connected to its bootstrap peers and to the run's members.

Why it exists: gossip only flows over open connections, so a node whose connections were
cut (a network partition, a restarted bootstrap, a NAT that forgot its mappings) stays in
its own island until something dials across. py-libp2p 0.8.1's AutoConnector does redial
peers from its peerstore, but with no bound we can rely on: it polls every 10 s and backs
a failing peer off 5, 15, 20, 40 s ... up to 60 s (below 50 connections) or 300 s. In the
4-node partition testnet it reconnected the halves within 0.2-2 s of the heal in 8 trials
(and after ~14 s in 3 earlier ones), about what it takes with this redialer too; the point
of the redialer is the bound: a lost peer is retried at least every `backoff_max_s`, at
the addresses the run document has now, and the DHT routing table is refreshed after.

Every `interval_s` the redialer dials, among the peers it is not connected to:
* the bootstrap peers, always;
* while the node has fewer than `want_peers` connections, as many run members as it lacks
  (not every member: in a run of 10,000 that was 10,000 dials), drawn at random, the live
  ones (heard by heartbeat) first, then the run document's other recent members;
* otherwise one random member every `probe_s`: two halves that each kept enough
  connections inside still find each other again.
And while it holds more than `max_peers` connections (peers dial us, averaging partners
are dialed on demand), it closes the excess: random peers among those not protected
(bootstraps, connections younger than `grace_s`, what `protect()` names), peers that are
not live members first. `plan_connections` is that policy, pure, for the simulator too.
A peer that fails waits `backoff_min_s`, doubling up to `backoff_max_s`, before the next
try; the cap bounds how long a healed partition goes unnoticed. After a redial succeeds
the DHT routing table is refreshed (a self-lookup), so the DHT is whole again as well.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID

from p2p.host import DialError, Substrate, parse_peer_addr

log = logging.getLogger("node.membership")


def plan_connections(connected: Collection[str], members: Mapping[str, object], *,
                     want: int, max_peers: int, rng: random.Random,
                     live: Collection[str] = (), protected: Collection[str] = (),
                     probe: bool = False) -> tuple[list[str], list[str]]:
    """The connection bound: (members to dial, connected peers to close).

    `connected`: every peer we hold a connection to; `members`: the run members we may dial
    (not connected ones are the candidates; those backing off already left out). Dials: up
    to `want - len(connected)` members, live ones first, each group shuffled; at or above
    `want`, one random member if `probe`. Closes: `len(connected) - max_peers` peers
    outside `protected`, those not `live` first, each group shuffled. So a node opens at
    most max(want, 1) dials a pass and, `protected` aside, keeps at most `max_peers`."""
    if want < 0 or max_peers < want:
        raise ValueError(f"need 0 <= want ({want}) <= max_peers ({max_peers})")
    conn, alive = set(connected), set(live)
    candidates = sorted(p for p in members if p not in conn)
    dial: list[str] = []
    if (deficit := want - len(conn)) > 0:
        first = [p for p in candidates if p in alive]
        rest = [p for p in candidates if p not in alive]
        rng.shuffle(first)
        rng.shuffle(rest)
        dial = (first + rest)[:deficit]
    elif probe and candidates:
        dial = [rng.choice(candidates)]
    close: list[str] = []
    if (excess := len(conn) - max_peers) > 0:
        keep = set(protected)
        closable = sorted(p for p in conn if p not in keep)
        idle = [p for p in closable if p not in alive]
        busy = [p for p in closable if p in alive]
        rng.shuffle(idle)
        rng.shuffle(busy)
        close = (idle + busy)[:excess]
    return dial, close


async def dial_partner(substrate: Substrate, peer: str, addrs: list[str], *,
                       timeout_s: float = 5.0, tries: int = 3) -> bool:
    """Connect to an averaging partner we hold no connection to (issue 30: partners come
    from the whole live view, and a node keeps ~want_peers of them connected, so most of
    a round's partners are not): at most `tries` of the addresses its heartbeat or run
    document entry gave, the first that answers. The redialer's `max_peers` trim spares
    this round's partners (`protect`), so the connection lasts the exchange; past it the
    trim closes it like any other. True once connected (or already)."""
    if any(p.to_base58() == peer for p in substrate.connected_peers()):
        return True
    for addr in addrs[:tries]:
        full = addr if "/p2p/" in addr else f"{addr}/p2p/{peer}"
        try:
            await substrate.connect(full, timeout=timeout_s)
            return True
        except DialError as e:
            log.debug("averaging partner %s not reached at %s: %s", peer, addr, e.reason)
        except ValueError:  # a malformed address in a peer's own entry
            continue
    return False


@dataclass
class RedialStats:
    redials: int = 0  # successful dials of a peer we had lost or never reached
    failures: int = 0
    last_redial: str | None = None
    closed: int = 0  # connections closed past max_peers


class Redialer:
    """One per node, started in its nursery; `members()` gives peer id -> multiaddrs (the
    membership view's `addresses`). Built with the host it dials rather than reading it
    from the node context, so that tests drive it with a fake host."""

    name = "redial"
    protocols = ()

    def __init__(
        self,
        substrate: Substrate,
        bootstrap: list[str],
        members: Callable[[], dict[str, list[str]]],
        *,
        interval_s: float = 1.0,
        backoff_min_s: float = 1.0,
        backoff_max_s: float = 8.0,
        want_peers: int = 8,
        max_peers: int = 32,
        grace_s: float = 60.0,
        probe_s: float = 10.0,
        dial_timeout_s: float = 5.0,
        max_parallel: int = 4,
        live: Callable[[], list[str]] = list,
        protect: Callable[[], set[str]] = set,
        rng: random.Random | None = None,
    ) -> None:
        self.substrate = substrate
        self.bootstrap: dict[str, list[str]] = {}
        self.add_bootstrap(bootstrap)
        self.members = members
        self.interval_s, self.probe_s = interval_s, probe_s
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self.want_peers, self.dial_timeout_s = want_peers, dial_timeout_s
        self.max_peers, self.grace_s = max(max_peers, want_peers), grace_s
        self.live, self.protect = live, protect
        self.rng = rng or random.Random()
        self.stats = RedialStats()
        self._connected_since: dict[str, float] = {}  # peer -> when a tick first saw it
        self._limit = trio.CapacityLimiter(max_parallel)
        # Times are trio's clock (trio.current_time()), so tests can drive the backoff with
        # trio's MockClock instead of editing these tables.
        self._next_try: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._last_probe = float("-inf")  # never probed: the first pass probes

    def add_bootstrap(self, addrs: list[str]) -> None:
        """Keep these peers connected too (the run manifest's bootstrap, once known)."""
        for addr in addrs:
            try:
                peer = parse_peer_addr(addr).peer_id.to_base58()
            except DialError:
                continue  # reported by the first connect already
            if addr not in self.bootstrap.get(peer, []):
                self.bootstrap.setdefault(peer, []).append(addr)

    async def run(self, ctx: object = None, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.interval_s)
            await self.substrate.ready.wait()
            if await self.tick():
                dht = self.substrate.dht
                if dht is not None:
                    await dht.bootstrap()

    def plan(self, now: float) -> tuple[dict[str, list[str]], list[str]]:
        """Peers to dial now, with their addresses, and peers to disconnect."""
        me = self.substrate.peer_id.to_base58()
        connected = {p.to_base58() for p in self.substrate.connected_peers()}
        for p in [p for p in self._connected_since if p not in connected]:
            del self._connected_since[p]
        for p in connected:
            self._connected_since.setdefault(p, now)
        probe = now - self._last_probe >= self.probe_s
        # The members' addresses are a pass over the run document (50,000 entries at N =
        # 10,000): read only when a dial may follow.
        wanted = len(connected) < self.want_peers or probe
        known = {
            p: a
            for p, a in (self.members() if wanted else {}).items()
            if p != me
            and p not in connected
            and isinstance(a, list)
            and a
            and all(isinstance(x, str) for x in a)
            and self._next_try.get(p, 0.0) <= now
        }
        young = {p for p, t in self._connected_since.items() if now - t < self.grace_s}
        dial, close = plan_connections(
            connected, known, want=self.want_peers, max_peers=self.max_peers, rng=self.rng,
            live=self.live(), protected=set(self.bootstrap) | young | self.protect(),
            probe=probe)
        if probe and dial and len(connected) >= self.want_peers:
            self._last_probe = now
        out = {p: a for p, a in self.bootstrap.items() if p not in connected}
        out.update({p: known[p] for p in dial})
        return {p: a for p, a in out.items() if a and self._next_try.get(p, 0.0) <= now}, close

    def due(self, now: float) -> dict[str, list[str]]:
        """Peers to dial now, with their addresses."""
        return self.plan(now)[0]

    async def tick(self) -> int:
        """One pass; returns how many peers were reached."""
        reached = 0

        async def dial(peer: str, addrs: list[str]) -> None:
            nonlocal reached
            async with self._limit:
                for addr in addrs:
                    try:
                        await self.substrate.connect(addr, timeout=self.dial_timeout_s)
                    except DialError as e:
                        log.debug("redial %s: %s", peer, e)
                        continue
                    reached += 1
                    self.stats.redials += 1
                    self.stats.last_redial = peer
                    self._backoff.pop(peer, None)
                    self._next_try.pop(peer, None)
                    log.info("reconnected to %s via %s", peer, addr)
                    return
            self.stats.failures += 1
            wait = min(self.backoff_max_s, self._backoff.get(peer, self.backoff_min_s / 2) * 2)
            self._backoff[peer] = wait
            self._next_try[peer] = trio.current_time() + wait * random.uniform(0.8, 1.0)

        due, close = self.plan(trio.current_time())
        for peer in close:
            try:
                await self.substrate.disconnect(ID.from_base58(peer))
            except Exception as e:  # already gone, or a bad id: nothing to close
                log.debug("closing %s: %r", peer, e)
                continue
            self.stats.closed += 1
            log.info("closed the connection to %s: over max_peers (%d)", peer, self.max_peers)
        async with trio.open_nursery() as nursery:
            for peer, addrs in due.items():
                nursery.start_soon(dial, peer, addrs)
        return reached

    def statistics(self) -> dict[str, object]:
        now = trio.current_time()
        return {
            "redials": self.stats.redials,
            "failures": self.stats.failures,
            "last_redial": self.stats.last_redial,
            "connections": len(self._connected_since),
            "want_peers": self.want_peers,
            "max_peers": self.max_peers,
            "closed_over_max": self.stats.closed,
            "backing_off": {p: round(t - now, 1) for p, t in self._next_try.items() if t > now},
        }
