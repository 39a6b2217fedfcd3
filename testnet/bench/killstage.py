"""Losing pipeline stages live: hosts SIGKILLed on a testnet, the pipeline heals itself.

    node bench kill-stage [--quick] [--case NAME ...] [--load idle|burner|both]

For each case, a fresh `--scenario pipeline` testnet (testnet/pipeline_manifest.toml, one
block per stage) trains for a while, then hosts are SIGKILLed and replacements started
(launcher.kill_stage / add_node): they take the empty stage and rebuild it with no human
step (docs/pipeline.md, "Recovery live"). Cases (`--case`):

- `interior`: stage 2 of 4, `recovery = "checkfree"`: the gradient-norm-weighted average
  of its neighbours' blocks;
- `edge-plus`: stage 0, `recovery = "checkfree+"`: its blocks copied from its swap partner
  (which the swap trained in its position), its embedding from its neighbour's copy;
- `edge-default`: stage 0 under the default rule (`recovery = "checkfree"`): CheckFree+'s
  rule where the layout allows it (a copy of the partner, no swap), formerly the seed;
- `restart`: stage 2, no replacement; the killed host itself restarted, from its own
  checkpoint of the stage (every 25 steps), the comparison the CheckFree paper makes;
- `replica`: one of the two hosts of stage 1 in a 3 stages x 2 replicas pipeline, then a
  node added: it copies the surviving replica;
- `twice`: stage 2 killed, rebuilt, trained 30 s, then its replacement killed too;
- `adjacent`: stages 1 and 2 killed at once, two nodes started: each rebuilt from the
  stages around the pair (stages 0 and 3).

Each runs idle and beside a CPU burner (`--load`): one `yes > /dev/null` process, bounded
by `timeout` and killed at the end of the case. Measured from the last stage (which
computes the loss; one of its hosts), read once a second: the loss before the kill (mean
of 5 readings), seconds from the kill to the replacement's start, to every lost stage
reporting how it started, and to the first step through them; the loss right after (the
first reading past that step), 30 s after that step, the worst after; micro-batches
dropped by every live host from the kill to the end; steps a second before and after.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testnet import launcher
from testnet.bench.report import DOC, machine, md_table, write_section
from testnet.observe import ask, until


@dataclass(frozen=True)
class Scenario:
    kind: str  # interior, edge, restart, replica, twice, adjacent
    stage: int  # the stage killed (the first of the pair for adjacent)
    recovery: str  # the manifest's rule; "restart": checkfree, the host restarted
    stages: int = 4
    nodes: int = 4


SCENARIOS = {
    "interior": Scenario("interior", 2, "checkfree"),
    "edge-plus": Scenario("edge", 0, "checkfree+"),
    "edge-default": Scenario("edge", 0, "checkfree"),
    "restart": Scenario("interior", 2, "restart"),
    "replica": Scenario("replica", 1, "checkfree", stages=3, nodes=6),
    "twice": Scenario("twice", 2, "checkfree"),
    "adjacent": Scenario("adjacent", 1, "checkfree"),
}
LOADS = ("idle", "burner")
FULL = {"train_s": 90.0, "readings": 20, "between_s": 30.0}
QUICK = {"train_s": 30.0, "readings": 8, "between_s": 15.0}
AFTER_S = 300.0  # bounded: the wait for the rebuilt stage and the readings after it
READINGS_S = 90.0  # the 5 readings before the kill must come within this
LATER_S = 30.0  # "30 s after": past the first step through the rebuilt stage
STEADY_S = 30.0  # then this long more, for the rate once the replacement has settled
BURN_S = 1800  # the burner's own bound (timeout(1)), in case this process dies first
CASE_S = {"interior": 230, "edge": 230, "restart": 230, "replica": 260, "twice": 330,
          "adjacent": 290}  # a full case's rough length idle (see docs/benchmarks.md)


@dataclass
class Case:
    kind: str
    stage: int
    recovery: str
    load: str = ""  # the load average at the kill, "1 min / 5 min"
    burner: bool = False
    before: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    before_s: list[float] = field(default_factory=list)  # when each was read (monotonic)
    started_s: float | None = None  # kill -> replacement node started
    rebuilt_s: float | None = None  # kill -> every lost stage reports how it started
    rule: str | None = None
    rebuild_s: float | None = None  # the rebuild itself (fetches and averaging)
    first_step_s: float | None = None  # kill -> the last stage's first step past it
    after: list[tuple[int, float]] = field(default_factory=list)
    after_s: list[float] = field(default_factory=list)  # seconds from the kill
    dropped: int | None = None  # micro-batches dropped by the live hosts, kill to end
    error: str | None = None  # why the case did not complete (the table says so)

    @property
    def name(self) -> str:
        if self.kind == "replica":
            what = f"one replica of stage {self.stage} (3x2)"
        elif self.kind == "twice":
            what = f"stage {self.stage} killed twice in a row"
        elif self.kind == "adjacent":
            what = f"adjacent stages {self.stage} and {self.stage + 1}"
        else:
            how = ("restarted from its checkpoint" if self.recovery == "restart"
                   else self.recovery)
            what = f"{self.kind} stage {self.stage}, {how}"
        return what + (", beside `yes`" if self.burner else "")

    def loss_later(self) -> float | None:
        """The mean of the first 5 readings LATER_S or more past the first step through
        the stage (fewer if the case ended first), as "loss before" is the mean of 5: one
        reading is one batch's loss."""
        if self.first_step_s is None or len(self.after_s) != len(self.after):
            return None
        later = [loss for (_, loss), t in zip(self.after, self.after_s, strict=True)
                 if t >= self.first_step_s + LATER_S][:5]
        return statistics.fmean(later) if later else None

    def rates(self) -> tuple[float | None, float | None, float | None]:
        """Steps a second at the last stage: before the kill, in the LATER_S after the
        first step through the rebuilt stage (the replacement still starting up beside the
        others: torch's import, its first steps), and from then on."""
        def rate(rows: list[tuple[int, float]], ts: list[float]) -> float | None:
            if len(rows) < 2 or len(ts) != len(rows) or ts[-1] <= ts[0]:
                return None
            return (rows[-1][0] - rows[0][0]) / (ts[-1] - ts[0])
        if self.first_step_s is None or len(self.after_s) != len(self.after):
            return rate(self.before, self.before_s), None, None
        cut = self.first_step_s + LATER_S
        early = [i for i, t in enumerate(self.after_s) if t <= cut]
        late = [i for i, t in enumerate(self.after_s) if t >= cut]
        return (rate(self.before, self.before_s),
                rate([self.after[i] for i in early], [self.after_s[i] for i in early]),
                rate([self.after[i] for i in late], [self.after_s[i] for i in late]))


def _pipeline(p: launcher.Proc) -> dict[str, Any]:
    try:
        return (ask(p.state_dir) or {}).get("pipeline") or {}
    except Exception:  # starting, busy, gone: no reading this time
        return {}


def _live(net: launcher.Testnet) -> list[launcher.Proc]:
    return [p for p in net.procs if p.name != "bootstrap"
            and launcher.alive(p.pid, p.state_dir)]


def _host(net: launcher.Testnet, stage: int) -> launcher.Proc | None:
    return next((p for p in _live(net) if _pipeline(p).get("stage") == stage), None)


def _reading(tail: launcher.Proc) -> tuple[int, float] | None:
    t = _pipeline(tail).get("training") or {}
    step, loss = t.get("step"), t.get("loss")
    return (step, loss) if isinstance(step, int) and isinstance(loss, float) else None


def _dropped(net: launcher.Testnet) -> dict[str, int]:
    """Each live host's count of dropped micro-batches (its worker's, since it started)."""
    out = {}
    for p in _live(net):
        n = (_pipeline(p).get("worker") or {}).get("dropped")
        if isinstance(n, int):
            out[p.name] = n
    return out


def _rebuilt(net: launcher.Testnet, fresh: set[str], watch: set[int]
             ) -> dict[int, dict[str, Any]] | None:
    """stage -> the recovery a fresh process (a replacement, a restarted host) reports
    on it, once every watched stage has one."""
    out = {}
    for p in _live(net):
        if p.name not in fresh:
            continue
        q = _pipeline(p)
        rec = q.get("recovery") or {}
        if q.get("stage") in watch and rec.get("rule"):
            out[q["stage"]] = rec
    return out if set(out) == watch else None


def _kill_one(net: launcher.Testnet, stage: int, timeout: float = 60.0) -> str:
    """SIGKILL one host of `stage`; once the others' views lost it, start a node (it
    takes the stage with the fewest hosts: this one). Returns the new node's name."""
    victim = _host(net, stage)
    if victim is None:
        raise RuntimeError(f"no live host of stage {stage}")
    pid = (ask(victim.state_dir) or {}).get("peer_id")
    launcher.kill_node(net, victim.name)

    def gone() -> bool:
        for p in _live(net):
            st = ask(p.state_dir)
            if st:
                peers = (st.get("membership") or {}).get("peers", [])
                return pid not in {e.get("peer_id") for e in peers}
        return False
    until(gone, timeout, f"stage {stage}'s killed replica to leave a survivor's view",
          interval=0.5)
    return launcher.add_node(net, launcher.next_name(net)).name


def _kill(net: launcher.Testnet, sc: Scenario) -> tuple[set[str], set[int]]:
    """The scenario's kill: (the processes expected to rebuild, the stages they rebuild)."""
    if sc.recovery == "restart":
        killed, _ = launcher.kill_stage(net, sc.stage, replace=False)
        for name in killed:
            launcher.restart_node(net, name)
        return set(killed), {sc.stage}
    if sc.kind == "replica":
        return {_kill_one(net, sc.stage)}, {sc.stage}
    if sc.kind == "adjacent":
        launcher.kill_stage(net, sc.stage, replace=False)
        _, new = launcher.kill_stage(net, sc.stage + 1)  # once the survivors lost both
        net = launcher.Testnet.load(Path(net.dir)) or net
        extra = launcher.add_node(net, launcher.next_name(net))
        return {new or "", extra.name}, {sc.stage, sc.stage + 1}
    _, new = launcher.kill_stage(net, sc.stage)
    return {new or ""}, {sc.stage}


def _first_step(net: launcher.Testnet, tail: launcher.Proc, fresh: set[str],
                watch: set[int], deadline_s: float) -> None:
    """Wait for the stages a first kill lost (the `twice` case) to be rebuilt and stepped
    through; bounded by `deadline_s`."""
    recs = until(lambda: _rebuilt(net, fresh, watch), deadline_s,
                 f"stages {sorted(watch)} rebuilt", interval=1.0)
    at = max(r.get("at_step", 0) for r in recs.values())
    until(lambda: (r := _reading(tail)) is not None and r[0] > at, deadline_s,
          "a step through the rebuilt stage", interval=1.0)


@contextlib.contextmanager
def burning(on: bool) -> Iterator[subprocess.Popen | None]:
    """One core busy (`yes`) for the block, bounded by timeout(1) too, in a process group
    of its own. Stopped with SIGTERM to the group: SIGKILL would end timeout alone and leave
    `yes` running to BURN_S (2026-11-28: the burner half ran its last case beside 7), and a
    SIGTERM to timeout alone, landing between its fork and its noting the child's pid,
    makes it exit without passing it on (a suite beside a burner left `yes` running)."""
    yes = (subprocess.Popen(["timeout", str(BURN_S), "yes"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True) if on else None)
    try:
        yield yes
    finally:
        if yes is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(yes.pid, signal.SIGTERM)
            yes.wait()


def run_case(sc: Scenario, burner: bool, sizes: dict[str, float], work: Path) -> Case:
    case = Case(sc.kind, sc.stage, sc.recovery, burner=burner)
    tag = f"{sc.kind}-{sc.stage}-{sc.recovery}-{'burner' if burner else 'idle'}"
    manifest = work / f"{tag}.toml"
    text = launcher.scenario_manifest_path("pipeline").read_text()
    mode = "checkfree" if sc.recovery == "restart" else sc.recovery
    manifest.write_text(text.replace('recovery = "checkfree"', f'recovery = "{mode}"'))
    directory = work / f"tn-{tag}"
    with burning(burner):
        net = launcher.up(directory, sc.nodes, manifest=manifest, detached=True,
                          stages=sc.stages, timeout=180)
        try:
            _measure(case, sc, net, directory, sizes)
        finally:
            launcher.down(directory)
    return case


def _measure(case: Case, sc: Scenario, net: launcher.Testnet, directory: Path,
             sizes: dict[str, float]) -> None:
    until(lambda: all(_pipeline(p).get("phase") == "training" for p in _live(net)), 300,
          "every stage training", interval=1.0)
    time.sleep(sizes["train_s"])  # training, not synchronization: the run is measured
    tail = _host(net, sc.stages - 1)
    if tail is None:
        raise RuntimeError("no live host of the last stage")
    if sc.kind == "twice":  # the first kill, healed, then the measured one
        fresh, watch = _kill(net, sc)
        net = launcher.Testnet.load(directory) or net
        _first_step(net, tail, fresh, watch, AFTER_S)
        time.sleep(sizes["between_s"])  # training on the rebuilt stage, measured next
    deadline = time.monotonic() + READINGS_S
    while len(case.before) < 5:
        r = _reading(tail)
        if r is not None and (not case.before or r[0] > case.before[-1][0]):
            case.before.append(r)
            case.before_s.append(time.monotonic())
        if time.monotonic() > deadline:  # a stalled pipeline (a loaded machine): say so
            raise RuntimeError(f"{len(case.before)} of 5 loss readings from the last stage "
                               f"in {READINGS_S:g} s before the kill; its phase: "
                               f"{_pipeline(tail).get('phase')!r}")
        time.sleep(1.0)
    case.load = " / ".join(Path("/proc/loadavg").read_text().split()[:2])
    dropped_before = _dropped(net)
    killed_at = time.monotonic()
    fresh, watch = _kill(net, sc)
    case.started_s = round(time.monotonic() - killed_at, 1)
    net = launcher.Testnet.load(directory) or net
    at_step = None
    last = case.before[-1][0]
    while time.monotonic() - killed_at < AFTER_S:
        now = time.monotonic() - killed_at
        if case.first_step_s is not None and len(case.after) >= sizes["readings"] \
                and now >= case.first_step_s + LATER_S + STEADY_S:
            break
        if at_step is None and (recs := _rebuilt(net, fresh, watch)):
            case.rebuilt_s = round(now, 1)
            case.rule = "/".join(str(recs[s]["rule"]) for s in sorted(recs))
            seconds = [r.get("seconds") for r in recs.values()]
            case.rebuild_s = max((s for s in seconds if isinstance(s, int | float)),
                                 default=None)
            at_step = max(r.get("at_step", last) for r in recs.values())
        r = _reading(tail)
        if at_step is not None and r is not None and r[0] > max(last, at_step):
            if case.first_step_s is None:
                case.first_step_s = round(time.monotonic() - killed_at, 1)
            case.after.append(r)
            case.after_s.append(round(time.monotonic() - killed_at, 1))
            last = r[0]
        time.sleep(1.0)
    after = _dropped(net)
    case.dropped = sum(max(n - dropped_before.get(name, 0), 0) for name, n in after.items())


def table(cases: list[Case]) -> tuple[list[str], list[list[str]]]:
    headers = ["case", "rule", "loss before", "replacement started s", "rebuilt s",
               "first step s", "first loss after", "loss 30 s after", "worst after",
               "mean of last 5 after", "micro-batches dropped",
               "steps/s before -> first 30 s -> next 30 s", "load 1/5 min"]
    rows = []
    for c in cases:
        if c.error is not None:
            rows.append([c.name, f"failed: {c.error}"] + ["-"] * (len(headers) - 3) + [c.load])
            continue
        before = statistics.fmean(loss for _, loss in c.before)
        losses = [loss for _, loss in c.after]
        later = c.loss_later()
        rate_before, rate_early, rate_late = c.rates()
        rows.append([
            c.name, c.rule or "-", f"{before:.2f}", _s(c.started_s), _s(c.rebuilt_s),
            _s(c.first_step_s), f"{losses[0]:.2f}" if losses else "-",
            f"{later:.2f}" if later is not None else "-",
            f"{max(losses):.2f}" if losses else "-",
            f"{statistics.fmean(losses[-5:]):.2f} (steps {c.after[-1][0] - c.after[0][0] + 1})"
            if losses else "-", "-" if c.dropped is None else str(c.dropped),
            f"{_r(rate_before)} -> {_r(rate_early)} -> {_r(rate_late)}", c.load])
    return headers, rows


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def section(cases: list[Case], quick: bool, total_s: float, names: list[str] | None = None,
            loads: tuple[str, ...] = LOADS) -> str:
    headers, rows = table(cases)
    flags = " --quick" if quick else ""
    if names and set(names) != set(SCENARIOS):
        flags += "".join(f" --case {n}" for n in names)
    if tuple(loads) != LOADS:
        flags += f" --load {loads[0]}"
    return "\n\n".join([
        "## Pipeline: losing stages live (`node bench kill-stage`)",
        f"`node bench kill-stage{flags}` on {machine()}; {total_s:.0f} s in all. Per case a "
        f"fresh testnet (testnet/pipeline_manifest.toml: one block per stage, batch 16 in 4 "
        f"micro-batches; 4 stages of one node, or 3 stages x 2 replicas for the replica "
        f"case) trains, then hosts are SIGKILLed and replacements started, which rebuild "
        f"the stages by themselves. \"beside `yes`\": one CPU burner for the whole case. "
        f"Seconds are from the kill; losses are the last stage's (nats/byte; ln 256 = 5.55 "
        f"untrained), read once a second; \"loss before\" is the mean of the last 5 readings "
        f"before the kill, \"30 s after\" the mean of the first 5 from 30 s past the first "
        f"step through the rebuilt stage; micro-batches dropped are every live host's, from the "
        f"kill to the end.",
        md_table(headers, rows),
        "The replacement starts once a survivor's view has lost the dead host (one "
        "heartbeat ttl); most of the time to the rebuild is its join (torch's import, one "
        "more ttl before it chooses a stage). An edge stage under the default rule takes "
        "CheckFree+'s rule (a copy of its partner, the embedding from its neighbour's copy) "
        "without the swap having trained the partner in its position; with `recovery = "
        "\"checkfree+\"` the swap does, at a price in speed (more hops per micro-batch). "
        "The restart case starts the killed host again at once (no wait for the view): its "
        "own checkpoint is at most 25 steps old.",
        f"Rerun: `node bench kill-stage` (every case idle and beside `yes`, about "
        f"{full_minutes()} min) or `--quick`, `--case NAME`, `--load idle|burner`.",
    ])


def full_minutes(names: list[str] | None = None, loads: tuple[str, ...] = LOADS) -> int:
    """A full run's rough length: each case's idle length, 1.3x beside the burner."""
    names = names or list(SCENARIOS)
    total = sum(CASE_S[SCENARIOS[n].kind] * (1.3 if load == "burner" else 1.0)
                for n in names for load in loads)
    return round(total / 60)


def main(quick: bool = False, doc: Path | None = None, names: list[str] | None = None,
         load: str = "both") -> list[Case]:
    unknown = [n for n in names or [] if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown case {unknown[0]!r}; cases: {', '.join(SCENARIOS)}")
    if load not in (*LOADS, "both"):
        raise ValueError(f"--load must be idle, burner or both, got {load!r}")
    loads = LOADS if load == "both" else (load,)
    chosen = names or list(SCENARIOS)
    sizes = QUICK if quick else FULL
    started = time.monotonic()
    cases = []
    with tempfile.TemporaryDirectory(prefix="killstage-") as tmp:
        for name in chosen:
            for how in loads:
                print(f"{name}, {how} ...", flush=True)
                try:
                    case = run_case(SCENARIOS[name], how == "burner", sizes, Path(tmp))
                except (RuntimeError, TimeoutError, launcher.TestnetError) as e:
                    sc = SCENARIOS[name]  # one case that fails does not end the matrix
                    case = Case(sc.kind, sc.stage, sc.recovery, burner=how == "burner",
                                error=str(e)[:200],
                                load=" / ".join(Path("/proc/loadavg").read_text().split()[:2]))
                print(f"  rebuilt by {case.rule} {case.rebuilt_s} s after the kill; first "
                      f"step {case.first_step_s} s; {len(case.after)} readings after; "
                      f"{time.monotonic() - started:.0f} s so far", flush=True)
                cases.append(case)
    headers, rows = table(cases)
    print(md_table(headers, rows))
    write_section("killstage", section(cases, quick, time.monotonic() - started, chosen,
                                       loads), doc or DOC)
    return cases
