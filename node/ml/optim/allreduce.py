"""DiLoCo's all-reduce as a sequence of pairwise swaps: who swaps with whom, and how.

DiLoCo needs every worker to hold the exact mean of the group's weights (equivalently of
its pseudo-gradients, since φ is shared) at every outer step. The swarm already has one
primitive, the pairwise full-duplex swap of `/peertrain/avg/1.0.0` (both sides end with
both vectors), so the all-reduce is built from it, by recursive doubling: with N = 2^k
workers, in step j each worker i swaps with i XOR 2^j and both keep the average, and after
k steps everyone holds the mean of all N. For any other N, with P the largest power of two
below it, the N - P extra workers first hand their vector to a partner among the first P
(which then stands for two), the first P run the doubling with each vector weighted by
how many workers it stands for, and each extra worker takes the result back from its
partner: 2 + log2(P) swaps one after the other. The mean is exact in every case
(tests/ml/test_allreduce.py simulates it for N = 1..17).

Who is worker i is agreed without a coordinator, as NoLoCo's groups are: the sorted ids of
the live members. A swarm whose views differ, or a partner that fails a step, fails the
all-reduce; the training service then takes a local step (DiLoCo's replicas drift apart
from there: the fragility NoLoCo removes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Step:
    """Swap with `partner` in step `k`; keep (mine * ours + theirs * partner's) / (mine +
    theirs): the two weights count the workers each vector stands for."""

    k: int
    partner: str
    mine: int
    theirs: int


def plan(me: str, peers: Sequence[str]) -> list[Step]:
    """`me`'s swaps, in order, for an all-reduce over `peers` (ids, `me` among them)."""
    ids = sorted(set(peers))
    if me not in ids:
        raise ValueError(f"{me!r} is not among the peers")
    n = len(ids)
    if n == 1:
        return []
    p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    extra = n - p
    i = ids.index(me)
    if i >= p:  # an extra worker: hand our vector over, take the mean back
        return [Step(0, ids[i - p], 1, 0), Step(p.bit_length(), ids[i - p], 0, 1)]

    def weight(j: int, at: int) -> int:
        """Workers the block of 2^j positions holding `at` stands for, before step j + 1."""
        start = at >> j << j
        return sum(2 if q < extra else 1 for q in range(start, start + (1 << j)))

    steps = [Step(0, ids[i + p], 1, 1)] if i < extra else []
    for j in range(p.bit_length() - 1):
        steps.append(Step(1 + j, ids[i ^ (1 << j)], weight(j, i), weight(j, i ^ (1 << j))))
    if i < extra:
        steps.append(Step(p.bit_length(), ids[i + p], 1, 0))
    return steps
