"""Heartbeats on each run's gossip topic: the live half of the membership view.

A training node publishes a heartbeat (addresses, role, device, step and losses) every
`heartbeat_interval_s(view size, heartbeat_s, target)`: `heartbeat_s` in a small run, and
N / target in a run of N, so that each node receives about `target` heartbeats per second
however large the run grows (protocols/heartbeat.py). It listens to everybody else's; a
bootstrap node only listens, for each run it serves. Each heartbeat passes the inbound
limiter (a peer beating faster than the policy allows, or all peers together past the
bound, has the excess dropped and counted in `throttled_heartbeats`) and is checked (the
sender is the gossip message's signed origin) before it enters the view; refusals are
counted.
"""

from __future__ import annotations

import collections
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
RATE_WINDOW_S = 10  # the inbound rate shown is the mean over this many seconds


class RateMeter:
    """Events per second over the last `window_s` whole seconds (one counter per second)."""

    def __init__(self, window_s: int = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._counts: collections.deque[list[int]] = collections.deque()  # [second, count]

    def add(self, now: float, n: int = 1) -> None:
        second = int(now)
        if self._counts and self._counts[-1][0] == second:
            self._counts[-1][1] += n
        else:
            self._counts.append([second, n])
        self._trim(second)

    def rate(self, now: float) -> float:
        self._trim(int(now))
        return sum(c for _, c in self._counts) / self.window_s

    def _trim(self, second: int) -> None:
        while self._counts and self._counts[0][0] <= second - self.window_s:
            self._counts.popleft()


class HeartbeatService:
    name = "membership"
    protocols = ()  # gossip topics only: /peertrain/<run-id>/hb/1

    def __init__(self, runs: list[str], *, publish: bool, interval_s: float,
                 target_inbound_per_s: float = hb.TARGET_INBOUND_PER_S) -> None:
        self.runs, self.publish, self.interval_s = runs, publish, interval_s
        self.target = target_inbound_per_s
        self.limiter = hb.InboundLimiter(interval_s, target_inbound_per_s)
        self.inbound = RateMeter()  # heartbeats received (taken or not)
        self.sent = 0
        self.rejected = 0
        self.epoch = time.time_ns() // 1_000_000  # orders our beats across restarts
        self._ctx: NodeContext | None = None
        self._size: tuple[float, int] = (float("-inf"), 1)  # (when counted, view size)

    def view_size(self, now: float) -> int:
        """Peers heard recently, us included (`Membership.recent_count`: not the live
        view, which late heartbeats shrink on a loaded machine; 31 nodes on 2 cores sized
        by it beat every 1.0-1.25 s instead of 3.9 s, issue 30). Counted at most once a
        second (heartbeats arrive up to `target` times a second)."""
        when, size = self._size
        if now - when >= 1.0 and self._ctx is not None:
            size = self._ctx.membership.recent_count(now) + 1
            self._size = (now, size)
        return size

    def current_interval_s(self, now: float | None = None) -> float:
        """Seconds between our heartbeats at the view's current size."""
        now = time.monotonic() if now is None else now
        return hb.heartbeat_interval_s(self.view_size(now), self.interval_s, self.target)

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
        now = time.monotonic()
        return {**view, "heartbeats_sent": self.sent, "rejected_heartbeats": self.rejected,
                "heartbeat_interval_s": round(self.current_interval_s(now), 3),
                "inbound_heartbeats_per_s": round(self.inbound.rate(now), 2),
                "inbound_heartbeat_bound_per_s": round(
                    self.limiter.global_rate(self.view_size(now)), 1),
                "throttled_heartbeats": self.limiter.dropped}

    async def _publish(self, ctx: NodeContext, run_id: str) -> None:
        topic = hb.topic(run_id)
        while True:
            self.sent += 1
            interval = self.current_interval_s()
            beat = hb.Heartbeat(ctx.peer_id, self.sent, tuple(ctx.substrate.addrs()),
                                role="node", device=ctx.device, stats=ctx.own_stats(),
                                epoch=self.epoch, interval_ms=round(interval * 1000))
            ctx.publisher.publish_nowait(topic, beat.encode())
            # The first few come sooner: right after joining, gossip has no mesh for the
            # topic yet and a beat can reach nobody; peers then list us one interval later.
            # The interval is re-read each beat: a view that grew stretches the next one.
            await trio.sleep(min(interval, FIRST_BEATS_S)
                             if self.sent <= FIRST_BEATS else interval)

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
                    now = time.monotonic()
                    self.inbound.add(now)
                    if not self.limiter.admit(sender, now, self.view_size(now)):
                        log.debug("heartbeat from %s dropped: over the inbound bound", sender)
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
                    if ctx.membership.heard(beat, now,
                                            own_interval_s=self.current_interval_s(now)):
                        if first and ctx.membership.first_peer_after_s is not None:
                            log.info("first peer seen after %.2f s: %s",
                                     ctx.membership.first_peer_after_s, beat.peer)
                        else:
                            log.info("peer joined: %s", beat.peer)
            except Exception as e:
                log.warning("heartbeat subscription ended (%r); re-subscribing", e)
                await trio.sleep(0.5)

