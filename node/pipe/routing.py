"""Where the worker's messages go and which messages this node takes (docs/pipeline.md).

Replicas are numbered by sorted peer id (placement.next_replica). Activations go to the
replica of the next visit's stage the seeded route names (a visit per stage in stage
order; CheckFree+'s swap visits the edge stages twice: schedule.hops), targets straight to
the last stage replica the micro-batch will reach, gradients back to whoever sent the
activations, the head gradient from the last stage to every first-stage host, the tied
matrix from first-stage replica r to the last-stage replicas q with q % R0 == r. Inbound,
each stream on `/peertrain/pipe/1.0.0` is checked against the stage map (StageMap.claim)
and what this stage expects (`expect`), then queued in the bounded inbox (links.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from node.pipe import placement
from node.pipe.links import Outbox, Outgoing, serve_stream
from node.pipe.stage_map import StageMap
from node.pipe.state import PipeState
from protocols import pipeline as pipe

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from node.service import NodeContext


class Routing:
    def __init__(self, ctx: NodeContext, state: PipeState, stage_map: StageMap,
                 outbox: Outbox | None = None, lane_host: str | None = None) -> None:
        self.ctx = ctx
        self.state = state
        self.map = stage_map
        self.outbox = outbox
        self.lane_host = lane_host  # where our bulk lanes listen, once running

    def dispatch(self, to: tuple, msg: Outgoing) -> None:
        """Trio thread: pick the peer(s) for one of the worker's messages and queue it."""
        st, outbox = self.state, self.outbox
        assert outbox is not None and st.stage is not None
        smap = self.map.rows()
        counts = [len(row) for row in smap]
        me = self.ctx.peer_id
        r = smap[st.stage].index(me) if me in smap[st.stage] else 0
        p, seed = st.pipeline, st.m.run.seed
        peers: list[str] = []
        try:
            if to[0] == "peer":
                peers = [to[1]]
            elif to[0] == "next":  # ("next", step, mb, our visit)
                path, h = st.paths[to[2]], to[3]
                q = placement.next_replica(seed, to[1], to[2], h, r,
                                           counts[path[h].stage], counts[path[h + 1].stage],
                                           p.routing)
                peers = [smap[path[h + 1].stage][q]]
            elif to[0] == "last":
                path = st.paths[to[2]]
                q = placement.last_replica(seed, to[1], to[2], r,
                                           [counts[v.stage] for v in path], p.routing)
                peers = [smap[path[-1].stage][q]]
            elif to[0] == "stage":
                row = smap[to[1]]
                if msg.kind == "tied":  # first-stage replica r feeds last replicas r mod R0
                    peers = [q for i, q in enumerate(row) if i % max(1, counts[0]) == r]
                else:
                    peers = list(row)
        except (IndexError, ZeroDivisionError):
            peers = []
        if not peers:
            st.lost(msg, f"no live host for {msg.kind} to stage {msg.stage}")
            return
        for peer in peers:
            outbox.send(peer, msg)

    def last_hosts(self, step: int) -> int:
        """How many last-stage hosts get micro-batches of `step` from some first-stage
        replica (trainer thread): the hosts a driver hears a head gradient from."""
        st = self.state
        counts = [len(row) for row in self.map.rows()]
        if 0 in counts:  # a stage without a host: no step completes anyway
            return 1
        return len({placement.last_replica(st.m.run.seed, step, k, r,
                                           [counts[v.stage] for v in path],
                                           st.pipeline.routing)
                    for k, path in enumerate(st.paths) for r in range(counts[0])})

    def arrivals(self, step: int) -> int:
        """How many visits of `step` reach this host (trainer thread; placement.arrivals)."""
        st, me = self.state, self.ctx.peer_id
        smap = self.map.rows()
        assert st.stage is not None
        row = smap[st.stage]
        return placement.arrivals(st.m.run.seed, step, [[v.stage for v in path] for path
                                                        in st.paths], [len(r) for r in smap],
                                  st.pipeline.routing, st.stage,
                                  row.index(me) if me in row else 0)

    def _lane_host(self) -> str | None:
        """Where we listen for a sender's bulk lane; None (no lanes) where a sender could
        not connect to it (behind a NAT: Transports.lane_dialable)."""
        if not self.ctx.transports.lane_dialable():
            return None
        return self.lane_host

    async def handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            # Messages may come before our worker runs (a neighbour saw the map complete a
            # moment before we did): the bounded inbox holds them until it does.
            if self.state.stage is None:
                self.state.counters["refused: no stage yet"] += 1
                return
            await serve_stream(stream, peer, self.expect(), self.map.claim, self.state.inbox,
                               self.state.counters, lane_host=self._lane_host())
        finally:
            try:
                with trio.move_on_after(2):
                    await stream.close()
            except Exception:
                pass

    def expect(self) -> pipe.Expect:
        st = self.state
        s = st.stage
        assert s is not None
        kinds = set()  # acts for a visit past the first, grads for one before the last
        for path in st.paths:
            kinds |= {"act" for h in path[1:] if h.stage == s}
            kinds |= {"grad" for h in path[:-1] if h.stage == s}
        if s == 0:
            kinds.add("tgrad")
        if s == st.n - 1:
            kinds |= {"tgt", "tied"}
        m = st.m
        return pipe.Expect(st.run_id, s, m.model.d_model, m.train.batch_size // st.M,
                           m.model.context, st.M, frozenset(kinds))
