"""A pipeline run on real node processes (`node testnet up --scenario pipeline`, whose
manifest says `recovery = "checkfree"`): four stages of a small GPT, one node each, placed
by themselves; activations and gradients over `/peertrain/pipe/1.0.0`; the loss falls.
Then the losses a swarm meets, one after the other on the same testnet (each test first
waits for every stage to be hosted and training): an interior stage killed is rebuilt by
a replacement with CheckFree; a stage host killed and started again resumes from its own
checkpoint; the first stage lost is copied from its neighbours, not restarted from the
seed; two adjacent stages lost at once are rebuilt from the stages around them (issue 27;
docs/pipeline.md, "Recovery live"). One testnet for all: building one costs ~15 s and
warming it up as long again, per file."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from testnet import launcher
from tests.conftest import (
    answer,
    cli,
    host_of,
    nodes,
    pipeline,
    pipeline_net,
    wait_for_ends_copy,
    wait_until,
)

pytestmark = pytest.mark.slow


def stages_of(net: launcher.Testnet) -> dict[str, int | None]:
    return {p.name: pipeline(p).get("stage") for p in nodes(net)
            if launcher.alive(p.pid, p.state_dir)}


def last_stage(net: launcher.Testnet) -> launcher.Proc:
    return next(p for p in nodes(net) if launcher.alive(p.pid, p.state_dir)
                and pipeline(p).get("stage") == 3)


def pipeline_report(net: launcher.Testnet) -> str:
    """Each node's stage, phase and recovery, and its log's pipeline lines: what a failed
    wait needs to say (a loaded CI machine fails where a quiet one does not)."""
    out = []
    for p in nodes(net):
        q = pipeline(p)
        out.append(f"{p.name}: alive={launcher.alive(p.pid, p.state_dir)} stage={q.get('stage')} "
                   f"phase={q.get('phase')} recovery={q.get('recovery')}")
        log = Path(p.state_dir) / "stdout.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        out += ["    " + line for line in [x for x in lines if "pipeline" in x][-10:]]
    return "\n".join(out)


net = pipeline_net(stages=4)


def current(net: launcher.Testnet) -> launcher.Testnet:
    """The testnet as its file says now: the module's fixture was loaded before the
    earlier tests' kills added replacements."""
    return launcher.Testnet.load(Path(net.dir)) or net


def wait_for_training(net: launcher.Testnet, steps: int = 0) -> None:
    wait_until(lambda: sorted(s for s in stages_of(net).values() if s is not None)
               == [0, 1, 2, 3] and all(pipeline(p).get("phase") == "training"
                                      for p in nodes(net)
                                      if launcher.alive(p.pid, p.state_dir)),
               180, "one node on each of the 4 stages, training")
    def tail_step() -> int:
        return max((q.get("training", {}).get("step", 0) for q in map(pipeline, nodes(net))
                    if q.get("stage") == 3), default=0)
    wait_until(lambda: tail_step() >= steps, 300, f"the last stage's step {steps}")


def test_four_stages_place_themselves_and_the_loss_falls(net):
    wait_for_training(net)
    tail = last_stage(net)
    first = wait_until(lambda: pipeline(tail).get("training", {}).get("loss"), 180,
                       "the last stage's first loss")
    wait_until(lambda: (t := pipeline(tail).get("training", {})).get("step", 0) >= 60
               and t.get("loss") is not None and t["loss"] < first - 0.8, 400,
               f"the loss to fall from {first} by 0.8 in 60 steps")
    p = pipeline(tail)
    assert p["map"] and all(len(hosts) == 1 for hosts in p["map"].values())
    assert p["bytes_per_micro_batch"]["grad"] == 4 * 64 * 64 * 2  # bf16 [4, 64, 64]
    assert p["worker"]["micro_batches"] >= 60 * 4 - 8
    # loopback is a direct path: its messages took bulk lanes (a lane that failed once
    # under load would leave that one peer on the stream: not asserted)
    assert "lane" in p["outbox"]["paths"].values(), p["outbox"]
    # the stage map in `node status`, the stage column in the testnet table
    r = cli("status", "--state-dir", tail.state_dir)
    assert r.returncode == 0, r.stderr
    assert "stage map" in r.stdout and "(this node)" in r.stdout and "stage 3 of 4" in r.stdout
    r = cli("testnet", "status", "--dir", net.dir)
    header = next(line for line in r.stdout.splitlines() if "phase" in line)
    assert r.returncode == 0 and "stage" in header


def test_kill_stage_of_an_interior_stage_is_rebuilt_by_a_replacement(net):
    net = current(net)
    # Trained first, whatever ran before: a stage lost before any step is restarted from
    # the run's seed, not rebuilt. (Seen in CI: this module's fixture was built again for
    # this test, which killed stage 2 before training began and waited for a rebuild.)
    wait_for_training(net, steps=10)
    tail = last_stage(net)
    before = pipeline(tail)["training"]
    killed, new = launcher.kill_stage(net, 2)
    assert killed and new is not None
    net = launcher.Testnet.load(Path(net.dir)) or net
    # The replacement (or, if it first took a stage on a stale view, the node beside it)
    # rebuilds stage 2 from stages 1 and 3, weighted by their gossiped gradient norms.
    def rebuilt() -> dict | None:
        for p in nodes(net):
            rec = pipeline(p).get("recovery") or {}
            if pipeline(p).get("stage") == 2 and rec.get("rule") == "average":
                return rec
        return None
    try:
        rec = wait_until(rebuilt, 180, "stage 2 rebuilt by CheckFree")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{pipeline_report(net)}") from None
    assert len(rec["sources"]) == 2 and rec["at_step"] >= before["step"]
    assert all(0 <= n <= 1.0 + 1e-3 for n in rec["norms"].values())  # after clipping
    # and training goes on through the new stage, the loss still far below the start's
    wait_until(lambda: pipeline(tail).get("training", {}).get("step", 0)
               >= rec["at_step"] + 20, 300, "20 steps through the rebuilt stage")
    loss = pipeline(tail)["training"]["loss"]
    assert loss is not None and math.isfinite(loss) and loss < math.log(256) - 1.0
    assert sorted(s for s in stages_of(net).values() if s is not None) == [0, 1, 2, 3]


def test_a_stage_host_started_again_resumes_from_its_own_checkpoint(net):
    """A crash and a restart: the host comes back with its state directory, takes the
    stage it left empty and loads its own checkpoint of it (weights and Adam state, at
    most checkpoint.every_steps old) instead of rebuilding it from its neighbours."""
    net = current(net)
    host = next(p for p in nodes(net) if launcher.alive(p.pid, p.state_dir)
                and pipeline(p).get("stage") == 1)
    saved = wait_until(lambda: pipeline(host).get("checkpoint_step"), 300,
                       "stage 1's host to write its first checkpoint")
    killed, _ = launcher.kill_stage(net, 1, replace=False)
    assert killed == [host.name]
    back = launcher.restart_node(net, host.name)

    def resumed() -> dict | None:
        q = pipeline(back)
        rec = q.get("recovery") or {}
        return rec if q.get("stage") == 1 and rec.get("rule") == "checkpoint" else None

    try:
        rec = wait_until(resumed, 180, "stage 1 resumed from its host's own checkpoint")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{pipeline_report(net)}") from None
    step = re.search(r"checkpoint of step (\d+)", rec["reason"] or "")
    assert step is not None and int(step.group(1)) >= saved, rec
    tail = last_stage(net)
    wait_until(lambda: pipeline(tail).get("training", {}).get("step", 0)
               >= rec["at_step"] + 10, 300, "10 steps through the resumed stage")



def test_stage_0_lost_under_the_default_rule_is_copied_not_restarted_from_the_seed(net):
    """Under `recovery = "checkfree"` the first stage is rebuilt by CheckFree+'s rule: its
    block copied from its swap partner and its embedding from the copy its neighbour keeps.
    No swap runs: that is what `recovery = "checkfree+"` adds (test_pipeline_edge.py)."""
    net = current(net)
    wait_for_training(net)
    holder = host_of(net, 1)
    assert holder is not None
    wait_for_ends_copy(holder, 0)
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


def test_two_adjacent_stages_are_rebuilt_from_the_stages_around_them(net):
    """Stages 1 and 2 lost at once (issue 27 item 3): their two replacements rebuild them
    from the surviving stages (docs/pipeline.md, "Adjacent losses"), not one from the
    seed and the other from it."""
    net = current(net)
    wait_for_training(net, steps=10)
    # what earlier tests rebuilt on these stages is older than this: at most this step
    tail = host_of(net, 3)
    assert tail is not None
    before = pipeline(tail).get("training", {}).get("step", 0)
    launcher.kill_stage(net, 1, replace=False)
    launcher.kill_stage(net, 2)  # once the survivors lost both: a replacement
    net = launcher.Testnet.load(Path(net.dir)) or net
    names = {p.name for p in net.procs}
    launcher.add_node(net, next(f"node{i}" for i in range(len(names), 99)
                                if f"node{i}" not in names))

    def rebuilt() -> dict[int, dict] | None:
        out = {}
        for p in nodes(net):
            if not launcher.alive(p.pid, p.state_dir):
                continue
            q = pipeline(p)
            rec = q.get("recovery") or {}
            if q.get("stage") in (1, 2) and rec.get("at_step", -1) >= before:
                out[q["stage"]] = rec
        return out if len(out) == 2 else None

    try:
        recs = wait_until(rebuilt, 240, "stages 1 and 2 both restarted")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{pipeline_report(net)}") from None
    # Each rebuilt by CheckFree from the surviving stages, never from the seed: on a quiet
    # machine from both survivors (stages 0 and 3; "average", weighted by gradient norm /
    # distance); on a loaded one a replacement has judged stage 3's live host not current
    # and taken the edge rule, a copy of stage 0 (CI 2026-12-08, twice in 4 runs; open,
    # docs/pipeline.md "Adjacent losses").
    if not all(r["rule"] in ("average", "copy") and r["sources"] for r in recs.values()):
        # raised, not asserted: pytest cuts a long assertion message to a line
        raise AssertionError("\n".join([f"stage {s}: {r}" for s, r in sorted(recs.items())]
                                       + [pipeline_report(net)]))
    at = max(r["at_step"] for r in recs.values())
    wait_until(lambda: pipeline(tail).get("training", {}).get("step", 0) >= at + 10, 300,
               "10 steps through the rebuilt stages")
