"""ReachabilityService: learns whether this node is reachable, maps a port if it is not.

Every node serves AutoNAT (node/reach/autonat.py: the dial-back on a fresh connection) and
asks up to `max_servers` connected peers to dial it back, at its listen addresses and at
the IPs peers saw it come from (a NAT's public side) with its listen port. Each round asks
servers at distinct IPs (one per IP, those not on our machine first); their answers go into
a window of recent answers, one vote per server IP (node/reach/autonat.py, `Window`), and
the majority is the verdict (`public`, `private`, `unknown`), in `node status`. It is
re-checked every `interval_s`; while it is unknown or the window is split, after
`retry_s`, doubling up to `interval_s`; at once when our candidate addresses change. A
verdict can change either way, and what hangs on it follows: the DHT mode here, relay
service and relayed addresses in node/reach/relays.py, who drives a punch.

A private node asks its gateway for a TCP port mapping (UPnP IGD via miniupnpc), announces
the mapped address, checks again (a mapping only counts once a peer reached us through
it), renews the mapping at half its lease and removes it when the node stops. A gateway
that is absent or refuses is one log line and `upnp.error` in status; the node keeps going
(it stays private, retried every `upnp_retry_s`).

Only a public node serves the DHT; a private one runs it in client mode (py-libp2p's
`switch_mode`): peers cannot dial it, so it must not sit in their routing tables.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import trio

from node.reach.autonat import PROTOCOL_ID, Answer, Window, ask, server_handler
from node.reach.upnp import Gateway, Mapping, UpnpError
from node.service import NodeContext
from p2p.host import Substrate

log = logging.getLogger("node.reach")


class ReachabilityService:
    name = "reach"
    protocols = (PROTOCOL_ID,)

    def __init__(self, *, upnp: bool = True, interval_s: float = 120.0, retry_s: float = 5.0,
                 window: int = 8, window_s: float = 900.0, max_servers: int = 5,
                 lease_s: int = 3600, upnp_retry_s: float = 600.0,
                 gateway: Gateway | None = None) -> None:
        self.upnp_enabled = upnp
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.window = Window(size=window, max_age_s=window_s)
        self._uncertain = 0  # checks in a row that left us unknown or split
        self.max_servers = max_servers
        self.lease_s = lease_s
        self.upnp_retry_s = upnp_retry_s
        self.gateway = gateway or Gateway()
        self.state = "unknown"
        self.via: str | None = None
        self.checks = 0
        self.checked_at: float | None = None
        self.answers: list[Answer] = []
        self.candidates: list[str] = []
        self.mapping: Mapping | None = None
        self.upnp_state = "off" if not upnp else "idle"
        self.upnp_error: str | None = None
        self.renewals = 0
        self._upnp_failed_at: float | None = None
        self.changed = trio.Event()  # set after each check (tests wait on it)
        self.dht_mode = "server"
        # An address a peer reached us at that we did not advertise (a full-cone NAT's
        # public side with our listen port): advertised while we are public through it.
        self.public_addr: str | None = None

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sub = ctx.substrate
        sub.set_handler(PROTOCOL_ID, server_handler(sub))
        if self.upnp_enabled and all(_loopback(str(a)) for a in sub.listen):
            # no gateway stands between loopback and anyone; SSDP would only multicast on
            # the LAN for nothing (a loopback testnet must send nothing off this machine)
            self.upnp_enabled, self.upnp_state = False, "off (loopback only)"
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    await self.check(sub)
                    if self._want_mapping():
                        await self._map(sub, nursery)
                    await sub.set_dht_server(self.state != "private")
                    self.dht_mode = "server" if sub.dht_server else "client"
                    await self._wait(sub)
        finally:
            if self.mapping is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                    await self._unmap(sub)

    def verdict(self) -> str:
        """`public`, `private` or `unknown` (the relay service asks)."""
        return self.state

    def mapped(self) -> bool:
        """Whether we hold a UPnP mapping now (the path service asks)."""
        return self.mapping is not None

    def lane_dialable(self) -> bool:
        """Can a peer connect to a fresh TCP port of ours (a bulk lane's listener)? Not
        from behind a NAT, nor through a UPnP mapping: it maps the libp2p port alone.
        Unknown counts as yes (loopback testnets never learn; a lane that fails falls
        back to the libp2p stream)."""
        return self.state != "private" and self.mapping is None

    async def _wait(self, sub: Substrate) -> None:
        """Until the next check: the interval; while uncertain (unknown, or votes on both
        sides) `retry_s`, doubling per uncertain check up to the interval; sooner if our
        candidates changed."""
        wait = self.next_wait()
        deadline = trio.current_time() + wait
        while trio.current_time() < deadline:
            await trio.sleep(min(1.0, max(0.0, deadline - trio.current_time())))
            if self._candidates(sub) != self.candidates:
                return

    def next_wait(self) -> float:
        if self._uncertain == 0:
            return self.interval_s
        return min(self.interval_s, self.retry_s * 2 ** (self._uncertain - 1))

    def _candidates(self, sub: Substrate) -> list[str]:
        """Where a peer might reach us: listen and announced addresses, and each IP peers
        saw us at with each listen port (a port-preserving NAT, a full-cone NAT)."""
        own = [a.split("/p2p/")[0] for a in sub.addrs() if "/p2p-circuit" not in a]
        seen = [f"/ip4/{ip}/tcp/{port}" for ip in sub.observed_ips()
                for port in sub.listen_ports()]
        return sorted(set(own) | set(seen))

    async def check(self, sub: Substrate) -> str:
        """One round: ask up to `max_servers` connected peers at distinct IPs; add their
        answers to the window; the window's majority is the verdict."""
        self.candidates = self._candidates(sub)
        servers = self._servers(sub)
        answers: list[Answer] = []

        async def one(server, ip: str, local: bool) -> None:
            answer = await ask(sub, server, self.candidates)
            answer.ip, answer.local = ip, local
            answers.append(answer)

        async with trio.open_nursery() as nursery:
            for server, ip, local in servers:
                nursery.start_soon(one, server, ip, local)
        now = trio.current_time()
        for a in answers:
            self.window.add(a, now)
        self.answers = answers
        return self._decide(sub, now)

    def _servers(self, sub: Substrate) -> list[tuple[Any, str, bool]]:
        """(peer, its IP, on our machine) for up to `max_servers` directly connected
        peers, one per IP, those on other machines first (a relayed-only peer's IP is its
        relay's: not asked)."""
        peers = [p for p in sub.connected_peers() if p != sub.peer_id]
        if not peers:
            return []
        random.shuffle(peers)
        net = sub.network()
        by_ip: dict[str, tuple[Any, str, bool]] = {}
        for peer in peers:
            for ip in sub.peer_ips(peer):
                by_ip.setdefault(ip, (peer, ip, net.is_own(ip)))
        chosen, used = [], set()
        for server in sorted(by_ip.values(), key=lambda s: s[2]):  # other machines first
            if server[0] not in used:
                used.add(server[0])
                chosen.append(server)
        return chosen[:self.max_servers]

    def _decide(self, sub: Substrate, now: float) -> str:
        """Apply the window's verdict. No votes (none yet, or all expired) or a tie keeps
        what we knew; a majority the other way changes it."""
        before = self.state
        state = self.window.decide(now)
        yes, no = self.window.tally(now)
        if state != "unknown":
            self.state = state
            votes = self.window.current(now)
            reached = {a.addr for a in votes if a.status == "reached"}
            mapped = self.mapping.multiaddr if self.mapping else None
            self.via = None if state != "public" else (
                "upnp" if mapped and any(r and r.startswith(mapped) for r in reached)
                else "direct")
            self._advertise_reached(sub, reached if self.via == "direct" else set())
        uncertain = self.state == "unknown" or (yes > 0 and no > 0)
        self._uncertain = self._uncertain + 1 if uncertain else 0
        self.checks += 1
        self.checked_at = time.time()
        if self.state != before:
            log.info("reachability: %s%s (%d public, %d private votes; this round: %s)",
                     self.state, f" via {self.via}" if self.via else "", yes, no,
                     _summary(self.answers))
        self.changed.set()
        self.changed = trio.Event()
        return self.state

    def _advertise_reached(self, sub: Substrate, reached: set[str | None]) -> None:
        """Advertise the address peers reached us at when it is not one we advertise
        already (behind a full-cone NAT: the gateway's address with our port), so that
        dialers find it; withdraw it when we are no longer reached there. Without it a
        full-cone node was public but advertised only its LAN address."""
        own = {a.split("/p2p/")[0] for a in sub.addrs() if "/p2p-circuit" not in a}
        if self.public_addr is not None:
            own.discard(self.public_addr)
        new = sorted(r for r in reached if r and r not in own)
        want = new[0] if new else None
        if want == self.public_addr:
            return
        if self.public_addr is not None:
            sub.withdraw(self.public_addr)
        if want is not None:
            sub.announce(want)
            log.info("reachability: peers reach us at %s; advertising it", want)
        self.public_addr = want

    def _want_mapping(self) -> bool:
        if not self.upnp_enabled or self.state != "private" or self.mapping is not None:
            return False
        failed = self._upnp_failed_at
        return failed is None or trio.current_time() - failed >= self.upnp_retry_s

    async def _map(self, sub: Substrate, nursery: trio.Nursery) -> None:
        ports = sub.listen_ports()
        if not ports:
            return
        self.upnp_state = "mapping"
        try:
            if self.gateway.url is None:
                await self.gateway.discover()
            self.mapping = await self.gateway.map(ports[0], self.lease_s)
        except Exception as e:  # UpnpError, or a gateway's nonsense miniupnpc let through
            if not isinstance(e, UpnpError):
                e = UpnpError(f"the gateway's answer broke miniupnpc ({e!r})")
            self.upnp_state, self.upnp_error = "failed", str(e)
            self._upnp_failed_at = trio.current_time()
            log.warning("upnp: %s; staying %s (retry in %.0f s)", e, self.state,
                        self.upnp_retry_s)
            return
        self.upnp_state, self.upnp_error = "mapped", None
        sub.announce(self.mapping.multiaddr)
        log.info("upnp: gateway %s mapped %s -> port %d (lease %d s)", self.gateway.url,
                 self.mapping.multiaddr, self.mapping.internal_port, self.lease_s)
        nursery.start_soon(self._renew, sub)
        await self.check(sub)

    async def _renew(self, sub: Substrate) -> None:
        while self.mapping is not None:
            await trio.sleep(max(1.0, self.lease_s / 2))
            try:
                self.mapping = await self.gateway.map(self.mapping.internal_port, self.lease_s)
                self.renewals += 1
                self.upnp_error = None
            except Exception as e:  # kept announced: the old lease may still run
                self.upnp_error = f"renewal failed: {e}"
                log.warning("upnp: renewal failed: %s", e)

    async def _unmap(self, sub: Substrate) -> None:
        mapping, self.mapping = self.mapping, None
        if mapping is None:
            return
        sub.withdraw(mapping.multiaddr)
        try:
            await self.gateway.unmap(mapping)
            log.info("upnp: removed the mapping %s", mapping.multiaddr)
            self.upnp_state = "removed"
        except Exception as e:
            log.warning("upnp: %s", e)

    def statistics(self) -> dict[str, Any]:
        return {
            "reachability": self.state,
            "via": self.via,
            "dht": self.dht_mode,
            "checks": self.checks,
            "checked_at": round(self.checked_at, 3) if self.checked_at else None,
            "candidates": self.candidates,
            "public_addr": self.public_addr,
            "answers": [vars(a) for a in self.answers],
            "votes": {ip: a.vote for ip, a in self.window.votes.items()},
            "upnp": {"state": self.upnp_state, "gateway": self.gateway.url,
                     "mapping": self.mapping.multiaddr if self.mapping else None,
                     "lease_s": self.lease_s if self.mapping else None,
                     "renewals": self.renewals, "error": self.upnp_error},
        }


def _summary(answers: list[Answer]) -> str:
    counts: dict[str, int] = {}
    for a in answers:
        counts[a.status] = counts.get(a.status, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no peer to ask"


def _loopback(addr: str) -> bool:
    parts = addr.split("/")
    return len(parts) > 2 and (parts[2].startswith("127.") or parts[2] == "::1")
