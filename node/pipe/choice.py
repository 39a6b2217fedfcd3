"""Which stage this node hosts, and when it moves (docs/pipeline.md).

A joiner takes the stage with the fewest live hosts (placement.choose) and writes it in
its run-document namespace (`peer/<id>/stage`), its heartbeats and its leased claim
(claims.py); until training starts, nodes that joined together move apart
(placement.rebalance); once training, a node moves only to take over a stage left with no
host, through a bid on that stage's lease. Training starts once every stage has a host,
the replicas are balanced and the map has been stable for SETTLE_S.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import trio

from node.pipe import claims, convergence, placement
from node.pipe.convergence import FRESH_S
from node.pipe.replica_averaging import ReplicaAveraging
from node.pipe.stage_map import StageMap
from node.pipe.state import PipeState

if TYPE_CHECKING:
    from node.service import NodeContext

log = logging.getLogger("node.pipeline")

SETTLE_S = 3.0  # the stage map must hold this long before training starts
FIRST_VIEW_S = 3.0  # a joiner waits at most this for a first heartbeat before choosing


class StageChoice:
    def __init__(self, ctx: NodeContext, state: PipeState, stage_map: StageMap,
                 averaging: ReplicaAveraging | None = None) -> None:
        self.ctx = ctx
        self.state = state
        self.map = stage_map
        self.averaging = averaging

    async def choose(self) -> None:
        """The first choice, once a first view of the swarm has come."""
        ctx = self.ctx
        with trio.move_on_after(FIRST_VIEW_S):
            while ctx.membership.first_peer_after_s is None:
                await trio.sleep(0.1)
        # Heartbeats that queued while torch's import held this thread were stamped
        # live when processed, a killed host's among them, with old stats (seen: a
        # replacement took a stage whose host was dead, on a swarm step 2 minutes old).
        # One ttl later those have expired and every live peer has beaten again.
        if time.monotonic() - ctx.phases.started > ctx.config.peer_ttl_s:
            await trio.sleep(ctx.config.peer_ttl_s)
        self.set_stage(placement.choose(self.map.agreed_hosts(first_choice=True),
                                        self.state.n))

    def set_stage(self, stage: int) -> None:
        ctx, st = self.ctx, self.state
        assert ctx.run is not None
        if st.stage is not None and stage != st.stage:
            st.moves += 1
            st.recovery = None  # it said how the stage we leave started
            log.info("pipeline: moving from stage %d to stage %d", st.stage, stage)
        else:
            log.info("pipeline: hosting stage %d of %d", stage, st.n)
        st.stage = stage
        ctx.run.stage = stage  # heartbeats and the run document's stats carry it
        if self.averaging is not None:
            self.averaging.rekey()
        from node.run.rundoc_sync import now_ms, topic

        doc = ctx.run.document
        key = f"peer/{ctx.peer_id}/stage"
        doc.set(key, stage, now_ms())
        entry = doc.entry(key)
        if entry is not None:
            ctx.publisher.publish_nowait(topic(st.run_id), doc.encode_delta([entry]))
        if self.map.lease is not None:
            self.map.lease.hold(stage, now_ms())

    async def follow_membership(self) -> None:
        while True:
            await trio.sleep(self.ctx.config.heartbeat_s)
            self.follow_once()

    async def hold_lease(self) -> None:
        """Renew our stage claim while we host it; a stop (this task cancelled with the
        service) tombstones it, so the stage is free at once, not a lease later."""
        from node.run.rundoc_sync import now_ms

        lease = self.map.lease
        if lease is None:
            return
        try:
            while True:
                await trio.sleep(claims.RENEW_S / 3)
                lease.renew(now_ms())
        finally:
            with contextlib.suppress(Exception):
                lease.release(now_ms())

    def follow_once(self) -> None:
        """Keep the stage choice in line with the live view (placement.rebalance); a
        takeover only of a stage nobody heard lately hosts (convergence.recent_hosts)."""
        ctx, st, lease = self.ctx, self.state, self.map.lease
        # untrained nodes move apart by the agreed map; a trained one by its live view,
        # and then only through a bid on the stage's lease (bid)
        hosts = self.map.hosts() if st.training else self.map.agreed_hosts()
        move = placement.rebalance(ctx.peer_id, hosts, st.n, training=st.training,
                                   settled=self.map.settled(), uptime=self.map.uptimes())
        if lease is not None and lease.bid is not None and move != lease.bid:
            from node.run.rundoc_sync import now_ms

            lease.withdraw_bid(now_ms())  # the stage we bid for is not empty any more
        if move is None:
            return
        if not st.training:
            self.set_stage(move)
        elif st.move_to is None and st.worker is not None:
            heard = ctx.membership.book.live(time.monotonic() - (FRESH_S - ctx.config.peer_ttl_s))
            recent = convergence.recent_hosts(heard, move)
            if recent:
                st.counters["refused: takeover"] += 1
                log.info("pipeline: stage %d has no live host in this view, but %s was "
                         "heard within %.0f s: not taking it over", move, recent, FRESH_S)
                if lease is not None and lease.bid is not None:
                    from node.run.rundoc_sync import now_ms

                    lease.withdraw_bid(now_ms())
            elif lease is not None and not self.bid(move):
                return
            else:
                log.warning("pipeline: stage %d has no host heard within %.0f s; this node "
                            "(stage %s, which keeps %d more) takes it over", move, FRESH_S,
                            st.stage, len(self.map.rows()[st.stage or 0]) - 1)
                st.move_to = move
                st.stop.set()

    def bid(self, move: int) -> bool:
        """A takeover of `move` through its lease (claims.verdict): True once our bid
        has held BID_S with no claim ranked before it; refused while another's lease on
        the stage is live; a lost bid is withdrawn."""
        from node.run.rundoc_sync import now_ms

        lease = self.map.lease
        assert lease is not None
        t = now_ms()
        verdict, peer = claims.verdict(self.ctx.peer_id, move, lease.claims(t), t)
        if verdict == "refused":
            self.state.counters["refused: takeover (lease)"] += 1
            log.info("pipeline: stage %d has no live host in this view, but %s's claim on it "
                     "is live: not taking it over", move, peer)
        elif verdict == "bid":
            lease.place_bid(move, t)
            log.info("pipeline: bidding for stage %d, which no live claim holds", move)
        elif verdict == "lost":
            lease.withdraw_bid(t)
            self.state.counters["refused: takeover (bid lost)"] += 1
            log.info("pipeline: %s's claim on stage %d ranks before our bid: withdrawn",
                     peer, move)
        return verdict == "won"

    async def wait_to_start(self) -> None:
        """Until every stage has a host, the replicas are balanced and the map has held
        SETTLE_S; then this node trains."""
        st = self.state
        st.phase = "waiting for stages"
        st.progress.phase = "waiting for stages"
        stable_since, last = time.monotonic(), None
        while True:
            smap = self.map.rows()
            if smap != last:
                stable_since, last = time.monotonic(), smap
            if (placement.complete(smap) and placement.balanced(smap)
                    and time.monotonic() - stable_since >= SETTLE_S):
                break
            await trio.sleep(0.2)
        st.training = True
        assert self.ctx.run is not None
        self.ctx.run.stage_training = True
        st.phase = "training"
        log.info("pipeline: training stage %d; map %s", st.stage,
                 {s: [p[-6:] for p in row] for s, row in enumerate(smap)})
