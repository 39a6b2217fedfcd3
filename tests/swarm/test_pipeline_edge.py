"""CheckFree+ on real node processes: an edge stage whose only host dies is rebuilt by a
replacement, its blocks copied from its swap partner and its ends (the embedding, the
final norm) from the copy its neighbour keeps (docs/pipeline.md, "Recovery live"); the
first stage, then the last; training goes on. Until then the swap runs live: odd
micro-batches visit the first two and the last two stages in swapped order."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from testnet import launcher
from tests.conftest import (
    answer,
    host_of,
    nodes,
    pipeline,
    pipeline_net,
    wait_for_ends_copy,
    wait_until,
)

pytestmark = pytest.mark.slow


def checkfree_plus(text: str) -> str:
    assert 'recovery = "checkfree"' in text
    return text.replace('recovery = "checkfree"', 'recovery = "checkfree+"')


net = pipeline_net(stages=4, manifest=checkfree_plus)


def rebuilt(net: launcher.Testnet, stage: int) -> dict | None:
    p = host_of(net, stage)
    rec = (pipeline(p).get("recovery") or {}) if p else {}
    return rec if rec.get("rule") == "copy+ends" else None


def test_the_edge_stages_are_rebuilt_from_their_partner_and_their_neighbours_copy(net):
    wait_until(lambda: sorted(pipeline(p).get("stage") for p in nodes(net)) == [0, 1, 2, 3]
               and all(pipeline(p).get("phase") == "training" for p in nodes(net)),
               180, "one node on each of the 4 stages, training")
    # stage 1 keeps a copy of stage 0's ends, stage 2 of stage 3's, once trained a little
    holder = host_of(net, 1)
    assert holder is not None
    wait_for_ends_copy(holder, 0)
    other = host_of(net, 2)
    assert other is not None
    wait_until(lambda: "3" in (pipeline(other).get("ends_copies") or {}), 60,
               "stage 2's copy of stage 3's ends")
    tail = host_of(net, 3)
    assert tail is not None
    before = pipeline(tail)["training"]
    # The swap runs live: odd micro-batches visit stage 0's blocks after stage 1's (stage 0
    # takes activations) and stage 3's blocks before stage 2's (stage 3 sends gradients
    # back to stage 0 for them).
    head = host_of(net, 0)
    assert head is not None and pipeline(head)["received"].get("received act", 0) > 0
    assert pipeline(tail)["sent"]["grad"] > 0
    killed, new = launcher.kill_stage(net, 0)
    assert killed and new is not None
    net = launcher.Testnet.load(Path(net.dir)) or net

    rec = wait_until(lambda: rebuilt(net, 0), 180, "stage 0 rebuilt by CheckFree+ (copy + ends)")
    # the blocks and the ends both came from stage 1's host (the swap partner, and the
    # neighbour that kept the copy)
    # (at_step is the swarm step in the replacement's first view, which may lag the tail's
    # by a heartbeat or two: mid-run is what matters)
    assert rec["sources"] == [answer(holder)["peer_id"]] and rec["at_step"] > 0, rec
    wait_until(lambda: pipeline(tail).get("training", {}).get("step", 0)
               >= rec["at_step"] + 20, 300, "20 steps through the rebuilt first stage")
    loss = pipeline(tail)["training"]["loss"]
    assert loss is not None and math.isfinite(loss) and loss < math.log(256) - 1.0, loss
    print("last stage's loss before the kill", before.get("loss"), "20 steps after", loss)
    # The last stage: its blocks from stage 2 (its swap partner), its final norm from
    # stage 2's copy; the head matrix comes from stage 0 each step, as always.
    killed, new = launcher.kill_stage(net, 3)
    assert killed and new is not None
    net = launcher.Testnet.load(Path(net.dir)) or net
    rec = wait_until(lambda: rebuilt(net, 3), 180, "stage 3 rebuilt by CheckFree+ (copy + ends)")
    assert rec["sources"] == [answer(other)["peer_id"]], rec
    tail = host_of(net, 3)
    assert tail is not None
    wait_until(lambda: pipeline(tail).get("training", {}).get("loss") is not None
               and pipeline(tail)["training"].get("step", 0) >= rec["at_step"] + 10, 300,
               "10 steps through the rebuilt last stage")
    loss = pipeline(tail)["training"]["loss"]
    assert math.isfinite(loss) and loss < math.log(256) - 1.0, loss
