"""Pipeline stages (node/ml/pipeline): the cut, the tied head, boundaries, routing, order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from node.ml.pipeline import (
    Pipeline,
    PipelineFull,
    StageOptim,
    StageRunner,
    execution_order,
    hops,
    micro_batches,
    path,
    route,
    route_back,
    split_gpt,
    swap_pairs,
    swap_partner,
)
from node.ml.trainer.models import GPT, GPTConfig

CFG = GPTConfig(d_model=16, n_layers=4, n_heads=2, context=8)


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def batch(b: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (b, CFG.context), generator=g),
            torch.randint(0, 256, (b, CFG.context), generator=g))


@pytest.mark.parametrize("layers", [(1, 1, 1, 1), (2, 2), (0, 2, 2, 0), (0, 4, 0), (4,)])
def test_stages_compute_what_the_model_computes(layers: tuple[int, ...]) -> None:
    model = gpt()
    stages = split_gpt(model, layers)
    x, _y = batch()
    out = Pipeline(stages, StageOptim()).forward(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)
    # every weight once, the tied matrix included once (the first stage's)
    n = sum(p.numel() for s in stages for p in s.parameters())
    assert n == sum(p.numel() for p in model.parameters())
    assert all("tied" not in k for k in stages[-1].state_dict())


def test_tied_head_gradient_lands_on_the_embedding_owner() -> None:
    model = gpt()
    stages = split_gpt(model, (1, 2, 1))
    x, y = batch()
    F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
    F.cross_entropy(Pipeline(stages, StageOptim()).forward(x).reshape(-1, 256),
                    y.reshape(-1)).backward()
    torch.testing.assert_close(stages[0].wte.weight.grad, model.wte.weight.grad)
    torch.testing.assert_close(stages[1].blocks[1].mlp.fc.weight.grad,
                               model.blocks[2].mlp.fc.weight.grad)


def test_runners_across_boundaries_match_one_backward_pass() -> None:
    """Activations forward and gradients back through StageRunners (as over the wire,
    the tied head's gradient returned to the owner) equal autograd through the model."""
    model = gpt()
    ref = split_gpt(model, (1, 2, 1))
    x, y = batch()
    F.cross_entropy(Pipeline(ref, StageOptim()).forward(x).reshape(-1, 256),
                    y.reshape(-1)).backward()

    stages = split_gpt(model, (1, 2, 1))
    stages[-1].set_tied(stages[0].wte.weight)  # a copy, as on another peer
    runners = [StageRunner(s, StageOptim()) for s in stages]
    mbs = micro_batches(x, y, 2)
    for k, (xk, yk) in enumerate(mbs):
        a = runners[0].forward(k, xk)
        a = runners[1].forward(k, a)
        runners[2].forward_loss(k, a, yk)
    for k in range(len(mbs)):
        g = runners[2].backward_loss(k, scale=1 / len(mbs))
        g = runners[1].backward(k, g)
        assert runners[0].backward(k, g) is None
    stages[0].add_tied_grad(stages[-1].tied_grad())
    for a, b in zip(ref, stages, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_flood_of_micro_batches_is_refused_not_queued() -> None:
    stages = split_gpt(gpt(), (2, 2))
    runner = StageRunner(stages[0], StageOptim(), max_in_flight=2)
    x, _ = batch(1)
    runner.forward(0, x)
    runner.forward(1, x)
    with pytest.raises(PipelineFull, match="max 2"):
        runner.forward(2, x)
    assert runner.drop(0) and not runner.drop(0)
    runner.forward(2, x)
    with pytest.raises(KeyError):
        runner.backward(7, torch.zeros(1, CFG.context, CFG.d_model))


def test_step_records_the_norm_after_clipping() -> None:
    stages = split_gpt(gpt(), (2, 2))
    pipe = Pipeline(stages, StageOptim(lr=1e-3, grad_clip=1e-3))
    x, y = batch()
    pipe.train_step(micro_batches(x, y, 2))
    assert pipe.grad_norms() == pytest.approx([1e-3, 1e-3])
    pipe = Pipeline(split_gpt(gpt(), (2, 2)), StageOptim(lr=1e-3, grad_clip=1e6))
    pipe.train_step(micro_batches(x, y, 2))
    assert all(0 < n < 1e6 for n in pipe.grad_norms())


def test_grouped_micro_batches_equal_one_by_one_accumulation() -> None:
    layers = (0, 1, 1, 1, 1, 0)
    x, y = batch(8)
    a = Pipeline(split_gpt(gpt(), layers), StageOptim(), swap=True)
    loss = a.train_step(micro_batches(x, y, 4))
    b = Pipeline(split_gpt(gpt(), layers), StageOptim(), swap=True)
    total = 0.0
    for k, (xk, yk) in enumerate(micro_batches(x, y, 4)):
        lk = F.cross_entropy(b.forward(xk, k).reshape(-1, 256), yk.reshape(-1))
        (lk / 4).backward()
        total += float(lk.detach()) / 4
    for r in b.runners:
        r.step()
    assert loss == pytest.approx(total, rel=1e-5)
    for sa, sb in zip(a.stages, b.stages, strict=True):
        for p, q in zip(sa.parameters(), sb.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


# -- routing ------------------------------------------------------------------------------


def test_routing_is_a_seeded_permutation_both_ends_agree_on() -> None:
    perms = set()
    for k in range(20):
        perm = route(7, 3, k, 1, 5)
        assert sorted(perm) == list(range(5))
        assert perm == route(7, 3, k, 1, 5)  # the sender and the receiver compute it alike
        inv = route_back(7, 3, k, 1, 5)
        assert [inv[perm[r]] for r in range(5)] == list(range(5))
        perms.add(tuple(perm))
    assert len(perms) > 5  # it does vary with the micro-batch
    assert route(7, 3, 0, 1, 5) != route(8, 3, 0, 1, 5) or route(7, 3, 1, 1, 5) != route(
        8, 3, 1, 1, 5)


def test_a_path_visits_one_replica_per_stage_and_fixed_routing_stays() -> None:
    p = path(0, 10, 2, stages=4, replicas=3, start=1)
    assert len(p) == 4 and p[0] == 1 and all(0 <= r < 3 for r in p)
    assert path(0, 10, 2, 4, 3, 1, routing="fixed") == [1, 1, 1, 1]
    for s in range(3):  # backward retraces: the next stage's replica maps back to ours
        assert route_back(0, 10, 2, s, 3)[p[s + 1]] == p[s]


def test_bad_routing_arguments() -> None:
    with pytest.raises(ValueError, match="replicas"):
        route(0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="step"):
        route(0, -1, 0, 0, 2)


# -- CheckFree+'s order -------------------------------------------------------------------


def test_swap_pairs_follow_the_layout_not_six_stages() -> None:
    assert swap_pairs((0, 1, 1, 1, 1, 1, 1, 0)) == ((1, 2), (5, 6))
    assert swap_pairs((2, 2, 2, 2)) == ((0, 1), (2, 3))
    assert swap_pairs((0,) + (1,) * 12 + (0,)) == ((1, 2), (11, 12))
    assert swap_partner(12, (0,) + (1,) * 12 + (0,)) == 11
    assert swap_partner(5, (0,) + (1,) * 12 + (0,)) is None
    with pytest.raises(ValueError, match="at least 4"):
        swap_pairs((0, 1, 1, 1, 0))


def test_execution_order_swaps_on_odd_micro_batches_only() -> None:
    layers = (0, 1, 1, 1, 1, 1, 1, 0)
    assert execution_order(layers, 0, swap=True) == list(range(8))
    assert execution_order(layers, 1, swap=True) == [0, 2, 1, 3, 4, 6, 5, 7]
    assert execution_order(layers, 1, swap=False) == list(range(8))


def test_hops_visit_an_edge_stage_twice_only_where_it_holds_blocks() -> None:
    def names(layers, mb):
        return [(h.stage, "".join(c for c, on in zip("ebh", (h.embed, h.blocks, h.head),
                                                     strict=True) if on))
                for h in hops(layers, mb, swap=True)]
    assert names((1, 1, 1, 1), 0) == [(0, "eb"), (1, "b"), (2, "b"), (3, "bh")]
    assert names((1, 1, 1, 1), 1) == [(0, "e"), (1, "b"), (0, "b"), (3, "b"), (2, "b"),
                                      (3, "h")]
    assert names((0, 1, 1, 1, 1, 0), 1) == [(0, "e"), (2, "b"), (1, "b"), (4, "b"),
                                            (3, "b"), (5, "h")]
    assert hops((1, 1, 1, 1), 1, swap=False) == hops((1, 1, 1, 1), 0, swap=True)


def test_runners_along_the_swapped_visits_match_the_swapped_model() -> None:
    """An odd micro-batch through StageRunners visit by visit (stage 0 twice, stage 3
    twice, keyed by (micro-batch, visit) as the live worker does) gets autograd's
    gradients of the in-process pipeline in CheckFree+'s order."""
    model = gpt()
    layers = (1, 1, 1, 1)
    ref = split_gpt(model, layers)
    x, y = batch()
    logits = Pipeline(ref, StageOptim(), swap=True).forward(x, micro_batch=1)
    F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).backward()

    stages = split_gpt(model, layers)
    stages[-1].set_tied(stages[0].wte.weight)
    runners = [StageRunner(s, StageOptim()) for s in stages]
    path = hops(layers, 1, swap=True)
    a = x
    for h, hop in enumerate(path[:-1]):
        a = runners[hop.stage].forward((1, h), a, hop)
    last = len(path) - 1
    runners[path[-1].stage].forward_loss((1, last), a, y, path[-1])
    g = runners[path[-1].stage].backward_loss((1, last))
    for h in range(last - 1, -1, -1):
        g = runners[path[h].stage].backward((1, h), g)
    assert g is None  # the embedding's input is token ids
    stages[0].add_tied_grad(stages[-1].tied_grad())
    for a_, b_ in zip(ref, stages, strict=True):
        for (name, p_), q in zip(a_.named_parameters(), b_.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p_.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_micro_batches_must_divide_the_batch() -> None:
    x, y = batch(6)
    assert [m[0].shape[0] for m in micro_batches(x, y, 3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="does not split"):
        micro_batches(x, y, 4)
