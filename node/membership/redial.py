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
* the run's members (addresses from the run document), while the node has fewer than
  `want_peers` connections;
* otherwise one random member every `probe_s`: two halves that each kept enough
  connections inside still find each other again.
A peer that fails waits `backoff_min_s`, doubling up to `backoff_max_s`, before the next
try; the cap bounds how long a healed partition goes unnoticed. After a redial succeeds
the DHT routing table is refreshed (a self-lookup), so the DHT is whole again as well.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import trio

from p2p.host import DialError, Substrate, parse_peer_addr

log = logging.getLogger("node.membership")


@dataclass
class RedialStats:
    redials: int = 0  # successful dials of a peer we had lost or never reached
    failures: int = 0
    last_redial: str | None = None


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
        probe_s: float = 10.0,
        dial_timeout_s: float = 5.0,
        max_parallel: int = 4,
    ) -> None:
        self.substrate = substrate
        self.bootstrap: dict[str, list[str]] = {}
        self.add_bootstrap(bootstrap)
        self.members = members
        self.interval_s, self.probe_s = interval_s, probe_s
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self.want_peers, self.dial_timeout_s = want_peers, dial_timeout_s
        self.stats = RedialStats()
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

    def due(self, now: float) -> dict[str, list[str]]:
        """Peers to dial now, with their addresses."""
        me = self.substrate.peer_id.to_base58()
        connected = {p.to_base58() for p in self.substrate.connected_peers()}
        known = {
            p: a
            for p, a in self.members().items()
            if p != me
            and p not in connected
            and isinstance(a, list)
            and all(isinstance(x, str) for x in a)
        }
        out = {p: a for p, a in self.bootstrap.items() if p not in connected}
        if len(connected) < self.want_peers:
            out.update(known)
        elif known and now - self._last_probe >= self.probe_s:
            self._last_probe = now
            peer = random.choice(sorted(known))
            out[peer] = known[peer]
        return {p: a for p, a in out.items() if a and self._next_try.get(p, 0.0) <= now}

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

        async with trio.open_nursery() as nursery:
            for peer, addrs in self.due(trio.current_time()).items():
                nursery.start_soon(dial, peer, addrs)
        return reached

    def statistics(self) -> dict[str, object]:
        now = trio.current_time()
        return {
            "redials": self.stats.redials,
            "failures": self.stats.failures,
            "last_redial": self.stats.last_redial,
            "backing_off": {p: round(t - now, 1) for p, t in self._next_try.items() if t > now},
        }
