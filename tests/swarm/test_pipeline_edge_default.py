"""The first stage lost under the default rule (`recovery = "checkfree"`, the testnet's
manifest) on real node processes: it is rebuilt by CheckFree+'s rule, its block copied
from its swap partner and its embedding from the copy its neighbour keeps, not restarted
from the seed (issue 27; docs/pipeline.md, "Recovery live"). No swap runs: that is what
`recovery = "checkfree+"` adds (tests/swarm/test_pipeline_edge.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from testnet import launcher
from tests.conftest import answer, nodes, pipeline, pipeline_testnet, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[launcher.Testnet]:
    directory = tmp_path_factory.mktemp("edge-default")
    assert 'recovery = "checkfree"' in launcher.scenario_manifest_path("pipeline").read_text()
    with pipeline_testnet(directory / "tn", stages=4) as net:
        yield net


def host_of(net: launcher.Testnet, stage: int) -> launcher.Proc | None:
    return next((p for p in nodes(net) if launcher.alive(p.pid, p.state_dir)
                 and pipeline(p).get("stage") == stage), None)


def test_stage_0_lost_under_the_default_rule_is_copied_not_restarted_from_the_seed(net):
    wait_until(lambda: sorted(pipeline(p).get("stage") for p in nodes(net)) == [0, 1, 2, 3]
               and all(pipeline(p).get("phase") == "training" for p in nodes(net)),
               180, "one node on each of the 4 stages, training")
    holder = host_of(net, 1)
    assert holder is not None
    wait_until(lambda: (pipeline(holder).get("ends_copies") or {}).get("0", 0) >= 10, 180,
               "stage 1's copy of stage 0's ends, taken at step 10 or later")
    tail = host_of(net, 3)
    assert tail is not None
    killed, new = launcher.kill_stage(net, 0)
    assert killed and new is not None
    net = launcher.Testnet.load(Path(net.dir)) or net

    def rebuilt() -> dict | None:
        p = host_of(net, 0)
        rec = (pipeline(p).get("recovery") or {}) if p else {}
        return rec if rec.get("rule") in ("copy+ends", "none") else None

    rec = wait_until(rebuilt, 180, "stage 0 started mid-run")
    assert rec["rule"] == "copy+ends", rec  # "none": the seed's weights, as before
    assert rec["sources"] == [answer(holder)["peer_id"]] and rec["at_step"] > 0, rec
    wait_until(lambda: pipeline(tail).get("training", {}).get("step", 0)
               >= rec["at_step"] + 10, 300, "10 steps through the rebuilt first stage")
    loss = pipeline(tail)["training"]["loss"]
    assert loss is not None and math.isfinite(loss) and loss < math.log(256) - 1.0, loss
