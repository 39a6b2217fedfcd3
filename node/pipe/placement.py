"""Which stage a node hosts, and who hosts each stage: pure functions of the live view.

Every node computes the same answers from the same view, so placement needs no
coordinator. A joiner takes the stage with the fewest live hosts (ties: the lowest stage).
Nodes that joined at the same moment all see the same empty map and pick the same stage;
`rebalance` then moves them apart one at a time: while the fullest stage has two hosts
more than the emptiest, the fullest stage's host with the highest peer id moves to the
lowest of the emptiest stages. Before training starts any move is free (every stage
starts from the run's seed); once a node trains, it moves only to a stage left with no
host at all (CheckFree rebuilds it there), never to even out replicas.

Routing between replicas (node/ml/pipeline/schedule.py): replicas of a stage are numbered by
sorted peer id; with as many replicas at the next hop's stage, micro-batch k leaving hop h
goes to `route(seed, step, k, h, R)[r]`; with a different count (churn), replica
(k x R_here + r) % R_next, so that every replica of the next stage gets micro-batches.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from node.ml.pipeline.schedule import route  # torch-free: routing runs in the trio thread

__all__ = ["arrivals", "balanced", "choose", "complete", "last_replica", "next_replica",
           "rebalance", "route", "stage_map"]


def stage_map(hosts: Mapping[str, int], stages: int) -> list[list[str]]:
    """stage -> its live hosts, sorted by peer id (replica r is entry r)."""
    out: list[list[str]] = [[] for _ in range(stages)]
    for peer, s in hosts.items():
        if isinstance(s, int) and 0 <= s < stages:
            out[s].append(peer)
    for row in out:
        row.sort()
    return out


def choose(hosts: Mapping[str, int], stages: int) -> int:
    """The stage with the fewest live hosts; ties go to the lowest stage."""
    counts = [len(row) for row in stage_map(hosts, stages)]
    return counts.index(min(counts))


YOUNGER_S = 30.0  # an uptime this much lower marks the younger of two trained hosts


def rebalance(me: str, hosts: Mapping[str, int], stages: int, *, training: bool,
              settled: Collection[str] = (), uptime: Mapping[str, float] | None = None
              ) -> int | None:
    """The stage `me` should move to now, or None to stay (see the module docstring).

    `settled`: hosts whose stage already trains. A node that has not started yet moves
    before one that has (a replacement that took a full stage on a stale view, not the
    trained host beside it): the donor is the fullest stage holding an unsettled host, if
    any, and the mover its unsettled host with the highest id. Among trained hosts only,
    the youngest (`uptime`, from heartbeats) moves when it is YOUNGER_S younger than every
    other: the replacement that took a full stage on a stale view and had started already,
    not the host that trained that stage for an hour."""
    smap = stage_map(hosts, stages)
    counts = [len(row) for row in smap]
    low, high = min(counts), max(counts)
    if high - low < 2 or (training and low > 0):
        return None
    fullest = [s for s, c in enumerate(counts) if c == high]
    fresh = [s for s in fullest if any(p not in settled for p in smap[s])]
    donor = (fresh or fullest)[0]
    candidates = [p for p in smap[donor] if p not in settled]
    mover = candidates[-1] if candidates else smap[donor][-1]
    if not candidates and uptime:
        ages = sorted((uptime.get(p, 0.0), p) for p in smap[donor])
        if len(ages) > 1 and ages[1][0] - ages[0][0] >= YOUNGER_S:
            mover = ages[0][1]
    if mover != me:
        return None
    return counts.index(low)


def complete(smap: Sequence[Sequence[str]]) -> bool:
    """Every stage has a host: a micro-batch can go the whole way."""
    return all(smap)


def balanced(smap: Sequence[Sequence[str]]) -> bool:
    counts = [len(row) for row in smap]
    return max(counts) - min(counts) <= 1


def next_replica(seed: int, step: int, micro_batch: int, hop: int, replica: int,
                 here: int, there: int, routing: str) -> int:
    """The replica of hop + 1's stage (`there` hosts) that replica `replica` of hop's stage
    (`here` hosts) sends `micro_batch` to (schedule.hops: without CheckFree+'s swap, hop
    h is stage h). With unequal counts, (micro_batch x here + replica) % there: each
    micro-batch index shifts the senders by `here`, so all `there` replicas get work. As
    `replica % there` it sent nothing to the other replicas of a stage that kept more
    hosts than the one before it (issue 27: a last-stage replica froze)."""
    if routing == "random" and here == there and there > 1:
        return route(seed, step, micro_batch, hop, there)[replica]
    if routing == "random" and here != there:
        return (micro_batch * here + replica) % there
    return replica % there


def last_replica(seed: int, step: int, micro_batch: int, replica: int,
                 counts: Sequence[int], routing: str) -> int:
    """The replica of the last hop's stage a micro-batch leaving first-stage `replica`
    reaches (where its targets go); `counts`: the hosts of each hop's stage, in order."""
    at = replica
    for h in range(len(counts) - 1):
        at = next_replica(seed, step, micro_batch, h, at, counts[h], counts[h + 1], routing)
    return at


def arrivals(seed: int, step: int, paths: Sequence[Sequence[int]], counts: Sequence[int],
             routing: str, stage: int, replica: int) -> int:
    """How many visits of `step`'s micro-batches reach replica `replica` of `stage` from
    another hop: every first-stage replica (an origin) cuts every micro-batch, and each
    takes the route its senders compute (`next_replica`, hop by hop). `paths`: each
    micro-batch's stages, visit by visit; `counts`: each stage's hosts. With as many hosts
    at every stage a replica gets one of each visit; a stage left with fewer hosts than
    the first gets the lost replica's share on top, and steps once that is back, not
    after its deadline."""
    n = 0
    for k, path in enumerate(paths):
        if not path or counts[path[0]] < 1:
            continue
        for origin in range(counts[path[0]]):
            at = origin
            for h in range(1, len(path)):
                here, there = counts[path[h - 1]], counts[path[h]]
                if there < 1:
                    break
                at = next_replica(seed, step, k, h - 1, at, here, there, routing)
                n += path[h] == stage and at == replica
    return n
