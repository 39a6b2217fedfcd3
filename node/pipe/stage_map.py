"""The stage map as this node sees it: who hosts which stage, who trains, which step.

Read from the live membership view (heartbeats, else each peer's run-document entry)
and the run document's leased claims (claims.py); every other piece of the pipeline
service asks this one, from the trio thread or the trainer thread.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from node.pipe import claims, convergence, placement
from node.pipe.convergence import FRESH_S
from node.pipe.state import PipeState
from protocols import pipeline as pipe

if TYPE_CHECKING:
    from node.service import NodeContext

HEARD_CAP_S = 60.0  # `heard`: no heartbeat older than this counts, however the others lag


def lease_for(ctx: NodeContext, state: PipeState) -> claims.StageLease | None:
    """This node's lease on its stage in the run document; None without a run document
    (unit tests of the heartbeat rules)."""
    if ctx.run is None or getattr(ctx.run, "document", None) is None:
        return None
    from node.run.rundoc_sync import topic

    def publish(delta: bytes) -> None:
        ctx.publisher.publish_nowait(topic(state.run_id), delta)

    return claims.StageLease(ctx.run.document, ctx.peer_id, state.n, publish)


class StageMap:
    def __init__(self, ctx: NodeContext, state: PipeState,
                 lease: claims.StageLease | None = None) -> None:
        self.ctx = ctx
        self.state = state
        self.lease = lease

    def live(self, first_choice: bool = False) -> list[Any]:
        """The membership view's live peers, less those whose last heartbeat was written
        more than FRESH_S ago (its `t`, judged by the swarm's clock: Membership.age):
        gossip re-delivered heartbeats minutes old (a relay's backlog, a seen-cache that
        expired) and they made a killed host look live and a swarm step 200 steps old look
        current.

        `first_choice` (a joiner choosing its stage): less, too, those written more than a
        peer ttl before the freshest one heard. A replacement that starts within seconds of
        its predecessor's death (as fast as a joiner does since trainers yield the CPU,
        node/process/priority.py) got the dead host's last heartbeat from gossip's history, stamped
        live on arrival, took another stage, and a trained host took the dead one's over
        (CI, 2026-11-26). Only for that choice: later the ttl on arrival expires such an
        entry, and a host whose heartbeats arrive late under load stays in the map."""
        ctx = self.ctx
        now = time.time()
        aged = [(e, ctx.membership.age(e, now)) for e in ctx.membership.live()]
        freshest = min((a for _, a in aged if a is not None), default=0.0)
        margin = ctx.config.peer_ttl_s if first_choice else math.inf
        return [e for e, age in aged
                if age is None or (age <= FRESH_S and age - freshest <= margin)]

    def swarm_step(self) -> int:
        """The highest step a fresh live peer reports that the trained others (ours
        included) confirm (convergence.confirmed_step): a first stage behind it jumps
        to it, a stage that starts late starts there."""
        claims = {e.peer_id: s for e in self.live()
                  if type(s := (e.info.get("stats") or {}).get("step")) is int}
        if self.state.training:
            claims[self.ctx.peer_id] = self.state.progress.step
        return convergence.confirmed_step(claims, self.settled())

    def hosts(self, first_choice: bool = False, heard_within_s: float | None = None
              ) -> dict[str, int]:
        """Live node -> the stage it hosts (its heartbeats, else its run-document entry);
        with `heard_within_s`, the nodes of `heard(heard_within_s)` instead."""
        ctx, n = self.ctx, self.state.n
        doc = ctx.run.document if ctx.run else None
        out: dict[str, int] = {}
        entries = self.live(first_choice) if heard_within_s is None else \
            self.heard(heard_within_s)
        for e in entries:
            if e.info.get("role") != "node" or e.peer_id == ctx.peer_id:
                continue
            s = (e.info.get("stats") or {}).get("stage")
            if type(s) is not int and doc is not None:
                s = doc.get(f"peer/{e.peer_id}/stage")
            if type(s) is int and 0 <= s < n:
                out[e.peer_id] = s
        if self.state.stage is not None:
            out[ctx.peer_id] = self.state.stage
        return out

    def agreed_hosts(self, first_choice: bool = False) -> dict[str, int]:
        """`hosts()` plus the live stage claims of peers the live view misses
        (claims.merged): what a joiner fills and untrained nodes rebalance by."""
        hosts = self.hosts(first_choice)
        if self.lease is None:
            return hosts
        from node.run.rundoc_sync import now_ms

        me = self.lease.me  # our own claim is `state.stage`, or a previous run's
        return claims.merged(hosts, [c for c in self.lease.claims(now_ms()) if c.peer != me])

    def renewing(self, within_s: float) -> dict[str, int]:
        """Other peers -> stage, by their claims renewed within `within_s` (claims.renewing)."""
        if self.lease is None:
            return {}
        from node.run.rundoc_sync import now_ms

        now, me = now_ms(), self.lease.me
        return {p: s for p, s in claims.renewing(self.lease.claims(now), now,
                                                  int(within_s * 1000)).items() if p != me}

    def settled(self) -> set[str]:
        """Live hosts whose stage trains already (their heartbeats say `staged`)."""
        out = {e.peer_id for e in self.live()
               if (e.info.get("stats") or {}).get("staged") == 1}
        if self.state.training:
            out.add(self.ctx.peer_id)
        return out

    def uptimes(self) -> dict[str, float]:
        """Live nodes' uptimes (heartbeats; ours from the clock): placement moves the
        youngest of a stage's trained hosts."""
        out = {}
        for e in self.live():
            u = (e.info.get("stats") or {}).get("uptime")
            if isinstance(u, int | float) and not isinstance(u, bool):
                out[e.peer_id] = float(u) + (time.monotonic() - e.last_seen)
        out[self.ctx.peer_id] = time.monotonic() - self.ctx.phases.started
        return out

    def rows(self, heard_within_s: float | None = None) -> list[list[str]]:
        """Stage -> its live hosts (or those heard, see `hosts`), sorted
        (placement.stage_map)."""
        return placement.stage_map(self.hosts(heard_within_s=heard_within_s), self.state.n)

    def complete(self) -> bool:
        """Every stage has a host (the worker's `ready`, trainer thread)."""
        return placement.complete(self.rows())

    def heard(self, within_s: float) -> list[Any]:
        """The heartbeats heard within `within_s` of the newest one heard from anyone, and
        written within `within_s` of the newest one written (by arrival and by `t`, each
        relative; never older than HEARD_CAP_S): what a recovery reads the claims of the
        map's hosts from. Under load a heartbeat arrives past the 5 s ttl, or this node's
        own loop lags (a joiner building its stage), a host drops out of the live view for
        a moment, and a recovery judged its stage lost (CI, 2026-12-08: stage 1 rebuilt by
        the edge copy). Relative, so a lagging node keeps the claims it heard last."""
        m, wall = self.ctx.membership, time.time()
        heard = m.book.live(time.monotonic() - max(0.0, HEARD_CAP_S - self.ctx.config.peer_ttl_s))
        newest = max((e.last_seen for e in heard), default=0.0)
        ages = {e.peer_id: m.age(e, wall) for e in heard}
        youngest = min((a for a in ages.values() if a is not None), default=0.0)
        return [e for e in heard if newest - e.last_seen <= within_s
                and ((a := ages[e.peer_id]) is None or a - youngest <= within_s)]

    def trained_of(self, hosts: list[str], heard_within_s: float | None = None
                   ) -> dict[str, int | None]:
        """`hosts` (less this node) -> the trained steps their heartbeats claim, in the
        live view, or in `heard(heard_within_s)`."""
        entries = self.live() if heard_within_s is None else self.heard(heard_within_s)
        said = {e.peer_id: (e.info.get("stats") or {}).get("trained") for e in entries}
        return {q: t if type(t := said.get(q)) is int else None
                for q in hosts if q != self.ctx.peer_id}

    def gossiped_norm(self, peer: str) -> float | None:
        """The last gradient norm `peer`'s heartbeats report (CheckFree's weighting)."""
        for e in self.live():
            if e.peer_id == peer:
                v = (e.info.get("stats") or {}).get("gnorm")
                return v if isinstance(v, int | float) and not isinstance(v, bool) else None
        return None

    def claim(self, peer: str, h: pipe.MessageHeader) -> str | None:
        """Why `peer` may not send this message here (None: it may): activations come
        from the stage of the micro-batch's previous visit, gradients from its next."""
        s, kind, n = self.state.stage, h.kind, self.state.n
        assert s is not None
        if h.stage != s:
            return f"{kind} for stage {h.stage} from {peer}: this node hosts stage {s} now"
        sender = {"tgt": 0, "tied": 0, "tgrad": n - 1}.get(kind, -1)
        if kind in ("act", "grad"):
            path = self.state.paths[h.mb]
            if h.hop >= len(path) or path[h.hop].stage != s:
                return f"{kind} for visit {h.hop} of micro-batch {h.mb}: not at stage {s}"
            other = h.hop - 1 if kind == "act" else h.hop + 1
            if not 0 <= other < len(path):
                return f"{kind} for visit {h.hop} of micro-batch {h.mb} has no sender"
            sender = path[other].stage
        if 0 <= sender < n and peer in self.rows()[sender]:
            return None
        return f"{kind} for stage {s} from {peer}, which does not host stage {sender}"

    def claims_statistics(self) -> dict[str, Any] | None:
        """The stage map the run document's live claims agree on, and our claim and bid."""
        if self.lease is None:
            return None
        from node.run.rundoc_sync import now_ms

        return self.lease.statistics(now_ms())
