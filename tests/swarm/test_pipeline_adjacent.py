"""Two adjacent stages lost at once on real node processes (issue 27 item 3): their two
replacements rebuild them from the stages around the lost pair (docs/pipeline.md,
"Adjacent losses"), not one from the seed and the other from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from testnet import launcher
from tests.conftest import nodes, pipeline, pipeline_net, wait_until
from tests.swarm.test_pipeline_live import pipeline_report, wait_for_training

pytestmark = pytest.mark.slow


net = pipeline_net(stages=4)


def test_two_adjacent_stages_are_rebuilt_from_the_stages_around_them(net):
    wait_for_training(net, steps=10)
    launcher.kill_stage(net, 1, replace=False)
    launcher.kill_stage(net, 2)  # once the survivors lost both: a replacement
    net = launcher.Testnet.load(Path(net.dir)) or net
    names = {p.name for p in net.procs}
    launcher.add_node(net, next(f"node{i}" for i in range(len(names), 99)
                                if f"node{i}" not in names))

    def rebuilt() -> dict[int, dict] | None:
        out = {}
        for p in nodes(net):
            q = pipeline(p)
            if q.get("stage") in (1, 2) and q.get("recovery"):
                out[q["stage"]] = q["recovery"]
        return out if len(out) == 2 else None

    try:
        recs = wait_until(rebuilt, 240, "stages 1 and 2 both restarted")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{pipeline_report(net)}") from None
    # each from the two survivors (stages 0 and 3), weighted by gradient norm / distance
    assert all(r["rule"] == "average" and len(r["sources"]) == 2 for r in recs.values()), (
        recs, pipeline_report(net))
    at = max(r["at_step"] for r in recs.values())
    tail = next(p for p in nodes(net) if launcher.alive(p.pid, p.state_dir)
                and pipeline(p).get("stage") == 3)
    wait_until(lambda: pipeline(tail).get("training", {}).get("step", 0) >= at + 10, 300,
               "10 steps through the rebuilt stages")
