"""Inbound connection slots: held while that connection is open, not for the swarm's life.

py-libp2p 0.8.1 caps inbound connections with a `trio.CapacityLimiter` of
`max_connections - min_connections` tokens (300 - 50 = 250): `_handle_inbound_connection`
takes one per accepted socket and gives it back when `_do_handle_inbound_connection`
returns. That returns only when the whole swarm stops: after the upgrade it waits on
`self.manager.wait_finished()`, to keep the handler task alive. So every inbound connection
a node ever accepted kept its token, and after 250 of them (joiners, reconnects, AutoNAT
dial-backs) every new TCP connection was closed before its handshake, logged at debug
only: a public node stopped taking peers by itself. The cap came with py-libp2p PR #1426
(commit 9ba29c42, "atomic inbound connection cap via CapacityLimiter.acquire_nowait()",
whose message says the slot is released "when the connection ends"); we found no
upstream issue or fix for the leak (libp2p/py-libp2p's issues and its main and fix-pr-1426
branches, searched 2026-11).

`InboundSlots.install(swarm)` keeps py-libp2p's own inbound path (its connection gate,
upgrade, `add_conn`, cleanup) and ends that path's barrier when the connection it upgraded
closes, so the token comes back then. It also:

* counts connections refused because every slot is taken, and says so in the log (one
  line per `log_every_s` at most, with the count since the last); `node status` shows the
  counts (`p2p.inbound`);
* holds one peer to `per_peer` connections: the per-IP budget (p2p/gate.py) does not
  tell identities apart, and py-libp2p trims a peer's extra connections only once they
  are older than its 20 s grace period, so one identity could take every slot in a burst.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import IMuxedConn
from libp2p.network.exceptions import SwarmException

log = logging.getLogger(__name__)

PER_PEER = 8  # connections of one peer: a direct and a relayed one, a simultaneous dial, ...
LOG_EVERY_S = 60.0


@dataclass
class _Pending:
    """The connection one inbound handler upgraded (set once the upgrade is done)."""

    conn: Any = None
    upgraded: trio.Event = field(default_factory=trio.Event)


class InboundSlots:
    """py-libp2p's inbound slots, released when their connection closes; refusals counted."""

    def __init__(self, per_peer: int = PER_PEER, *, log_every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_peer = per_peer
        self.log_every_s = log_every_s
        self.clock = clock
        self.accepted = 0  # inbound connections that got a slot
        self.refused: Counter[str] = Counter()  # reason -> connections refused
        self._limiter: trio.CapacityLimiter | None = None
        self._pending: dict[Any, _Pending] = {}  # the handler's task -> its connection
        self._logged_at = -math.inf
        self._unlogged: Counter[str] = Counter()

    def install(self, swarm: Any) -> None:
        """Wrap `swarm`'s inbound path (once per swarm: a restarted host is a new one)."""
        if getattr(swarm, "_peertrain_slots", None) is self:
            return
        swarm._peertrain_slots = self
        self._limiter = swarm._inbound_limiter
        handle = swarm._handle_inbound_connection
        handle_admitted = swarm._do_handle_inbound_connection
        upgrade = swarm.upgrade_inbound_raw_conn

        async def handle_inbound(read_write_closer: Any, maddr: Any) -> None:
            task = trio.lowlevel.current_task()
            try:
                await handle(read_write_closer, maddr)
            except BaseException:  # the swarm stopping
                self._pending.pop(task, None)
                raise
            # py-libp2p returns without calling its inner handler only when no slot was free
            if self._pending.pop(task, None) is None:
                self._refuse("slots_full", _remote(read_write_closer))

        async def handle_admitted_until_closed(read_write_closer: Any, maddr: Any,
                                               failure_event: Any) -> None:
            task = trio.lowlevel.current_task()
            pending = self._pending[task] = _Pending()
            if isinstance(read_write_closer, IMuxedConn):  # QUIC: no upgrade of ours
                pending.conn = read_write_closer
                pending.upgraded.set()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_when_closed, pending, nursery.cancel_scope)
                # its barrier (`manager.wait_finished()`) is cancelled when the connection
                # closes; `except Exception` there does not catch trio.Cancelled
                await handle_admitted(read_write_closer, maddr, failure_event)
                nursery.cancel_scope.cancel()

        async def upgrade_counted(raw_conn: Any, maddr: Any) -> Any:
            muxed = await upgrade(raw_conn, maddr)
            pending = self._pending.get(trio.lowlevel.current_task())
            if pending is None:  # a relayed connection (the stop protocol): no slot
                return muxed
            peer = getattr(muxed, "peer_id", None)
            if peer is not None and len(swarm.connections.get(peer, ())) > self.per_peer:
                self._refuse("conns_per_peer", f"{peer} ({_remote(raw_conn)})")
                with trio.CancelScope(shield=True), trio.move_on_after(2), \
                        contextlib.suppress(Exception):
                    for conn in list(swarm.connections.get(peer, ())):
                        if conn.muxed_conn is muxed:
                            await conn.close()
                    await muxed.close()
                raise SwarmException(f"{peer} holds {self.per_peer} connections already")
            self.accepted += 1
            pending.conn = muxed
            pending.upgraded.set()
            return muxed

        swarm._handle_inbound_connection = handle_inbound
        swarm._do_handle_inbound_connection = handle_admitted_until_closed
        swarm.upgrade_inbound_raw_conn = upgrade_counted

    # -- refusals --------------------------------------------------------------------------

    def _refuse(self, reason: str, who: str) -> None:
        self.refused[reason] += 1
        self._unlogged[reason] += 1
        now = self.clock()
        if now - self._logged_at < self.log_every_s:
            return
        self._logged_at = now
        counts = ", ".join(f"{n} {r}" for r, n in sorted(self._unlogged.items()))
        self._unlogged.clear()
        log.warning("refused inbound connections (%s; the last from %s): %s", counts, who,
                    self._describe(), extra={"peer": "inbound", "reason": "inbound refused"})

    def _describe(self) -> str:
        limiter = self._limiter
        slots = int(limiter.total_tokens) if limiter is not None else "?"
        return (f"slots_full: all {slots} inbound slots in use; conns_per_peer: one peer "
                f"may hold {self.per_peer} connections")

    def statistics(self) -> dict[str, Any]:
        limiter = self._limiter
        return {
            "slots": int(limiter.total_tokens) if limiter is not None else None,
            "in_use": limiter.borrowed_tokens if limiter is not None else 0,
            "per_peer": self.per_peer,
            "accepted": self.accepted,
            "refused": dict(self.refused),
        }


async def _cancel_when_closed(pending: _Pending, scope: trio.CancelScope) -> None:
    await pending.upgraded.wait()
    await wait_closed(pending.conn)
    scope.cancel()


async def wait_closed(conn: Any) -> None:
    """Return once a muxed connection has closed (its `event_closed`, else by polling)."""
    event = getattr(conn, "event_closed", None)
    if isinstance(event, trio.Event):
        await event.wait()
        return
    while not conn.is_closed:
        await trio.sleep(1.0)


def _remote(conn: Any) -> str:
    with contextlib.suppress(Exception):
        host, port = conn.get_remote_address()
        return f"{host}:{port}"
    return "?"
