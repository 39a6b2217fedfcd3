"""A node's entry into the swarm: its first peers, the run's own entry points, and where
the next start of this state directory begins.

`connect()` dials the bootstrap sources in order (node/discovery/sources.py: the CLI's,
remembered peers, the manifest's when held here, mDNS) and says whether a peer answered;
once the run's manifest is verified, `dial_manifest_bootstrap` dials its
`network.bootstrap` and hands it to the redialer; `to_remember()` is what RememberPeers
writes for the next `node join <run-id>`: the run's members and the bootstrap peers that
answered.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from node.discovery import remembered
from node.discovery.sources import NoBootstrapPeer, Source, connect_first, how_to_give_one
from node.errors import BootstrapUnreachable
from protocols import manifest as mf

if TYPE_CHECKING:
    from node.discovery.mdns import MdnsService
    from node.membership.redial import Redialer
    from node.service import NodeContext

log = logging.getLogger("node")


class EntryPoints:
    def __init__(self, ctx: NodeContext, redialer: Redialer,
                 mdns: MdnsService | None = None) -> None:
        self.ctx = ctx
        self.redialer = redialer
        self.mdns = mdns
        self.reached: list[str] = []  # bootstrap addresses that answered at start

    def sources(self) -> list[Source]:
        """In order: the CLI's (flag, ticket, environment or config file), remembered peers,
        the manifest's when held here, mDNS (node/discovery/sources.py)."""
        config = self.ctx.config
        sources = [Source(config.bootstrap_from, list(config.bootstrap))]
        if config.run_id is None:
            return sources  # a bootstrap node is an entry point: it needs no other
        known = remembered.addresses(remembered.load(config.state_dir, config.run_id))
        sources.append(Source("remembered peers", known))
        if (local := self.ctx.runs.get(config.run_id)) is not None:
            manifest = mf.parse_canonical(local, expected_run_id=config.run_id)
            sources.append(Source("the manifest's network.bootstrap",
                                  list(manifest.network.bootstrap)))
        if self.mdns is not None:
            mdns = self.mdns
            sources.append(Source("mDNS", lookup=lambda: mdns.wait_for_peers(config.mdns_wait_s)))
        return sources

    async def connect(self) -> bool:
        """Dial the first bootstrap source that answers; True if a peer was reached."""
        config, substrate = self.ctx.config, self.ctx.substrate
        sources = self.sources()
        named = [s for s in sources if s.addrs]
        if not named and (config.run_id is None or (self.mdns is None
                                                    and self.ctx.runs.get(config.run_id))):
            return False  # an entry point, or the run's first node: others will dial us
        self.ctx.phases.enter("connecting")
        outcome = await connect_first(substrate, sources)
        if outcome.reached:
            self.reached = outcome.reached
            return True
        run_id = config.run_id
        if run_id is not None and self.ctx.runs.get(run_id) is not None and (
                not config.bootstrap):
            log.warning("no bootstrap peer reached; this node holds run %s and starts alone "
                        "(peers that know it will dial in)", run_id)
            return False
        if not outcome.failures:
            mdns = (f"; no peer answered on mDNS within {config.mdns_wait_s:g} s"
                    if self.mdns is not None else "")
            raise NoBootstrapPeer(f"no bootstrap peer is known for run {run_id}{mdns}: "
                                  + how_to_give_one(run_id))
        raise BootstrapUnreachable(
            "could not reach any bootstrap peer:\n  " + "\n  ".join(outcome.failures)
            + "\nCheck the address (and that the peer is up), or pass another --bootstrap.")

    async def dial_manifest_bootstrap(self, addrs: list[str]) -> None:
        """The run's own entry points (manifest `network.bootstrap`), once the manifest is
        known: dialed now where not yet connected, then kept by the redialer."""
        if not addrs:
            return
        self.redialer.add_bootstrap(addrs)
        connected = {p.to_base58() for p in self.ctx.substrate.connected_peers()}
        todo = [a for a in addrs if a.rsplit("/p2p/", 1)[-1] not in connected]
        if todo:
            outcome = await connect_first(self.ctx.substrate,
                                          [Source("the manifest's network.bootstrap", todo)],
                                          dial_timeout_s=5.0)
            if not outcome.reached:
                log.warning("none of the manifest's bootstrap peers answered; the redialer "
                            "keeps trying")

    def to_remember(self) -> dict[str, list[str]]:
        """The run's members (run document and heartbeats) and the bootstrap peers that
        answered: where the next `node join <run-id>` of this state directory starts."""
        out: dict[str, list[str]] = {}
        for addr in self.reached:
            peer = addr.rsplit("/p2p/", 1)[-1]
            out.setdefault(peer, []).append(addr)
        out.update(self.ctx.membership.addresses())
        return out
