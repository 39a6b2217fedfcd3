"""Two or more adjacent stages lost at once (issue 27 item 3): each is rebuilt from a
peer's checkpoint of it, else from the nearest surviving stages, else from the seed
(node/ml/recovery/sources.py, node/ml/recovery/checkfree.plan; docs/pipeline.md, "Adjacent
losses")."""

from __future__ import annotations

import pytest
import torch
import trio

from node.ml.recovery import RecoveryError, plan, rebuild_blocks
from node.ml.recovery.checkfree import checkfree_weights
from node.ml.recovery.sources import lost_stages, rebuild_from
from node.pipe import stage_ckpt
from node.pipe.fetch import WeightsFetcher
from tests.node.pipe.test_pipe_convergence import service_hearing

SIX = (1, 1, 1, 1, 1, 1)
FRESH = 750


def test_a_single_loss_is_plain_checkfree():
    assert plan(2, SIX, "checkfree") == plan(2, SIX, "checkfree", ())
    assert plan(2, SIX, "checkfree").distances == (1, 1)
    assert checkfree_weights(0.3, 0.3, 0.0, (1, 1)) == (0.5, 0.5)


def test_adjacent_losses_average_the_nearest_surviving_stages_by_distance():
    """Stages 2 and 3 of 6 lost: each from stages 1 and 4, the nearer counting twice."""
    p2, p3 = plan(2, SIX, "checkfree", {3}), plan(3, SIX, "checkfree", {2})
    assert (p2.sources, p2.distances) == ((1, 4), (1, 2))
    assert (p3.sources, p3.distances) == ((1, 4), (2, 1))
    assert checkfree_weights(1.0, 1.0, 0.0, p2.distances) == pytest.approx((2 / 3, 1 / 3))
    a, b = {"w": torch.zeros(3)}, {"w": torch.full((3,), 3.0)}
    rebuilt = rebuild_blocks(p2, {1: a, 4: b}, {1: 0.5, 4: 0.5}, grad_clip=1.0, eps=0.0)
    assert torch.allclose(rebuilt["w"], torch.full((3,), 1.0))  # 2/3 x 0 + 1/3 x 3
    # three in a row: the middle one halfway
    assert plan(3, SIX, "checkfree", {2, 4}).distances == (2, 2)


def test_a_lost_run_reaching_an_edge_has_no_checkfree_source():
    with pytest.raises(RecoveryError, match="edge"):
        plan(1, SIX, "checkfree", {0})
    # CheckFree+: stage 0's partner (1) is lost too, so it cannot be copied
    with pytest.raises(RecoveryError, match="edge"):
        plan(0, SIX, "checkfree+", {1})
    # but stage 1 survives its neighbour 2's loss: copied from its partner 0
    assert plan(1, SIX, "checkfree+", {2}).sources == (0,)


def test_which_source_each_lost_stage_is_rebuilt_from():
    """The rule in one table: a peer's current checkpoint, else CheckFree from the nearest
    surviving stages, else the seed; a checkpoint of untrained weights does not count."""
    assert rebuild_from({2, 3}, SIX, "checkfree", {}, FRESH) == {
        2: "average of 1, 4", 3: "average of 1, 4"}
    assert rebuild_from({2, 3}, SIX, "checkfree", {3: 900, 2: 5}, FRESH) == {
        2: "average of 1, 4", 3: "checkpoint"}
    assert rebuild_from({0, 1}, SIX, "checkfree", {}, FRESH) == {0: "seed", 1: "seed"}
    assert rebuild_from({0, 1}, SIX, "checkfree+", {1: 800}, FRESH) == {
        0: "seed", 1: "checkpoint"}
    assert rebuild_from({4, 5}, SIX, "checkfree+", {}, FRESH) == {4: "seed", 5: "seed"}
    assert rebuild_from({2, 3}, SIX, "none", {}, FRESH) == {2: "seed", 3: "seed"}


def test_a_stage_whose_hosts_hold_untrained_weights_is_lost_for_checkfree():
    """Stage 1's only host restarted from the seed (it claims 3 trained steps): stage 2's
    replacement must not average its weights (issue 27: 0.615 / 0.0, a copy)."""
    smap = [["a"], ["b"], ["me"], ["d"]]
    trained = {"a": 990, "b": 3, "d": 980}
    assert lost_stages(smap, trained, FRESH, "me") == {1, 2}
    assert plan(2, (1, 1, 1, 1), "checkfree", {1}).sources == (0, 3)


async def test_a_peer_serves_its_checkpoint_of_a_stage_it_no_longer_hosts(tmp_path):
    """In-process, real hosts: a node that hosts stage 0 now but hosted stage 2 before
    answers a request for stage 2's weights from its checkpoint, with its claim."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p.host import Substrate

    service = service_hearing(me="z0", stage=0)
    st = service.state
    service.map.ctx.config.state_dir = tmp_path
    st.stage = 2  # it hosted stage 2 then
    donor = service.thread.build_worker(post=lambda *a: None)
    st.stage = 0
    path = stage_ckpt.path_for(tmp_path, st.run_id, 2)
    stage_ckpt.save(path, donor.runner, st.run_id, list(st.layers), 900, 880)
    shapes = {k: tuple(v.shape) for k, v in donor.runner.stage.state_dict().items()}

    asker, host = (Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
                   for _ in range(2))
    host.set_handler("/peertrain/pipe-weights/1.0.0", service.weights.serve)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for s in (asker, host):
                await nursery.start(s.serve)
            peer = await asker.connect(host.addrs()[0])
            got = await WeightsFetcher(asker, st.run_id).fetch(peer.to_base58(), 2,
                                                                    "all", shapes)
            nursery.cancel_scope.cancel()
    assert (got.step, got.trained) == (900, 880)
    want = donor.runner.stage.state_dict()
    assert all(torch.equal(got.tensors[k], want[k].float()) for k in want)



def test_a_recovery_waits_only_for_claimed_hosts_it_has_not_heard():
    """sources.unheard: hosts with a lately renewed claim whose trained steps this node has
    not heard (no heartbeat yet, or one without the claim); itself never."""
    from node.ml.recovery.sources import unheard

    claimed = {"a": 0, "b": 3, "me": 1}
    assert unheard(claimed, {"a": 120, "b": None}, "me") == ["b"]
    assert unheard(claimed, {"a": 120}, "me") == ["b"]
    assert unheard(claimed, {"a": 0, "b": 7}, "me") == []  # heard: untrained is an answer
