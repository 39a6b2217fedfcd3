"""Which weights a stage that starts mid-run takes: the rule (docs/pipeline.md, "What a
stage's weights claim"), as a pure function of what each source claims.

A source's claim is `trained`, the steps its weights were trained (a live replica's from
its heartbeats and then its answer, this node's own stage checkpoint's from the file), never
the pipeline's clock: the clock follows the swarm, so a stage restarted from the seed after
a failed recovery runs at the swarm's step with seed weights. Ranking by the clock copied
such a replica, or resumed from such a checkpoint, as if it were trained (issue 26 item 2,
the pipeline's case).

The order, for a clock at `swarm` and `fresh` = swarm - STALE_CHECKPOINTS x every_steps:

1. current sources, trained at least `fresh` steps, most trained first, a live replica
   before this node's checkpoint at the same count (it is where the stage is now);
2. CheckFree from the neighbours (where the recovery rule allows it);
3. stale sources, most trained first: weights that trained a little beat the seed's;
4. the seed (0 trained steps).

A claim above `swarm` is capped at it (a hostile or runaway peer gains no rank by it); a
replica that does not say (an older node) counts as 0: it cannot be told from the seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Kind = Literal["replica", "checkpoint", "checkfree", "seed"]


@dataclass(frozen=True, slots=True)
class Source:
    kind: Kind
    trained: int = 0  # the claim, capped at the swarm's step; 0 for checkfree and seed
    peer: str | None = None  # the replica's


def rank(replicas: Mapping[str, int | None], checkpoint: int | None, swarm: int,
         fresh: int, checkfree: bool = True) -> list[Source]:
    """The sources to try in order (see the module docstring): `replicas` maps each live
    replica to its claimed trained steps (None: unknown), `checkpoint` is this node's own
    checkpoint's claim (None: none usable), `checkfree` whether the rule may rebuild it.
    Always ends with the seed."""
    found = [Source("replica", min(max(t or 0, 0), swarm), p) for p, t in replicas.items()]
    if checkpoint is not None:
        found.append(Source("checkpoint", min(max(checkpoint, 0), swarm)))
    found.sort(key=lambda s: (-s.trained, s.kind != "replica", s.peer or ""))
    current = [s for s in found if s.trained >= max(fresh, 1)]
    stale = [s for s in found if s.trained < max(fresh, 1)]
    return [*current, *([Source("checkfree")] if checkfree else []), *stale, Source("seed")]
