"""`node bench sim`: the swarm simulator's curves from 10 to 10,000 peers, into
docs/benchmarks.md (section `sim`) and docs/sim.png.

Every run is one process, one thread (Swarm.run sets torch to one thread), seeded: the
same command on the same code gives the same numbers; only the wall times change.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import asdict
from itertools import product
from pathlib import Path
from typing import Any

from testnet.bench.report import DOC, machine, md_table, print_tables, pyplot, write_section
from testnet.sim import policies
from testnet.sim.document import document_under_churn
from testnet.sim.experiments import checkpoint_burst, sybil_attack
from testnet.sim.scenario import Scenario, load
from testnet.sim.swarm import INBOUND_BUDGET, Result, Swarm

DEFAULT_SCENARIO = Path(__file__).with_name("scenarios") / "default.toml"
#: The same swarm with the node's scale policies since issue 30 (testnet/sim/policies.py).
NODE_SCENARIO = Path(__file__).with_name("scenarios") / "node.toml"
#: What `--reuse` takes from an earlier run: none of it depends on the membership,
#: document, connection or checkpoint-provision policies.
REUSABLE = ("churn", "algos", "sybil", "big")


def _run(sc: Scenario, log: Any) -> Result:
    res = Swarm(sc).run()
    log(f"N={sc.peers} {sc.training.algorithm} churn {sc.churn.per_hour:g}/h x "
        f"{sc.rounds} rounds: {res.wall_s:.1f} s wall, {res.cpu_s:.1f} s CPU, "
        f"{res.virtual_s:.0f} s virtual")
    return res


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.nan


def run(base: Scenario, quick: bool, log: Any = print, node: Scenario | None = None,
        reuse: dict | None = None) -> dict:
    """Every curve; `node`: the swarm with the node's policies, run beside `base` for the
    policy-dependent ones (traffic, document, checkpoint burst); `reuse`: an earlier run's
    results for the rest (REUSABLE)."""
    node = node or load(NODE_SCENARIO)
    sizes = [10, 100, 1000] if quick else [10, 30, 100, 300, 1000, 3000, 10000]
    rounds = 20 if quick else 100
    out: dict[str, Any] = {"sizes": sizes, "rounds": rounds, "scaling": [], "churn": [],
                           "algos": [], "sybil": [], "burst": [], "big": None, "doc": []}
    # traffic, joins, writes: churn 10%/h, the scenario's other settings; both policies
    for n, (label, pol) in product(sizes, (("before", base), ("node", node))):
        sc = pol.with_(peers=n, rounds=rounds, churn__per_hour=0.1,
                       gossip__floods=2 if n >= 3000 else pol.gossip.floods)
        r = _run(sc, log)
        tr = r.traffic
        assert tr is not None and r.flood is not None
        out["scaling"].append({
            "policy": label, "hb_s": r.heartbeat_interval_s, "ann_s": r.announce_interval_s,
            "conns": r.connections, "horizon_s": r.gc_horizon_s,
            "unique_hb": n / r.heartbeat_interval_s, "unique_ann": n / r.announce_interval_s,
            "n": n, "wall_s": r.wall_s, "cpu_s": r.cpu_s, "virtual_s": r.virtual_s,
            "msgs": tr.msgs, "bytes": tr.bytes, "msgs_max": tr.msgs_max,
            "copies": r.flood.copies_mean, "write_t99": r.write_t99_s,
            "ae_t99": r.anti_entropy_t99_s, "joins": r.joins,
            "ready_p50": _q(r.join_to_ready, 0.5), "avg_p50": _q(r.join_to_averaged, 0.5),
            "avg_p95": _q(r.join_to_averaged, 0.95), "entries": r.doc_entries,
            "averaged": r.averaged_share})
    hours = 12.0
    for n in ([100, 1000] if quick else [100, 1000, 10000]):
        for label, pol in (("before", base), ("node", node)):
            m = pol.membership
            horizon = policies.gc_horizon_s(n, m.announce_s, m.gc_horizon_s) \
                if m.gc_horizon_s > 0 else 0.0
            t0 = time.perf_counter()
            d = document_under_churn(n, 0.1, hours, Swarm(pol).sizes.entries_per_peer,
                                     horizon, pol.seed)
            log(f"document, {n} peers, {hours:g} h of churn 10%/h, {label}: {d.entries:,} "
                f"entries (peak {d.peak:,}), {time.perf_counter() - t0:.1f} s")
            out["doc"].append({"policy": label, **asdict(d)})
    if reuse is not None:
        for key in REUSABLE:
            out[key] = reuse[key]
        out["reused"] = reuse.get("machine", "an earlier run")
    n_churn = 300 if quick else 1000
    for per_hour in (() if reuse is not None else (0.0, 0.1, 0.3)):
        for algo in ("noloco", "diloco"):
            sc = base.with_(peers=n_churn, rounds=2 * rounds, churn__per_hour=per_hour,
                            training__algorithm=algo)
            r = _run(sc, log)
            out["churn"].append({"n": n_churn, "per_hour": per_hour, "algo": algo,
                                 "averaged": r.averaged_share, "leaves": r.leaves,
                                 "virtual_s": r.virtual_s, "wall_s": r.wall_s})
    for n in (() if reuse is not None else [10, 100, 1000] if quick else [10, 100, 1000, 10000]):
        for algo in ("noloco", "diloco"):
            sc = base.with_(peers=n, rounds=rounds // 2, churn__per_hour=0.1,
                            training__algorithm=algo,
                            gossip__floods=2 if n >= 3000 else base.gossip.floods)
            r = _run(sc, log)
            out["algos"].append({"n": n, "algo": algo, "loss": r.final_loss,
                                 "spread": r.rounds[-1]["spread"], "sync_s": r.sync_s,
                                 "virtual_s": r.virtual_s, "averaged": r.averaged_share,
                                 "wall_s": r.wall_s})
    n_syb = 200 if quick else 1000
    for share in (() if reuse is not None else (0.1, 0.2, 0.3, 0.4)):
        for agg in ("mean", "sybilwall"):
            o = sybil_attack(n_syb, share, agg, rounds=8 if quick else 12, seed=base.seed)
            log(f"sybils {share:.0%} of {n_syb} vs {agg}: success {o.success:.3f} "
                f"({o.seconds:.1f} s)")
            out["sybil"].append(asdict(o))
    for n in ([100, 1000] if quick else [100, 1000, 10000]):
        for policy in ("newest", "any-recent", "holders"):
            b = checkpoint_burst(n, 0.1, policy, base.checkpoint.size_mb,
                                 base.network.bandwidth_mbit, base.seed)
            out["burst"].append(asdict(b))
    if reuse is not None:
        return out
    big_n = 20_000 if quick else 100_000
    sc = base.with_(peers=big_n, rounds=10, churn__per_hour=0.1, gossip__floods=1)
    r = _run(sc, log)
    out["big"] = {"n": big_n, "rounds": 10, "wall_s": r.wall_s, "cpu_s": r.cpu_s,
                  "virtual_s": r.virtual_s,
                  "averaged": r.averaged_share,
                  "msgs": r.traffic.total_msgs if r.traffic else math.nan}
    return out


def _f(x: float, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if abs(x) >= 1e6:
        return f"{x / 1e6:,.{digits}f} M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:,.{digits}f} k"
    return f"{x:,.{digits}f}"


def plot(res: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    sc = res["scaling"]
    ns = [r["n"] for r in sc]
    ax = axes[0][0]
    for kind in sc[0]["msgs"]:
        ax.plot(ns, [r["msgs"][kind] for r in sc], "o-", label=kind)
    ax.plot(ns, [sum(r["msgs"].values()) for r in sc], "k--", label="total")
    ax.axhline(INBOUND_BUDGET, color="r", lw=0.8, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="peers", ylabel="inbound messages / node / s",
           title=f"membership and gossip load (red: {INBOUND_BUDGET:.0f}/s, the budget)")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    ax.plot(ns, [sum(r["bytes"].values()) / 1e6 * 8 for r in sc], "o-", label="all")
    for kind in sc[0]["bytes"]:
        ax.plot(ns, [r["bytes"][kind] / 1e6 * 8 for r in sc], ".-", lw=0.8, label=kind)
    ax.plot(ns, [sum(v for k, v in r["bytes"].items() if k != "averaging") / 1e6 * 8
                 for r in sc], "k--", label="all but averaging")
    ax.set(xscale="log", yscale="log", xlabel="peers", ylabel="inbound Mbit/s per node",
           title="bytes")
    ax.legend(fontsize=7)
    ax = axes[0][2]
    ax.plot(ns, [r["write_t99"] for r in sc], "o-", label="write -> 99% (gossip)")
    ax.plot(ns, [r["ae_t99"] for r in sc], "s-", label="write -> 99% (anti-entropy only)")
    ax.plot(ns, [r["ready_p50"] for r in sc], "^-", label="joiner ready (median)")
    ax.plot(ns, [r["avg_p50"] for r in sc], "v-", label="joiner first averaged (median)")
    ax.axhline(30, color="r", lw=0.8, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="peers", ylabel="virtual s",
           title="spread and joining (red: 30 s)")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    for algo, style in (("noloco", "o-"), ("diloco", "s--")):
        ch = [r for r in res["churn"] if r["algo"] == algo]
        ax.plot([r["per_hour"] * 100 for r in ch], [r["averaged"] for r in ch], style,
                label=algo)
    ax.set(xlabel="churn, % of peers leaving per hour", ylabel="share of rounds averaged",
           ylim=(0, 1.05), title="averaged vs local under churn")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    for algo, style in (("noloco", "o-"), ("diloco", "s--")):
        al = [r for r in res["algos"] if r["algo"] == algo]
        ax.plot([r["n"] for r in al], [r["sync_s"] for r in al], style, label=f"{algo}: sync s")
        ax.plot([r["n"] for r in al], [r["loss"] for r in al], style, alpha=0.5,
                label=f"{algo}: final loss")
    ax.set(xscale="log", yscale="log", xlabel="peers",
           title="NoLoCo vs DiLoCo, equal compute, churn 10%/h")
    ax.legend(fontsize=7)
    ax = axes[1][2]
    for agg, style in (("mean", "o-"), ("sybilwall", "s-")):
        sy = [r for r in res["sybil"] if r["aggregator"] == agg]
        ax.plot([100 * r["sybils"] / r["peers"] for r in sy], [r["success"] for r in sy], style,
                label=f"{agg}: attack success")
        ax.plot([100 * r["sybils"] / r["peers"] for r in sy], [r["sybil_weight"] for r in sy],
                style, alpha=0.4, label=f"{agg}: weight on sybils")
    ax.set(xlabel="% sybil identities", ylim=(0, 1), title="one attacker, many identities")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def report(res: dict, has_plot: bool, started: str, total_s: float, scenario: str) -> str:
    sc = res["scaling"]
    kinds = list(sc[0]["msgs"])
    lines = [
        "## Swarm simulator: where the design breaks as the swarm grows",
        "",
        f"`node bench sim` on {started}; {total_s:.0f} s in all, one thread, on a machine "
        "shared with other engineers' jobs (load average 10-25 on 2 cores: wall times are "
        "pessimistic; CPU s is the figure to compare). "
        f"Scenario {scenario} (docs/simulator.md: what is real, what is modelled); churn "
        "10%/h unless a table says otherwise; a 100 MB model and checkpoint.",
        "",
        "### Inbound messages per node and second (mean peer; `max`: the busiest)",
        "",
        md_table(["peers", *kinds, "total", "busiest", "Mbit/s in", "wall s", "CPU s",
                  "virtual s"],
                 [[f"{r['n']:,}", *(_f(r["msgs"][k]) for k in kinds),
                   _f(sum(r["msgs"].values())), _f(sum(r["msgs_max"].values())),
                   _f(sum(r["bytes"].values()) * 8 / 1e6, 2), f"{r['wall_s']:.1f}",
                   f"{r['cpu_s']:.1f}", f"{r['virtual_s']:,.0f}"] for r in sc]),
        "",
        "### Inbound Mbit/s per node, by kind",
        "",
        md_table(["peers", *kinds, "total"],
                 [[f"{r['n']:,}", *(_f(r["bytes"][k] * 8 / 1e6, 3) for k in kinds),
                   _f(sum(r["bytes"].values()) * 8 / 1e6, 2)] for r in sc]),
        "",
        "### Spread, joining, run-document size",
        "",
        md_table(["peers", "copies per gossip msg", "write -> 99% (gossip) s",
                  "write -> 99% (anti-entropy) s", "joiners", "join -> ready s (p50)",
                  "join -> first averaged s (p50 / p95)", "document entries"],
                 [[f"{r['n']:,}", f"{r['copies']:.2f}", f"{r['write_t99']:.2f}",
                   f"{r['ae_t99']:.0f}", str(r["joins"]), _f(r["ready_p50"]),
                   f"{_f(r['avg_p50'])} / {_f(r['avg_p95'])}", f"{r['entries']:,}"]
                  for r in sc]),
        "",
        "### Rounds averaged vs local as churn rises",
        "",
        md_table(["churn /h", "algorithm", "peers", "leaves", "rounds averaged", "virtual s",
                  "wall s"],
                 [[f"{r['per_hour']:.0%}", r["algo"], f"{r['n']:,}", str(r["leaves"]),
                   f"{r['averaged']:.1%}", f"{r['virtual_s']:,.0f}", f"{r['wall_s']:.1f}"]
                  for r in res["churn"]]),
        "",
        "### NoLoCo vs DiLoCo at equal compute (same inner steps and rounds), churn 10%/h",
        "",
        md_table(["peers", "algorithm", "final loss", "spread (mean ‖φ_i − φ̄‖²)",
                  "wait per round s", "virtual s for the rounds", "rounds averaged", "wall s"],
                 [[f"{r['n']:,}", r["algo"], f"{r['loss']:.3f}", f"{r['spread']:.3f}",
                   f"{r['sync_s']:.1f}", f"{r['virtual_s']:,.0f}", f"{r['averaged']:.1%}",
                   f"{r['wall_s']:.1f}"] for r in res["algos"]]),
        "",
        "### SybilWall against one attacker behind many identities",
        "",
        md_table(["peers", "sybils", "aggregator", "attack success", "weight on sybils",
                  "wall s"],
                 [[f"{r['peers']:,}", f"{r['sybils']:,}", r["aggregator"],
                   f"{r['success']:.3f}", f"{r['sybil_weight']:.3f}", f"{r['seconds']:.1f}"]
                  for r in res["sybil"]]),
        "",
        "Attack success: the share of the way from the honest optimum to the attacker's "
        "target that the honest peers' mean model moved; weight on sybils: the mean share "
        "of the weight an honest peer with a sybil neighbour gave sybils (real "
        "`make_aggregator` classes, testnet/sim/experiments.py).",
        "",
        "### Checkpoint download when 10% of the swarm joins at once",
        "",
        md_table(["peers", "joiners", "provider policy", "busiest holder serves GB",
                  "pulls at once", "half done s", "99% done s"],
                 [[f"{r['n']:,}", f"{r['joiners']:,}", r["policy"], f"{r['busiest_gb']:.1f}",
                   str(r["busiest_pulls"]), f"{r['t50_s']:,.0f}", f"{r['t99_s']:,.0f}"]
                  for r in res["burst"]]),
        "",
    ]
    over = [r["n"] for r in sc
            if sum(v for k, v in r["msgs"].items() if k != "averaging") > INBOUND_BUDGET]
    lines.append(
        f"- Budget: {INBOUND_BUDGET:.0f} inbound messages per node and second (about 1.8 ms of "
        "CPU each in py-libp2p, p2p/gossipsub.py's measurement: ~18% of one core). Today's "
        "membership exceeds it from " + (f"{over[0]:,} peers" if over else "no size measured")
        + f"; at {sc[-1]['n']:,} peers a node would take "
        f"{sum(sc[-1]['msgs'].values()):,.0f}/s.")
    big = res["big"]
    head = next((r for r in sc if r["n"] == 10000), None)
    lines.append(
        f"- Scale: {big['n']:,} peers x {big['rounds']} rounds ran in {big['wall_s']:.1f} s wall, "
        f"{big['cpu_s']:.1f} s CPU ({big['virtual_s']:,.0f} s virtual)" + (
            f"; 10,000 peers x {res['rounds']} rounds in {head['wall_s']:.1f} s wall, "
            f"{head['cpu_s']:.1f} s CPU." if head else "."))
    if has_plot:
        lines += ["", "![sim](sim.png)"]
    return "\n".join(lines)


def main(quick: bool = False, scenario: Path | None = None, doc: Path | None = None,
         raw: Path | None = None) -> str:
    """Run the curves (or, with `raw`, write up again what a run saved) into `doc`."""
    from rich.console import Console

    console = Console()
    path = scenario or DEFAULT_SCENARIO
    if raw is not None:
        res = json.loads(raw.read_text())
    else:
        base = load(path)
        t0 = time.perf_counter()
        res = run(base, quick, log=lambda msg: console.print(msg))
        res["total_s"], res["machine"] = time.perf_counter() - t0, machine()
        raw = Path(tempfile.gettempdir()) / "peertrain-bench-sim.json"
        raw.write_text(json.dumps(res, default=float))
    started, total = res["machine"], res["total_s"]
    doc_path = doc or DOC
    has_plot = plot(res, doc_path.parent / "sim.png")
    try:
        shown = str(path.resolve().relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        shown = str(path)
    text = report(res, has_plot, started, total, f"`{shown}`")
    sc = res["scaling"]
    print_tables(console, [("sim: traffic", ["peers", "msgs/s in", "Mbit/s in"],
                            [[f"{r['n']:,}", _f(sum(r["msgs"].values())),
                              _f(sum(r["bytes"].values()) * 8 / 1e6, 2)] for r in sc])])
    write_section("sim", text, doc_path)
    return text
