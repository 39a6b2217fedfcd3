"""Replicas of a stage average by NoLoCo on real node processes: a 2-stage pipeline with 2
hosts per stage (`node testnet up --scenario pipeline --stages 2 --replicas 2`); each host
averages with the other host of its stage, never with a host of the other stage, and the
loss falls (docs/pipeline.md, "Replicas")."""

from __future__ import annotations

import math

import pytest

from testnet import launcher
from tests.conftest import answer, nodes, pipeline, pipeline_net, wait_until

pytestmark = pytest.mark.slow


net = pipeline_net(stages=2)


def test_each_host_averages_with_the_other_host_of_its_stage(net):
    procs = nodes(net)
    wait_until(lambda: sorted(pipeline(p).get("stage") for p in procs) == [0, 0, 1, 1]
               and all(pipeline(p).get("phase") == "training" for p in procs),
               180, "two hosts on each of the 2 stages, training")
    tail = next(p for p in procs if pipeline(p).get("stage") == 1)

    def averaged(p: launcher.Proc) -> dict | None:
        q = pipeline(p)
        return q if (q.get("replicas") or {}).get("rounds_averaged", 0) >= 2 else None

    for p in procs:
        q = wait_until(lambda p=p: averaged(p), 300,
                       f"{p.name} to average 2 rounds with its stage's other host")
        me = answer(p)["peer_id"]
        partner = q["replicas"]["last_partner"]
        assert partner in q["map"][str(q["stage"])] and partner != me, (p.name, q["map"])
    # the last stage computes the loss: far below a fresh model's ln 256 = 5.55 nats/byte
    # (its first reading here may already be mid-training, so it is not the reference)
    loss = pipeline(tail)["training"]["loss"]
    assert loss is not None and math.isfinite(loss) and loss < math.log(256) - 1.0, loss
