"""Losing a whole pipeline stage live: `node testnet kill-stage S` on a 4-stage testnet.

    node bench kill-stage [--quick]

For each case, a fresh `--scenario pipeline` testnet (testnet/pipeline_manifest.toml, 4
stages of one block, one node each) trains for a while, then every host of stage S is
SIGKILLed and a replacement node started (launcher.kill_stage): it takes the empty stage
and rebuilds it with no human step (docs/pipeline.md, "Recovery live"). Cases:

- interior stage 2, `recovery = "checkfree"`: the gradient-norm-weighted average of its
  neighbours' blocks;
- edge stage 0, `recovery = "checkfree+"`: its blocks copied from its swap partner, its
  embedding from the copy its neighbour keeps;
- edge stage 0, `recovery = "checkfree"`: CheckFree has no rule for an edge, so the stage
  restarts from the run seed's weights: what losing the stage costs without a copy;
- interior stage 2, restarted: no replacement; the killed host itself is started again
  (a crash and a restart) and resumes from its own checkpoint of the stage (written every
  `checkpoint.every_steps` = 25 steps), the comparison the CheckFree paper makes.

Measured from the last stage (which computes the loss): the loss before the kill (mean of
5 readings, one a second), the seconds from the kill to the replacement's start, to the
stage rebuilt and to the first step through it, and the loss after (the first reading, the
worst and the mean of the last 5 of `readings` readings).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testnet import launcher
from testnet.bench.report import DOC, machine, md_table, write_section
from testnet.observe import ask, until

CASES = (("interior", 2, "checkfree"), ("edge", 0, "checkfree+"), ("edge", 0, "checkfree"),
         ("interior", 2, "restart"))
FULL = {"train_s": 90.0, "readings": 20}
QUICK = {"train_s": 30.0, "readings": 8}
AFTER_S = 240.0  # bounded: the wait for the rebuilt stage and the readings after it


@dataclass
class Case:
    kind: str
    stage: int
    recovery: str
    load: str = ""
    before: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    started_s: float | None = None  # kill -> replacement node started
    rebuilt_s: float | None = None  # kill -> the stage reports how it started
    rule: str | None = None
    rebuild_s: float | None = None  # the rebuild itself (fetches and averaging)
    first_step_s: float | None = None  # kill -> the last stage's first step past it
    after: list[tuple[int, float]] = field(default_factory=list)

    @property
    def name(self) -> str:
        how = "restarted from its checkpoint" if self.recovery == "restart" else self.recovery
        return f"{self.kind} stage {self.stage}, {how}"


def _pipeline(p: launcher.Proc) -> dict[str, Any]:
    try:
        return (ask(p.state_dir) or {}).get("pipeline") or {}
    except Exception:  # starting, busy, gone: no reading this time
        return {}


def _host(net: launcher.Testnet, stage: int) -> launcher.Proc | None:
    return next((p for p in net.procs if p.name != "bootstrap"
                 and launcher.alive(p.pid, p.state_dir) and _pipeline(p).get("stage") == stage),
                None)


def _reading(tail: launcher.Proc) -> tuple[int, float] | None:
    t = _pipeline(tail).get("training") or {}
    step, loss = t.get("step"), t.get("loss")
    return (step, loss) if isinstance(step, int) and isinstance(loss, float) else None


def run_case(kind: str, stage: int, recovery: str, sizes: dict[str, float],
             work: Path) -> Case:
    case = Case(kind, stage, recovery)
    manifest = work / f"{stage}-{recovery}.toml"
    text = launcher.scenario_manifest_path("pipeline").read_text()
    mode = "checkfree" if recovery == "restart" else recovery
    manifest.write_text(text.replace('recovery = "checkfree"', f'recovery = "{mode}"'))
    directory = work / f"tn-{stage}-{recovery}"
    net = launcher.up(directory, 4, manifest=manifest, detached=True, stages=4, timeout=180)
    try:
        until(lambda: all(_pipeline(p).get("phase") == "training"
                          for p in net.procs if p.name != "bootstrap"), 300,
              "every stage training")
        time.sleep(sizes["train_s"])  # training, not synchronization: the run is measured
        tail = _host(net, 3)
        if tail is None:
            raise RuntimeError("no live host of the last stage")
        while len(case.before) < 5:  # bounded by the readings
            r = _reading(tail)
            if r is not None:
                case.before.append(r)
            time.sleep(1.0)
        case.load = " / ".join(Path("/proc/loadavg").read_text().split()[:2])
        killed_at = time.monotonic()
        if recovery == "restart":
            killed, _ = launcher.kill_stage(net, stage, replace=False)
            for name in killed:
                launcher.restart_node(net, name)
        else:
            launcher.kill_stage(net, stage)
        case.started_s = round(time.monotonic() - killed_at, 1)
        net = launcher.Testnet.load(directory) or net
        at_step = None
        last = case.before[-1][0]
        while time.monotonic() - killed_at < AFTER_S and len(case.after) < sizes["readings"]:
            if at_step is None:
                host = _host(net, stage)
                rec = (_pipeline(host).get("recovery") or {}) if host else {}
                if rec.get("rule"):
                    case.rebuilt_s = round(time.monotonic() - killed_at, 1)
                    case.rule, case.rebuild_s = rec["rule"], rec.get("seconds")
                    at_step = rec.get("at_step", last)
            r = _reading(tail)
            if at_step is not None and r is not None and r[0] > max(last, at_step):
                if case.first_step_s is None:
                    case.first_step_s = round(time.monotonic() - killed_at, 1)
                case.after.append(r)
                last = r[0]
            time.sleep(1.0)
    finally:
        launcher.down(directory)
    return case


def table(cases: list[Case]) -> tuple[list[str], list[list[str]]]:
    headers = ["case", "rule", "loss before", "replacement started s", "rebuilt s",
               "first step s", "first loss after", "worst after", "mean of last 5 after",
               "load 1/5 min"]
    rows = []
    for c in cases:
        before = statistics.fmean(loss for _, loss in c.before)
        losses = [loss for _, loss in c.after]
        rows.append([
            c.name, c.rule or "-", f"{before:.2f}", _s(c.started_s), _s(c.rebuilt_s),
            _s(c.first_step_s), f"{losses[0]:.2f}" if losses else "-",
            f"{max(losses):.2f}" if losses else "-",
            f"{statistics.fmean(losses[-5:]):.2f} (steps {c.after[-1][0] - c.after[0][0] + 1})"
            if losses else "-", c.load])
    return headers, rows


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def section(cases: list[Case], quick: bool, total_s: float) -> str:
    headers, rows = table(cases)
    flag = " --quick" if quick else ""
    return "\n\n".join([
        "## Pipeline: losing a stage live (`node bench kill-stage`)",
        f"`node bench kill-stage{flag}` on {machine()}; {total_s:.0f} s in all. Per case a "
        f"fresh 4-stage testnet (testnet/pipeline_manifest.toml: one block per stage, one "
        f"node each, batch 16 in 4 micro-batches) trains, then `kill-stage` SIGKILLs the "
        f"stage's host and starts a replacement, which rebuilds the stage by itself. Seconds "
        f"are from the kill; losses are the last stage's (nats/byte; ln 256 = 5.55 untrained), "
        f"read once a second.",
        md_table(headers, rows),
        "The replacement starts once a survivor's view has lost the dead host (one "
        "heartbeat ttl); most of the time to the rebuild is its join (torch's import, one "
        "more ttl before it chooses a stage). An edge stage under plain CheckFree restarts "
        "from the run's seed: the loss jumps toward a fresh model's and is relearnt over "
        "many steps; CheckFree+ restores the embedding from the neighbour's copy (at most "
        "10 s old) and copies the partner's blocks, which CheckFree+'s swap has trained in "
        "the edge's position too (odd micro-batches run the two in swapped order), while "
        "the swap slows training down a little (more hops per micro-batch). The restart "
        "case starts the killed host again at once (no wait for the view): its own "
        "checkpoint is at most 25 steps old.",
        f"Rerun: `node bench kill-stage` (about {len(CASES) * 4} min) or `--quick`.",
    ])


def main(quick: bool = False, doc: Path | None = None) -> list[Case]:
    sizes = QUICK if quick else FULL
    started = time.monotonic()
    cases = []
    with tempfile.TemporaryDirectory(prefix="killstage-") as tmp:
        for kind, stage, recovery in CASES:
            print(f"{kind} stage {stage}, recovery = {recovery} ...", flush=True)
            case = run_case(kind, stage, recovery, sizes, Path(tmp))
            print(f"  rebuilt by {case.rule} {case.rebuilt_s} s after the kill; "
                  f"{len(case.after)} readings after", flush=True)
            cases.append(case)
    headers, rows = table(cases)
    print(md_table(headers, rows))
    write_section("killstage", section(cases, quick, time.monotonic() - started),
                  doc or DOC)
    return cases
