"""DiLoCo's all-reduce from pairwise swaps (node/ml/optim/allreduce.py), simulated: every
worker ends with the exact mean, for any group size, and partners agree on every step."""

from __future__ import annotations

import pytest
import torch

from node.ml.optim.allreduce import plan


def simulate(n: int) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Run every worker's plan, swap by swap; (final vectors, true mean, longest plan)."""
    ids = [f"peer{i:02d}" for i in range(n)]
    g = torch.Generator().manual_seed(n)
    vec = {p: torch.randn(5, generator=g, dtype=torch.float64) for p in ids}
    mean = torch.stack(list(vec.values())).mean(0)
    plans = {p: plan(p, ids) for p in ids}
    todo = {p: list(s) for p, s in plans.items()}
    while any(todo.values()):
        k = min(s[0].k for s in todo.values() if s)
        pairs = {p: s.pop(0) for p, s in todo.items() if s and s[0].k == k}
        new = {}
        for p, step in pairs.items():
            back = pairs[step.partner]  # the partner swaps with us in the same step
            assert back.partner == p
            if min(step.mine, step.theirs, back.mine, back.theirs) > 0:  # both average
                assert (back.mine, back.theirs) == (step.theirs, step.mine)
            w = step.mine + step.theirs
            new[p] = (step.mine * vec[p] + step.theirs * vec[step.partner]) / w
        vec.update(new)
    return list(vec.values()), mean, max(len(s) for s in plans.values())


@pytest.mark.parametrize("n", range(1, 18))
def test_every_worker_ends_with_the_exact_mean(n: int) -> None:
    final, mean, longest = simulate(n)
    for v in final:
        torch.testing.assert_close(v, mean, rtol=0, atol=1e-12)
    p = 1 << (n.bit_length() - 1)
    assert longest == (p.bit_length() - 1) + (2 if n > p else 0)  # log2 P, +2 to fold


def test_four_workers_take_two_swaps_and_the_plan_needs_no_coordinator() -> None:
    ids = ["d", "b", "a", "c"]
    assert [(s.partner, s.mine, s.theirs) for s in plan("a", ids)] == [("b", 1, 1),
                                                                       ("c", 2, 2)]
    assert plan("a", ids) == plan("a", sorted(ids))  # any order of the same view
    assert plan("a", ["a"]) == []
    with pytest.raises(ValueError, match="not among"):
        plan("z", ids)
