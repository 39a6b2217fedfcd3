"""Where a node finds its first peers: bootstrap sources, tried in order.

    1. the command line's --bootstrap or a ticket's addresses, else PEERTRAIN_BOOTSTRAP,
       else the config file's `bootstrap` (one of them: the CLI picks the highest, as a
       flag overrides the config; node/config.py `bootstrap_from` names which)
    2. peers remembered from earlier joins of the run (node/discovery/remembered.py)
    3. the run manifest's `network.bootstrap`, when the manifest is already held here
    4. mDNS on the local network, if a peer of the run answers within `mdns_wait_s`; when
       none of the peers it names can be reached, it is asked again for the peers that
       answered since, until no new one answers in time (node/discovery/mdns.py)

Each source's addresses are dialed in parallel; the first source that reaches a peer ends
the search (the redialer and the DHT find the rest). A source that reaches nobody is
logged with each failure and the next one is tried: a remembered peer that has left is a
warning, not an error. Only when every source fails is it an error (exit 3) listing every
failure; when there is no source at all it is an error at once, saying how to give one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from node.errors import BootstrapUnreachable
from p2p.host import DialError, Substrate

log = logging.getLogger("node.discovery")


class NoBootstrapPeer(BootstrapUnreachable):
    """No source named any peer: nothing to dial (exit 3, like an unreachable one)."""


@dataclass
class Source:
    name: str  # "--bootstrap", "remembered peers", "mDNS", ...
    addrs: list[str] = field(default_factory=list)
    # Resolved when its turn comes (mDNS waits a little for answers); None: `addrs` as is.
    # Asked again while what it gave could not be reached: each call gives new addresses.
    lookup: Callable[[], Awaitable[list[str]]] | None = None


@dataclass
class Outcome:
    source: str | None = None  # the source that reached a peer
    reached: list[str] = field(default_factory=list)  # addresses that answered
    failures: list[str] = field(default_factory=list)


def how_to_give_one(run_id: str | None) -> str:
    run = f" {run_id}" if run_id else ""
    return (f"pass --bootstrap MULTIADDR (or a ticket from `node run ticket{run}` on a node "
            "in the run, in place of the run-id), set PEERTRAIN_BOOTSTRAP, or add "
            "`bootstrap = [...]` to the config file (`node config path`)")


async def connect_first(substrate: Substrate, sources: list[Source],
                        dial_timeout_s: float = 10.0) -> Outcome:
    """Dial source by source until one reaches a peer; see the module docstring."""
    outcome = Outcome()
    for source in sources:
        reached: list[str] = []
        failures: list[str] = []
        tried: set[str] = set()
        while not reached:  # a lookup is asked again while its peers could not be reached
            addrs = list(source.addrs) if source.lookup is None else await source.lookup()
            addrs = [a for a in dict.fromkeys(addrs) if a not in tried]
            if not addrs:
                break
            tried.update(addrs)
            await _dial_all(substrate, addrs, dial_timeout_s, reached, failures)
        if not tried:
            continue
        outcome.failures += [f"{source.name}: {f}" for f in failures]
        if reached:
            for f in failures:
                log.warning("bootstrap (%s): %s", source.name, f)
            log.info("reached %d peer(s) through %s", len(reached), source.name)
            outcome.source, outcome.reached = source.name, reached
            return outcome
        log.warning("no peer answered from %s; trying the next source:\n  %s",
                    source.name, "\n  ".join(failures))
    return outcome


async def _dial_all(substrate: Substrate, addrs: list[str], timeout: float,
                    reached: list[str], failures: list[str]) -> None:
    """Dial every address at once; each lands in `reached` or, as its error, `failures`."""

    async def dial(addr: str) -> None:
        try:
            await substrate.connect(addr, timeout=timeout)
            reached.append(addr)
        except DialError as e:
            failures.append(str(e))

    async with trio.open_nursery() as nursery:
        for addr in addrs:
            nursery.start_soon(dial, addr)
