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
2. another peer's checkpoint of the stage, if current (a host that hosted the stage
   before and moved, or restarted on another stage: every live peer is asked, a refusal
   from each that has none);
3. CheckFree from the nearest surviving stages (where the recovery rule allows it; past
   adjacent losses: node/ml/recovery/checkfree.plan's `lost_too`, `lost_stages` here);
4. stale sources, most trained first: weights that trained a little beat the seed's;
5. the seed (0 trained steps).

A claim above `swarm` is capped at it (a hostile or runaway peer gains no rank by it); a
replica that does not say (an older node) counts as 0: it cannot be told from the seed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["replica", "checkpoint", "peers", "checkfree", "seed"]


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
    current = [s for s in found if is_current(s.trained, fresh)]
    stale = [s for s in found if not is_current(s.trained, fresh)]
    rebuild = [Source("peers"), *([Source("checkfree")] if checkfree else [])]
    return [*current, *rebuild, *stale, Source("seed")]


def is_current(trained: int | None, fresh: int) -> bool:
    """Whether weights that claim `trained` steps count as trained (see `rank`)."""
    return trained is not None and trained >= max(fresh, 1)


def lost_stages(smap: Sequence[Sequence[str]], trained: Mapping[str, int | None],
                fresh: int, me: str) -> set[int]:
    """The stages no other live host holds current weights of: none left, or only hosts
    that started from the seed or are still recovering (their heartbeats claim too few
    trained steps). CheckFree takes no source from them: a rebuild that averaged a stage
    restarted from the seed got its untrained weights (issue 27: weights 0.615 / 0.0)."""
    return {j for j, row in enumerate(smap)
            if not any(is_current(trained.get(q), fresh) for q in row if q != me)}


def unheard(claimed: Mapping[str, int], trained: Mapping[str, int | None], me: str
            ) -> list[str]:
    """Hosts whose stage claims were renewed lately (`claimed`: peer -> stage) whose trained
    steps this node has not heard: a joiner's first heartbeats arrive over seconds, and a
    stage whose host it had not heard yet counted as lost, so an adjacent loss was rebuilt
    by an edge rule (a copy of stage 0) instead of from the stages around it (CI,
    2026-12-08). The recovery waits a bounded time for these."""
    return sorted(q for q in claimed if q != me and trained.get(q) is None)


def rebuild_from(lost: set[int], layers: Sequence[int], mode: str,
                 held: Mapping[int, int], fresh: int) -> dict[int, str]:
    """For each stage in `lost`, the source it is rebuilt from first (the rule of
    docs/pipeline.md, "Adjacent losses"): "checkpoint" where a peer holds a current one
    (`held`: stage -> the most trained steps a peer's checkpoint claims), else CheckFree's
    "copy of j" / "average of p, q" (the nearest surviving stages), else "seed"."""
    from node.ml.recovery.checkfree import RecoveryError, plan

    out: dict[int, str] = {}
    for s in sorted(lost):
        if is_current(held.get(s), fresh):
            out[s] = "checkpoint"
            continue
        try:
            how = plan(s, layers, "checkfree+" if mode == "checkfree+" else "checkfree",
                       lost - {s}) if mode != "none" else None
        except RecoveryError:
            how = None
        if how is None or how.rule == "none":
            out[s] = "seed" if how is None else "ends"
        elif how.rule == "copy":
            out[s] = f"copy of {how.sources[0]}"
        else:
            out[s] = f"average of {how.sources[0]}, {how.sources[1]}"
    return out
