"""Heartbeats on each run's gossip topic: the live half of the membership view.

A training node publishes one heartbeat every `heartbeat_s` (addresses, role, device, step
and losses) and listens to everybody else's; a bootstrap node only listens, for each run
it serves. Each heartbeat is checked (protocols/heartbeat.py: the sender is the gossip
message's signed origin) before it enters the view; refusals are counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio
from libp2p.peer.id import ID

from node.service import NodeContext
from protocols import heartbeat as hb
from protocols.errors import RemoteProtocolError

log = logging.getLogger("node.membership")

FIRST_BEATS, FIRST_BEATS_S = 4, 0.25  # a new node's first heartbeats, this far apart


class HeartbeatService:
    name = "membership"
    protocols = ()  # gossip topics only: /peertrain/<run-id>/hb/1

    def __init__(self, runs: list[str], *, publish: bool, interval_s: float) -> None:
        self.runs, self.publish, self.interval_s = runs, publish, interval_s
        self.sent = 0
        self.rejected = 0
        self.epoch = time.time_ns() // 1_000_000  # orders our beats across restarts
        self._ctx: NodeContext | None = None

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._ctx = ctx
        async with trio.open_nursery() as nursery:
            for run_id in self.runs:
                nursery.start_soon(self._listen, ctx, run_id)
                if self.publish:
                    nursery.start_soon(self._publish, ctx, run_id)
            task_status.started()

    def statistics(self) -> dict[str, Any]:
        ctx = self._ctx
        view = ctx.membership.statistics() if ctx else {}
        return {**view, "heartbeats_sent": self.sent, "rejected_heartbeats": self.rejected}

    async def _publish(self, ctx: NodeContext, run_id: str) -> None:
        topic = hb.topic(run_id)
        while True:
            self.sent += 1
            beat = hb.Heartbeat(ctx.peer_id, self.sent, tuple(ctx.substrate.addrs()),
                                role="node", device=ctx.device, stats=ctx.own_stats(),
                                epoch=self.epoch)
            ctx.publisher.publish_nowait(topic, beat.encode())
            # The first few come sooner: right after joining, gossip has no mesh for the
            # topic yet and a beat can reach nobody; peers then list us one interval later.
            await trio.sleep(min(self.interval_s, FIRST_BEATS_S)
                             if self.sent <= FIRST_BEATS else self.interval_s)

    async def _listen(self, ctx: NodeContext, run_id: str) -> None:
        topic = hb.topic(run_id)
        while True:  # re-subscribe if the host restarts
            await ctx.substrate.ready.wait()
            pubsub = ctx.substrate.pubsub
            assert pubsub is not None
            subscription = await pubsub.subscribe(topic)
            try:
                while True:
                    msg = await subscription.get()
                    sender = ID(msg.from_id).to_base58()
                    if sender == ctx.peer_id:
                        continue
                    try:
                        beat = hb.decode(msg.data, sender)
                    except RemoteProtocolError as e:
                        self.rejected += 1
                        ctx.substrate.gate.penalize(sender, "invalid_gossip")
                        log.info("rejected heartbeat from %s: %s", sender, e,
                                 extra={"peer": sender, "reason": "bad heartbeat"})
                        continue
                    first = ctx.membership.first_peer_after_s is None
                    if ctx.membership.heard(beat):
                        if first and ctx.membership.first_peer_after_s is not None:
                            log.info("first peer seen after %.2f s: %s",
                                     ctx.membership.first_peer_after_s, beat.peer)
                        else:
                            log.info("peer joined: %s", beat.peer)
            except Exception as e:
                log.warning("heartbeat subscription ended (%r); re-subscribing", e)
                await trio.sleep(0.5)

