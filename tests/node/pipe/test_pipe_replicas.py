"""NoLoCo between the replicas of one stage (node/pipe/replicas.py), in one process: the
exchange is stood in by handing each replica the other's snapshot, which is what the
averaging protocol delivers (tests/node/averaging/test_codec_adapt.py and the averaging
tests run it)."""

from __future__ import annotations

import torch

from node.ml.optim import NoLoCoConfig
from node.ml.pipeline.stages import build_stages, own_parameters
from node.ml.trainer.models import GPTConfig
from node.pipe.replicas import ReplicaRounds
from node.training.rounds import Outcome

H = 5
CFG = GPTConfig(d_model=16, n_layers=3, n_heads=2, context=8)


def replicas(stage: int, n: int = 2, partners: bool = True):
    """`n` replicas of `stage`, drawn from one seed as every peer draws them, each with its
    rounds and a list of what it posted."""
    out = []
    for _ in range(n):
        built = build_stages(CFG, [1, 1, 1], seed=0)
        if stage == 2:
            built[2].set_tied(built[0].wte.weight)
        posted: list[tuple[int, torch.Tensor]] = []
        rounds = ReplicaRounds(built[stage], H, NoLoCoConfig(outer_lr=0.7, momentum=0.5),
                               post=lambda r, t, posted=posted: posted.append((r, t)),
                               has_partners=lambda: partners)
        out.append((built[stage], rounds, posted))
    return out


def drift(stage: torch.nn.Module, seed: int) -> None:
    """What H inner steps do to a replica: its own change."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in own_parameters(stage):
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def params(stage: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in own_parameters(stage)])


def test_two_replicas_that_averaged_hold_the_same_weights():
    (a, ra, pa), (b, rb, pb) = replicas(stage=1)
    assert torch.equal(params(a), params(b))  # one seed, one initialisation
    drift(a, 1)
    drift(b, 2)
    assert not torch.equal(params(a), params(b))
    for r in (ra, rb):
        r.after_step(H - 1)  # not a boundary: nothing posted
    assert pa == [] and pb == []
    ra.after_step(H)
    rb.after_step(H)
    (round_a, theta_a), (round_b, theta_b) = pa[0], pb[0]
    assert round_a == round_b == 1
    ra.deliver(Outcome(1, [theta_b], partner="b"))
    rb.deliver(Outcome(1, [theta_a], partner="a"))
    ra.after_step(H + 1)
    rb.after_step(H + 1)
    # Same φ₀, the same pair mean, the same momentum: the same φ, and no step in between
    assert torch.allclose(params(a), params(b), atol=1e-6)
    assert ra.statistics()["rounds_averaged"] == rb.statistics()["rounds_averaged"] == 1


def test_steps_taken_while_the_exchange_ran_are_kept():
    (a, ra, _), (b, rb, pb) = replicas(stage=1)
    drift(a, 1)
    drift(b, 2)
    ra.after_step(H)
    rb.after_step(H)
    before = params(a)
    drift(a, 3)  # a step after the boundary, before the outcome came
    moved = params(a) - before
    ra.deliver(Outcome(1, [pb[0][1]], partner="b"))
    ra.apply()
    expected_phi = ra.outer.phi
    assert torch.allclose(params(a), expected_phi + moved, atol=1e-6)


def test_the_last_stage_never_averages_its_borrowed_head_matrix():
    (c, rc, pc), _ = replicas(stage=2)
    own = sum(p.numel() for p in own_parameters(c))
    assert c.tied is not None and own == rc.vector().numel()
    head = c.tied.detach().clone()
    drift(c, 1)
    rc.after_step(H)
    rc.deliver(Outcome(1, [pc[0][1] * 0.5], partner="x"))
    rc.apply()
    assert torch.equal(c.tied, head)


def test_a_replica_alone_takes_no_outer_step_and_phi_follows_it():
    ((a, ra, pa),) = replicas(stage=1, n=1, partners=False)
    drift(a, 1)
    before = params(a)
    ra.after_step(H)
    assert pa == [] and torch.equal(params(a), before)
    assert torch.equal(ra.outer.phi, ra.vector())
    assert ra.statistics()["rounds_alone"] == 1


def test_a_round_whose_outcome_is_late_is_closed_locally_and_the_outcome_dropped():
    (a, ra, pa), _ = replicas(stage=1)
    drift(a, 1)
    ra.after_step(H)  # round 1 posted
    drift(a, 2)
    ra.after_step(2 * H)  # round 1 still open: closed locally, round 2 posted
    assert ra.statistics()["rounds_local"] == 1 and [r for r, _ in pa] == [1, 2]
    after = params(a)
    ra.deliver(Outcome(1, [pa[0][1] * 2], partner="late"))
    ra.apply()
    assert torch.equal(params(a), after)  # round 1 was closed already
    assert ra.statistics()["rounds_averaged"] == 0


def test_a_jump_past_a_round_boundary_starts_that_round_where_it_lands():
    """A first stage behind the swarm jumps to the swarm's step: from 2H-2 to 2H+1 it
    never lands on 2H, and round 2 was skipped (its partners' round 2 closed locally)."""
    (_, ra, pa), _ = replicas(stage=0)
    ra.after_step(2 * H - 2)
    ra.after_step(2 * H + 1)
    assert [r for r, _ in pa] == [2]
    ra.after_step(2 * H + 2)  # the same round: nothing new
    ra.after_step(3 * H)
    assert [r for r, _ in pa] == [2, 3]
