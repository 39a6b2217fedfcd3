"""Training through churn: nodes SIGKILLed and restarted at random while the run trains.

    node bench churn [--quick]

Starts a testnet of the churn scenario (testnet/churn_manifest.toml: the demo model,
checkpoints every 40 steps) with 8 nodes, waits until every node trains, then runs the
churn (testnet/churn.py: a seeded fixed-interval schedule of 2 kills a minute for 10
minutes, never the bootstrap, at most 8 // 4 = 2 nodes down at once). Every node's status
is sampled every few seconds throughout. When the churn is over it measures:
* every killed node back, running, with its peer id, and training on (no node stuck, no
  training failure);
* the run documents converged: every replica holds every entry any replica held when the
  churn ended, at that version or newer (control command `rundoc`);
* nothing lost: each restarted node resumed at or after the newest checkpoint it held when
  it was killed, and after the testnet is stopped every node's newest checkpoint is at or
  after the one it held before its last kill; every checkpoint on disk verifies.
Rounds averaged and local are summed over each node's lives (a restart starts its counters
at 0; the driver notes them just before each kill). --quick: 4 nodes, 4 kills a minute for
60 s. Results go to docs/benchmarks.md (section `churn`) and docs/churn.png.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from node.checkpoints.store import CheckpointStore
from testnet import churn, launcher
from testnet.bench.report import DOC, machine, md_table, pyplot, write_section
from testnet.observe import ask, holds, until

FULL = {"nodes": 8, "rate": 2.0, "duration_s": 600.0}
QUICK = {"nodes": 4, "rate": 4.0, "duration_s": 60.0}
SAMPLE_S = 5.0
SEED = 0






def _trainers(net: launcher.Testnet) -> list[launcher.Proc]:
    return [p for p in net.procs if p.name != "bootstrap"]




def _sample(net: launcher.Testnet) -> list[dict[str, Any]]:
    t = time.time()
    out = []
    for row in launcher.collect_status(net):
        if row["name"] == "bootstrap":
            continue
        tr = (row.get("status") or {}).get("training") or {}
        out.append(
            {
                "t": t,
                "name": row["name"],
                "pid": row["pid"],
                "up": "status" in row,
                "step": tr.get("step"),
                "loss": tr.get("loss"),
                "val_loss": tr.get("val_loss"),
                "rounds_averaged": tr.get("rounds_averaged"),
                "rounds_local": tr.get("rounds_local"),
                "error": tr.get("error"),
            }
        )
    return out


def _rounds(name: str, samples: list[dict], events: list[dict]) -> tuple[int, int]:
    """Rounds averaged and local over every life of `name` (counters restart at 0)."""
    lives: dict[int, list[int]] = {}
    for s in samples:
        if s["name"] == name and s["rounds_averaged"] is not None:
            life = lives.setdefault(s["pid"], [0, 0])
            life[0] = max(life[0], s["rounds_averaged"])
            life[1] = max(life[1], s["rounds_local"] or 0)
    for e in events:
        if e["victim"] == name and e.get("rounds_averaged") is not None:
            life = lives.setdefault(e["old_pid"], [0, 0])
            life[0] = max(life[0], e["rounds_averaged"])
            life[1] = max(life[1], e.get("rounds_local") or 0)
    return sum(v[0] for v in lives.values()), sum(v[1] for v in lives.values())


def run(quick: bool = False) -> dict[str, Any]:
    """Run the churn on a fresh testnet; everything measured, for `main` to report."""
    from rich.console import Console

    console = Console()
    cfg = QUICK if quick else FULL
    n = cfg["nodes"]
    config = churn.ChurnConfig(rate=cfg["rate"], duration_s=cfg["duration_s"], seed=SEED)
    res: dict[str, Any] = {"cfg": cfg, "samples": [], "quick": quick}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "tn"
        with console.status(f"starting {n} nodes"):
            net = launcher.up(
                directory,
                n,
                manifest=launcher.scenario_manifest_path("churn"),
                detached=True,
                timeout=300,
            )
        try:
            res["run_id"] = net.run_id
            ids = {
                p.name: until(lambda p=p: ask(p).get("peer_id"), 60, f"{p.name}'s peer id")
                for p in _trainers(net)
            }
            with console.status("waiting for every node to train"):
                for p in _trainers(net):
                    until(
                        lambda p=p: (ask(p).get("training") or {}).get("step", 0) > 0,
                        300,
                        f"{p.name} to train",
                    )
            launcher.start_churn(net, config)
            state: dict[str, Any] = {}
            deadline = time.monotonic() + config.duration_s + churn.RESTART_TIMEOUT_S + 120
            with console.status("churning") as spinner:
                while time.monotonic() < deadline:
                    net = launcher.Testnet.load(directory) or net
                    res["samples"] += _sample(net)
                    state = churn.load_state(directory) or {}
                    spinner.update(churn.describe(churn.summary(state)))
                    if state.get("done"):
                        break
                    time.sleep(SAMPLE_S)
            if not state.get("done"):
                raise TimeoutError("the churn did not finish")
            res["state"] = state
            t_done = time.time()
            net = launcher.Testnet.load(directory) or net
            procs = _trainers(net)
            # Everyone trains on after the churn: two more outer rounds (H = 20) each.
            at_done = {p.name: (ask(p).get("training") or {}).get("step", 0) for p in procs}
            stuck = []
            with console.status("every node training on after the churn"):
                for p in procs:
                    try:
                        until(
                            lambda p=p: (
                                (ask(p).get("training") or {}).get("step", 0)
                                >= at_done[p.name] + 40
                            ),
                            240,
                            f"{p.name} to train on",
                        )
                    except TimeoutError:
                        stuck.append(p.name)
            res["stuck"] = stuck
            with console.status("run documents converging"):
                replicas = [ask(p, "rundoc") for p in procs]
                snapshot: dict[str, list] = {}
                for r in replicas:
                    for k, v in r.items():
                        snapshot[k] = max(snapshot.get(k, v), v)
                t_snap = time.monotonic()
                try:
                    until(
                        lambda: all(holds(ask(p, "rundoc"), snapshot) for p in procs),
                        180,
                        "the run documents to converge",
                        interval=0.5,
                    )
                    res["converged_s"] = time.monotonic() - t_snap
                except TimeoutError:
                    res["converged_s"] = None
                res["rundoc_entries"] = len(snapshot)
            res["after_churn_s"] = time.time() - t_done
            final = {p.name: ask(p) for p in procs}
            res["final"] = {
                name: {
                    "peer_id": st.get("peer_id"),
                    "same_id": st.get("peer_id") == ids[name],
                    "alive": launcher.alive(
                        next(p.pid for p in procs if p.name == name),
                        next(p.state_dir for p in procs if p.name == name),
                    ),
                    **{
                        k: (st.get("training") or {}).get(k)
                        for k in ("step", "loss", "val_loss", "error")
                    },
                }
                for name, st in final.items()
            }
            res["samples"] += _sample(net)
            state_dirs = {p.name: Path(p.state_dir) for p in procs}
        finally:
            launcher.down(directory)
        checks: dict[str, dict[str, Any]] = {}
        for name, d in state_dirs.items():
            store = CheckpointStore(d)
            held = store.list(res["run_id"])
            bad = [cid for cid, _ in held if store.verify(cid)]
            checks[name] = {
                "held": len(held),
                "bad": bad,
                "newest": held[-1][1].step if held else None,
            }
        res["checkpoints"] = checks
    res["total_s"] = time.monotonic() - started
    return res


def analyse(res: dict[str, Any]) -> dict[str, Any]:
    """Per-node rows and the verdicts, from what `run` measured."""
    events = res["state"]["events"]
    samples = res["samples"]
    names = sorted({s["name"] for s in samples}, key=lambda x: int(x[4:]) if x[4:].isdigit() else 0)
    per_node = []
    resumed_ok = True
    redone = []
    for e in events:
        if e.get("step") is not None and e.get("ckpt_step") is not None:
            redone.append(e["step"] - e["ckpt_step"])
        # the first step the node reports in its new life: at or after its newest checkpoint
        later = [
            s["step"]
            for s in samples
            if s["name"] == e["victim"] and s.get("pid") == e.get("pid") and s["step"]
        ]
        e["resumed_step"] = later[0] if later else None
        if e.get("ckpt_step") is not None and later and later[0] < e["ckpt_step"]:
            resumed_ok = False
    for name in names:
        mine = [e for e in events if e["victim"] == name]
        fin = res["final"].get(name, {})
        ck = res["checkpoints"].get(name, {})
        before_last = mine[-1].get("ckpt_step") if mine else None
        averaged, local = _rounds(name, samples, events)
        kept = before_last is None or (ck.get("newest") or -1) >= before_last
        per_node.append(
            {
                "name": name,
                "kills": len(mine),
                "back": all(e.get("back_s") is not None for e in mine),
                "same_id": fin.get("same_id"),
                "step": fin.get("step"),
                "loss": fin.get("loss"),
                "val_loss": fin.get("val_loss"),
                "averaged": averaged,
                "local": local,
                "ckpt_before": before_last,
                "ckpt_after": ck.get("newest"),
                "kept": kept,
                "held": ck.get("held", 0),
                "bad": len(ck.get("bad", [])),
                "ok": fin.get("alive") and not fin.get("error") and name not in res["stuck"],
            }
        )
    downtimes = [e["back_s"] - e["killed_s"] for e in events if e.get("back_s") is not None]
    lateness = [e["killed_s"] - e["due_s"] for e in events]
    return {
        "rows": per_node,
        "kills": len(events),
        "restarts": sum(1 for e in events if e.get("restarted_s") is not None),
        "skipped": res["state"].get("skipped", 0),
        "downtime_median": statistics.median(downtimes) if downtimes else math.nan,
        "downtime_max": max(downtimes) if downtimes else math.nan,
        "late_max": max(lateness) if lateness else 0.0,
        "redone_mean": statistics.mean(redone) if redone else math.nan,
        "redone_max": max(redone) if redone else 0,
        "resumed_ok": resumed_ok,
        "all_back_same_id": all(r["back"] and r["same_id"] for r in per_node),
        "nothing_lost": all(r["kept"] for r in per_node) and resumed_ok,
        "all_valid": all(r["bad"] == 0 and r["held"] > 0 for r in per_node),
        "all_ok": all(r["ok"] for r in per_node),
    }


def plot(res: dict[str, Any], path: Path) -> bool:
    """Loss and step of every node over time, kills marked. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    samples, events = res["samples"], res["state"]["events"]
    names = sorted({s["name"] for s in samples}, key=lambda x: int(x[4:]) if x[4:].isdigit() else 0)
    fig, (ax_loss, ax_step) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    colors = plt.get_cmap("tab10")
    offset = res["state"]["started_unix"]  # the driver's clock starts there
    for i, name in enumerate(names):
        mine = [s for s in samples if s["name"] == name]
        t = [s["t"] - offset for s in mine]
        loss = [s["loss"] if s["up"] and s["loss"] is not None else math.nan for s in mine]
        # a restarted node says step 0 until its trainer has loaded: down, for the plot
        step = [s["step"] if s["up"] and s["step"] else math.nan for s in mine]
        ax_loss.plot(t, loss, color=colors(i), label=name, lw=1)
        ax_step.plot(t, step, color=colors(i), label=name, lw=1)
        for e in (e for e in events if e["victim"] == name):
            if e.get("step") is not None:
                ax_step.plot([e["killed_s"]], [e["step"]], "x", color=colors(i), ms=7)
            ax_loss.axvline(e["killed_s"], color=colors(i), lw=0.6, ls=":")
    dur = res["cfg"]["duration_s"]
    for ax in (ax_loss, ax_step):
        ax.axvspan(0, dur, color="0.9", zorder=0)
    ax_loss.set_ylabel("training loss (nats/byte)")
    ax_step.set_ylabel("step")
    ax_step.set_xlabel(
        "seconds since the churn started (grey: churn; x / dotted: a kill; gaps: down; "
        "after the churn only the last sample)"
    )
    ax_loss.legend(ncol=4, fontsize=8)
    ax_loss.set_title(
        f"{len(names)} nodes, {res['cfg']['rate']:g} kills/min for {dur:g} s (seed {SEED})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _gap_note(a: dict[str, Any]) -> str:
    """Why a node can go longer than the checkpoint interval without a checkpoint."""
    if not a["redone_max"] or a["redone_max"] <= 40:
        return ""
    return (
        " (a restarted node resumes from its checkpoint and then sets its step to the "
        "swarm's round boundary, node/training/service.py; a node that lags keeps doing so, "
        "and a checkpoint step it lands on is never written, since checkpoints are taken "
        "after a step whose number is a multiple of 40: a lagging node can go many rounds "
        "without one)"
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def report(
    res: dict[str, Any], a: dict[str, Any], has_plot: bool
) -> tuple[str, list[str], list[list[str]]]:
    headers = [
        "node",
        "kills",
        "back, same peer id",
        "steps",
        "rounds averaged / local",
        "loss",
        "val loss",
        "newest ckpt step: before last kill -> after",
        "checkpoints valid",
        "training at the end",
    ]
    rows = [
        [
            r["name"],
            str(r["kills"]),
            _yes(r["back"] and r["same_id"]),
            _num(r["step"], "{:d}"),
            f"{r['averaged']} / {r['local']}",
            _num(r["loss"], "{:.3f}"),
            _num(r["val_loss"], "{:.3f}"),
            f"{_num(r['ckpt_before'], '{:d}')} -> {_num(r['ckpt_after'], '{:d}')}",
            f"{r['held'] - r['bad']} / {r['held']}",
            _yes(r["ok"]),
        ]
        for r in a["rows"]
    ]
    table = md_table(headers, rows)
    cfg = res["cfg"]
    quick = res["quick"]
    conv = res.get("converged_s")
    text = (
        f"## Churn: nodes killed and restarted while training\n\n"
        f"`node bench churn{' --quick' if quick else ''}` on {machine()}; "
        f"{res['total_s'] / 60:.1f} min in all. {cfg['nodes']} nodes of the churn scenario "
        f"(testnet/churn_manifest.toml: the demo byte-level GPT, NoLoCo every 20 steps, a "
        f"checkpoint every 40 steps, 3 kept) on this machine's cores. Once every node trains, "
        f"the churn SIGKILLs a node's process group {cfg['rate']:g} times a minute (fixed "
        f"interval, seeded victims, never the bootstrap, never more than "
        f"{res['state']['max_down']} down at once) for {cfg['duration_s']:g} s and "
        f"restarts it {churn.DOWNTIME_S:g} s later with the same state directory "
        f"(testnet/churn.py). Every node's status is sampled every {SAMPLE_S:g} s.\n\n"
        f"{table}\n\n"
        f"- kills {a['kills']} (scheduled {len(res['state']['schedule'])}, skipped "
        f"{a['skipped']}), restarts {a['restarts']}; a kill waited at most "
        f"{a['late_max']:.1f} s for the bound on nodes down;\n"
        f"- kill to running again: median {a['downtime_median']:.1f} s, max "
        f"{a['downtime_max']:.1f} s (start-up, `import torch`, joining, loading the newest "
        f"own checkpoint);\n"
        f"- steps since the victim's newest checkpoint at each kill: mean "
        f"{a['redone_mean']:.1f}, max {a['redone_max']} (checkpoints are due every 40 steps); "
        f"every restarted node reported a step at or after that checkpoint: "
        f"{_yes(a['resumed_ok'])}{_gap_note(a)};\n"
        f"- every killed node back with its peer id: {_yes(a['all_back_same_id'])}; every "
        f"node training on after the churn (two more rounds) with no training failure: "
        f"{_yes(a['all_ok'])};\n"
        f"- run documents converged after the churn: "
        + (
            f"every replica held all {res['rundoc_entries']} entries any replica held within "
            f"{conv:.1f} s;\n"
            if conv is not None
            else f"**not within 180 s** ({res['rundoc_entries']} entries);\n"
        )
        + f"- nothing lost (newest checkpoint after the stop at or after the one held before "
        f"the last kill, on every node): {_yes(a['nothing_lost'])}; every checkpoint on "
        f"disk verifies (CheckpointStore.verify after `down`): {_yes(a['all_valid'])}.\n\n"
        + (
            "![churn](churn.png)"
            if has_plot
            else "(No plot: matplotlib is not installed; `pip install -e '.[bench]'`.)"
        )
    )
    return text, headers, rows


def main(quick: bool = False, doc: Path | None = None, raw: Path | None = None) -> str:
    """Run the benchmark (or, with `raw`, report again what a run saved) and write it up."""
    from rich.console import Console

    from testnet.bench.report import print_tables

    doc_path = doc or DOC
    if raw is not None:
        res = json.loads(raw.read_text())
    else:
        res = run(quick)
        raw = Path(tempfile.gettempdir()) / "peertrain-bench-churn.json"
        raw.write_text(json.dumps(res))  # everything sampled, for a closer look
    a = analyse(res)
    has_plot = plot(res, doc_path.parent / "churn.png")
    text, headers, rows = report(res, a, has_plot)
    print_tables(Console(), [("churn", headers, rows)])
    write_section("churn", text, doc_path)
    return text
