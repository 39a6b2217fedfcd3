"""Who runs what, in which order: micro-batches, random routing, CheckFree+'s swap.

Random routing (NoLoCo, specs/algorithms.md §1c; gensyn-ai/noloco `dipaco_pipeline.py`):
with R replicas of every stage, micro-batch k leaving stage s from replica r goes to
replica `route(...)[r]` of stage s+1. The permutation is a pure function of (run seed,
step, micro-batch, stage), so the sender, the receiver (which inverts it to know whom to
expect) and the backward pass (which retraces the path: `route_back`) agree with no
message. The reference seeds with (sample index + k) * PP + s; we seed numpy's
SeedSequence with the tuple itself, which cannot collide across (step, k, s). Replicas are
numbered 0..R-1 in an order every peer computes the same way (the live service sorts the
stage's live peer ids); evaluation uses fixed routing (the identity).

CheckFree+'s out-of-order execution (§4c, `convergence_training_2.py`): on odd
micro-batches the first two stages holding transformer blocks run in swapped order, and so
do the last two, so that each learns to stand in for its partner. The embedding still runs
first and the head last. `execution_order` gives the order of the stages' blocks;
`swap_partner` the stage a lost edge stage is copied from. The reference hard-codes the
indices for 6 stages (1<->2, 5<->6) and mis-maps other depths (§4g); here they come from
the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the live service routes in the trio thread, before torch is loaded
    import torch


def route(seed: int, step: int, micro_batch: int, stage: int, replicas: int) -> list[int]:
    """perm[r] = the replica of stage+1 that replica r of `stage` sends micro-batch to."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    for name, v in (("seed", seed), ("step", step), ("micro_batch", micro_batch),
                    ("stage", stage)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, step, micro_batch, stage]))
    return [int(x) for x in rng.permutation(replicas)]


def route_back(seed: int, step: int, micro_batch: int, stage: int, replicas: int) -> list[int]:
    """The inverse: inv[q] = the replica of `stage` that sent to replica q of stage+1; the
    receiver's expectation forward, and where its gradients go backward."""
    perm = route(seed, step, micro_batch, stage, replicas)
    inv = [0] * replicas
    for r, q in enumerate(perm):
        inv[q] = r
    return inv


def path(seed: int, step: int, micro_batch: int, stages: int, replicas: int, start: int,
         routing: str = "random") -> list[int]:
    """The replica of each stage a micro-batch that starts at replica `start` visits."""
    at = [start]
    for s in range(stages - 1):
        nxt = route(seed, step, micro_batch, s, replicas)[at[-1]] if routing == "random" \
            else at[-1]
        at.append(nxt)
    return at


def block_stages(layers: Sequence[int]) -> list[int]:
    """The stages that hold transformer blocks, in order."""
    return [i for i, n in enumerate(layers) if n > 0]


def swap_pairs(layers: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """CheckFree+'s two pairs: the first two and the last two stages holding blocks."""
    b = block_stages(layers)
    if len(b) < 4:
        raise ValueError(f"CheckFree+ needs at least 4 stages with blocks, layout {list(layers)}")
    return (b[0], b[1]), (b[-2], b[-1])


def swap_partner(stage: int, layers: Sequence[int]) -> int | None:
    """The stage CheckFree+ copies a lost `stage` from, or None if it is not an edge."""
    for a, b in swap_pairs(layers):
        if stage == a:
            return b
        if stage == b:
            return a
    return None


def execution_order(layers: Sequence[int], micro_batch: int, swap: bool) -> list[int]:
    """The stages whose blocks run, in order, for `micro_batch` (swapped on odd ones)."""
    order = list(range(len(layers)))
    if swap and micro_batch % 2 == 1:
        for a, b in swap_pairs(layers):
            order[a], order[b] = order[b], order[a]
    return order


@dataclass(frozen=True, slots=True)
class Hop:
    """One visit of a micro-batch to a stage: what that stage runs on it, in this order
    (its embedding, its blocks, its head)."""

    stage: int
    embed: bool = False
    blocks: bool = False
    head: bool = False


def hops(layers: Sequence[int], micro_batch: int, swap: bool) -> list[Hop]:
    """The stages a micro-batch visits, in order, with what each runs: the embedding,
    the blocks in `execution_order`, the head; consecutive parts on one stage are one
    visit. Without the swap (or on even micro-batches) that is one hop per stage, the
    stage order; with it, a first or last stage that holds blocks is visited twice: on
    layers (1, 1, 1, 1), stage 0 embeds, stage 1's blocks run, stage 0's, stage 3's,
    stage 2's, and stage 3's head. Hop h's activations go to hop h + 1, its gradients
    come back from there; replicas are routed per hop (`route(..., h, ...)`)."""
    last = len(layers) - 1
    parts = [(0, "embed")] + [(s, "blocks") for s in execution_order(layers, micro_batch, swap)
                              if layers[s] > 0 or s not in (0, last)] + [(last, "head")]
    out: list[Hop] = []
    for stage, part in parts:
        if not out or out[-1].stage != stage:
            out.append(Hop(stage))
        h = out[-1]
        out[-1] = Hop(stage, h.embed or part == "embed", h.blocks or part == "blocks",
                      h.head or part == "head")
    return out


def micro_batches(x: torch.Tensor, y: torch.Tensor, n: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a batch into `n` equal micro-batches (the manifest checks n divides it)."""
    if n < 1 or x.shape[0] % n:
        raise ValueError(f"a batch of {x.shape[0]} does not split into {n} micro-batches")
    return list(zip(x.chunk(n), y.chunk(n), strict=True))
