"""CheckFree / CheckFree+ rules (node/ml/recovery/checkfree.py) on small stages."""

from __future__ import annotations

import math

import pytest
import torch

from node.ml.pipeline import split_gpt
from node.ml.recovery import (
    BadGradNorm,
    EdgeCopies,
    RecoveryError,
    check_grad_norm,
    checkfree_average,
    checkfree_weights,
    neighbour_average,
    plan,
    rebuild_blocks,
)
from node.ml.recovery.checkfree import edges_have_rule
from node.ml.trainer.models import GPT, GPTConfig

CFG = GPTConfig(d_model=16, n_layers=6, n_heads=2, context=8)
LAYERS = (0, 1, 1, 1, 1, 1, 1, 0)


def stages() -> list:
    torch.manual_seed(0)
    return split_gpt(GPT(CFG), LAYERS)


def test_checkfree_is_the_norm_weighted_average_with_eps() -> None:
    s = stages()
    prev, nxt = s[2].blocks_state(), s[4].blocks_state()
    out = checkfree_average(prev, nxt, 0.3, 0.9)
    w_prev, w_next = (0.3 + 1e-4) / (1.2 + 2e-4), (0.9 + 1e-4) / (1.2 + 2e-4)
    for k in prev:
        torch.testing.assert_close(out[k], w_prev * prev[k] + w_next * nxt[k])
    # the neighbour with the larger gradient norm weighs more
    assert checkfree_weights(0.3, 0.9)[1] > 0.5


def test_equal_norms_give_the_midpoint_and_zero_norms_do_not_divide_by_zero() -> None:
    s = stages()
    prev, nxt = s[2].blocks_state(), s[4].blocks_state()
    mid = neighbour_average(prev, nxt)
    for a, b in ((1.0, 1.0), (0.0, 0.0)):  # both clipped to 1.0; or both silent
        out = checkfree_average(prev, nxt, a, b)
        for k in prev:
            torch.testing.assert_close(out[k], mid[k])


def test_average_refuses_mismatched_or_non_finite_stages() -> None:
    s = stages()
    prev, nxt = s[2].blocks_state(), s[4].blocks_state()
    bad = dict(nxt)
    bad["0.ln_1.weight"] = torch.full_like(bad["0.ln_1.weight"], math.nan)
    with pytest.raises(RecoveryError, match="NaN"):
        checkfree_average(prev, bad, 1.0, 1.0)
    with pytest.raises(RecoveryError, match="different tensors"):
        checkfree_average(prev, {"x": torch.zeros(1)}, 1.0, 1.0)
    wrong = dict(nxt)
    wrong["0.ln_1.weight"] = torch.zeros(3)
    with pytest.raises(RecoveryError, match=r"0\.ln_1\.weight"):
        checkfree_average(prev, wrong, 1.0, 1.0)


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, -math.inf, 1.5, 1e300, "1", True,
                                   None])
def test_absurd_gossiped_norms_are_refused(value: object) -> None:
    with pytest.raises(BadGradNorm):
        check_grad_norm(value, grad_clip=1.0)


def test_honest_norms_pass_and_no_clip_has_a_ceiling() -> None:
    assert check_grad_norm(0.0, 1.0) == 0.0
    assert check_grad_norm(1.0, 1.0) == 1.0
    assert check_grad_norm(5, 0.0) == 5.0
    with pytest.raises(BadGradNorm, match="absurdly large"):
        check_grad_norm(1e7, 0.0)


def test_plans_for_checkfree_and_checkfree_plus() -> None:
    assert plan(3, LAYERS, "checkfree").rule == "average"
    assert plan(3, LAYERS, "checkfree").sources == (2, 4)
    for edge in (1, 6):
        assert plan(edge, LAYERS, "checkfree+").rule == "copy"
    # CheckFree+: the four swapped stages copy their partner, the rest average
    assert [plan(i, LAYERS, "checkfree+").sources for i in (1, 2, 5, 6)] == [(2,), (1,), (6,),
                                                                           (5,)]
    assert plan(3, LAYERS, "checkfree+").rule == "average"
    # the ends: restored from the neighbour's copy
    assert plan(0, LAYERS, "checkfree+").ends and plan(0, LAYERS, "checkfree+").rule == "none"
    with pytest.raises(RecoveryError, match="not a stage"):
        plan(8, LAYERS, "checkfree")
    # without 0-layer ends, the first stage holds the embedding and copies blocks from 1
    p = plan(0, (2, 2, 2, 2), "checkfree+")
    assert (p.rule, p.sources, p.ends) == ("copy", (1,), True)


def test_rebuild_applies_the_plan_and_validates_norms() -> None:
    s = stages()
    blocks = {i: st.blocks_state() for i, st in enumerate(s) if st.n_blocks}
    norms = {i: 0.2 * i for i in blocks}
    out = rebuild_blocks(plan(3, LAYERS, "checkfree"), blocks, norms, grad_clip=2.0)
    expected = checkfree_average(blocks[2], blocks[4], 0.4, 0.8)
    assert out is not None and all(torch.equal(out[k], expected[k]) for k in out)
    copied = rebuild_blocks(plan(6, LAYERS, "checkfree+"), blocks, norms, grad_clip=2.0)
    assert copied is not None and all(torch.equal(copied[k], blocks[5][k]) for k in copied)
    with pytest.raises(BadGradNorm, match="negative"):
        rebuild_blocks(plan(3, LAYERS, "checkfree"), blocks, {**norms, 4: -1.0}, 2.0)
    with pytest.raises(RecoveryError, match="no weights from stage 4"):
        rebuild_blocks(plan(3, LAYERS, "checkfree"), {2: blocks[2]}, norms, 2.0)
    assert rebuild_blocks(plan(0, LAYERS, "checkfree+"), blocks, norms, 2.0) is None


def test_edge_copies_restore_the_embedding_by_copy_never_average() -> None:
    s = stages()
    copies = EdgeCopies(every=10)
    copies.refresh(0, s[0].ends_state(), step=0)
    before = s[0].wte.weight.detach().clone()
    with torch.no_grad():
        s[0].wte.weight.add_(1.0)  # trained on...
    copies.refresh(0, s[0].ends_state(), step=5)  # ...not a refresh step: the copy stays
    assert copies.refreshed_at[0] == 0
    s[0].load_ends_state(copies.get(0))
    assert torch.equal(s[0].wte.weight, before)
    assert s[-1].tied is s[0].wte.weight  # the head still borrows the one matrix
    with pytest.raises(RecoveryError, match="no copy"):
        copies.get(7)


def test_the_edges_take_checkfree_plus_s_rule_under_the_default_checkfree() -> None:
    """Issue 27: stage 0 lost under recovery = "checkfree" (the manifest's default)
    restarted from the seed. Where the layout gives it CheckFree+'s rule it takes it now:
    a copy of its swap partner and the ends from its neighbour's copy; interior stages
    keep CheckFree's average."""
    for edge, partner in ((1, 2), (6, 5)):  # the first and last stages with blocks
        p = plan(edge, LAYERS, "checkfree")
        assert (p.rule, p.sources, p.ends) == ("copy", (partner,), False)
    for end in (0, 7):  # 0-block ends: the neighbour's copy
        p = plan(end, LAYERS, "checkfree")
        assert (p.rule, p.ends) == ("none", True)
    p = plan(0, (1, 1, 1, 1), "checkfree")  # the testnet's layout: the embedding too
    assert (p.rule, p.sources, p.ends) == ("copy", (1,), True)
    assert plan(2, LAYERS, "checkfree").rule == "average"  # CheckFree+ would copy 1
    assert plan(1, (1, 1, 1, 1), "checkfree").rule == "average"
    assert edges_have_rule((1, 1, 1, 1), "checkfree") and edges_have_rule(LAYERS, "checkfree")
    # no CheckFree+ rule: fewer than 4 stages with blocks, a partner lost too, "none"
    with pytest.raises(RecoveryError, match="edge"):
        plan(0, (1, 1, 1), "checkfree")
    assert not edges_have_rule((1, 1, 1), "checkfree")
    assert not edges_have_rule((1, 1, 1, 1), "none")
    with pytest.raises(RecoveryError, match="edge"):
        plan(0, (1, 1, 1, 1), "checkfree", {1})
