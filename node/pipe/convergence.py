"""Checks that keep the stage map and the step counter from being decided by one bad view.

Pure functions of what a node has heard (the pipeline service's stage map and stage
choice, stage_map.py and choice.py, feed them):

* `recent_hosts`: a stage is taken over (a trained node leaves its stage to rebuild one
  with no host) only when nobody heard lately hosts it. The live view drops a peer one
  heartbeat ttl (5 s) after its last heartbeat arrived, and under load (2 cores, load
  20-45) heartbeats arrived later than that: a stage-0 host took stage 1 over while stage
  1's other host was training, and restarted it from the seed (issue 27). A host heard
  within `FRESH_S` (15 s: the pipeline's bound on a heartbeat that is evidence of life)
  blocks the takeover; a dead one stops blocking it 15 s after its last heartbeat.
* `confirmed_step`: the swarm's step, from the claims of the peers that train, taking
  a claim only where another trained peer is within `CONFIRM_LAG` steps of it (or none
  is there to check it against). One first stage whose step counter ran away (251 ->
  7055 in 3 min, every micro-batch lost at once) was the highest step the others saw,
  and they jumped to it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

FRESH_S = 15.0  # a heartbeat heard longer ago than this is no evidence of life
CONFIRM_LAG = 50  # a step claim another trained peer is this close to is confirmed


def recent_hosts(entries: Iterable[Any], stage: int) -> list[str]:
    """The peers among `entries` (membership entries heard lately) whose last heartbeat
    said they host `stage`."""
    out = []
    for e in entries:
        stats = e.info.get("stats") or {}
        if e.info.get("role") == "node" and stats.get("stage") == stage:
            out.append(e.peer_id)
    return sorted(out)


def confirmed_step(claims: Mapping[str, int], trained: Collection[str],
                   lag: int = CONFIRM_LAG) -> int:
    """The highest step in `claims` (peer -> the step its heartbeat reports) that another
    peer of `trained` (hosts whose stage trains) confirms, being within `lag` steps of it
    or past it; a claim with no other trained peer to check it against stands (a stage's
    only survivor is the swarm's step). 0 when there is none."""
    best = 0
    for peer, step in claims.items():
        if step <= best:
            continue
        others = [s for p, s in claims.items() if p != peer and p in trained]
        if not others or max(others) >= step - lag:
            best = step
    return best
