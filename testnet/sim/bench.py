"""`node bench sim`: the swarm simulator's curves from 10 to 10,000 peers, into
docs/benchmarks.md (section `sim`) and docs/sim.png.

Every run is one process, one thread (Swarm.run sets torch to one thread), seeded: the
same command on the same code gives the same numbers; only the wall times change.
"""

from __future__ import annotations

import json
import math
import os
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
    log(f"N={sc.peers} {sc.training.algorithm} ({sc.membership.policy}) churn "
        f"{sc.churn.per_hour:g}/h x "
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
            "unique_hb": (n - 1) / r.heartbeat_interval_s,
            "unique_ann": (n - 1) / r.announce_interval_s,
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
            d = document_under_churn(n, 0.1, hours, Swarm(pol).per_peer,
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
    fig, axes = plt.subplots(3, 3, figsize=(15, 12.5))
    allsc = res["scaling"]
    sc = [r for r in allsc if r.get("policy", "before") == "before"]
    nd = [r for r in allsc if r.get("policy") == "node"]
    ns = [r["n"] for r in sc]
    ax = axes[0][0]
    for rows, style, label in ((sc, "--", "before"), (nd, "-", "node")):
        if not rows:
            continue
        for kind, color in (("heartbeats", "C0"), ("rundoc gossip", "C1"), ("ihave", "C2")):
            ax.plot([r["n"] for r in rows], [r["msgs"][kind] for r in rows], "o" + style,
                    color=color, ms=3, lw=0.9, label=f"{label}: {kind}")
        ax.plot([r["n"] for r in rows], [sum(r["msgs"].values()) for r in rows], style,
                color="k", label=f"{label}: total")
    ax.axhline(INBOUND_BUDGET, color="r", lw=0.8, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="peers", ylabel="inbound messages / node / s",
           title=f"before vs node policies (red: {INBOUND_BUDGET:.0f}/s, the budget)")
    ax.legend(fontsize=6)
    ax = axes[0][1]
    for rows, style, label in ((sc, "o--", "before"), (nd, "s-", "node")):
        if rows:
            ax.plot([r["n"] for r in rows],
                    [sum(v for k, v in r["bytes"].items() if k != "averaging") / 1e6 * 8
                     for r in rows], style, label=f"{label}: all but averaging")
            ax.plot([r["n"] for r in rows], [r["bytes"]["ihave"] / 1e6 * 8 for r in rows],
                    style, alpha=0.5, label=f"{label}: IHAVE")
    ax.set(xscale="log", yscale="log", xlabel="peers", ylabel="inbound Mbit/s per node",
           title="bytes (weight exchanges left out: the same for both)")
    ax.legend(fontsize=7)
    ax = axes[0][2]
    sp = nd or sc  # joining and spread under the node's policies
    ns = [r["n"] for r in sp]
    ax.plot(ns, [r["write_t99"] for r in sp], "o-", label="write -> 99% (gossip)")
    ax.plot(ns, [r["ae_t99"] for r in sp], "s-", label="write -> 99% (anti-entropy only)")
    ax.plot(ns, [r["ready_p50"] for r in sp], "^-", label="joiner ready (median)")
    ax.plot(ns, [r["avg_p50"] for r in sp], "v-", label="joiner first averaged (median)")
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
    ax = axes[2][0]
    for label, style in (("before", "o--"), ("node", "s-")):
        rows = [r for r in res.get("doc", []) if r["policy"] == label]
        if rows:
            ax.plot([r["n"] for r in rows], [r["peak"] for r in rows], style,
                    label=f"{label}: most entries in {rows[0]['hours']:g} h")
    if res.get("doc"):
        ax.axhline(res["doc"][0]["cap"], color="r", lw=0.8, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="peers", ylabel="run-document entries",
           title="document under churn 10%/h (red: max_entries)")
    ax.legend(fontsize=7)
    ax = axes[2][1]
    for policy, style in (("newest", "o--"), ("any-recent", "^:"), ("holders", "s-")):
        rows = [r for r in res["burst"] if r["policy"] == policy]
        if rows:
            ax.plot([r["n"] for r in rows], [r["busiest_gb"] for r in rows], style,
                    label=f"{policy}: busiest holder GB")
            ax.plot([r["n"] for r in rows], [r["t99_s"] for r in rows], style, alpha=0.4,
                    label=f"{policy}: 99% done s")
    ax.set(xscale="log", yscale="log", xlabel="peers", title="10% of the swarm joins at once")
    ax.legend(fontsize=7)
    ax = axes[2][2]
    if nd:
        ax.plot([r["n"] for r in nd], [r["hb_s"] for r in nd], "o-", label="heartbeat interval s")
        ax.plot([r["n"] for r in nd], [r["ann_s"] for r in nd], "s-", label="announce interval s")
        ax.plot([r["n"] for r in nd], [r["unique_hb"] for r in nd], "^--",
                label="unique heartbeats in /s")
        ax.plot([r["n"] for r in nd], [r["unique_ann"] for r in nd], "v--",
                label="unique announces in /s")
    ax.set(xscale="log", yscale="log", xlabel="peers", title="the node's intervals")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _breakpoints(res: dict) -> list[str]:
    """Which breakpoints the node's policies moved and which remain, from the numbers."""
    sc = res["scaling"]
    bef = {r["n"]: r for r in sc if _pol(r) == "before"}
    nod = {r["n"]: r for r in sc if _pol(r) == "node"}
    if not nod:
        return []
    top = max(nod)
    b, n = bef[top], nod[top]

    def gossip(r: dict) -> float:
        return sum(v for k, v in r["msgs"].items() if k != "averaging")

    out = [
        f"- Moved: membership. `before` grows as ~7.5 N ({gossip(b):,.0f} messages/s at "
        f"{top:,} peers); `node` stays at {gossip(n):,.0f}/s from 100 peers on, whatever N: "
        f"{n['unique_hb']:.0f} heartbeats and {n['unique_ann']:.0f} announces a second "
        f"after de-duplication, ~{n['copies']:.0f} copies each on the wire. Bounded, but "
        f"over the {INBOUND_BUDGET:.0f}/s budget if a duplicate costs as much as a first "
        "receipt (unmeasured: py-libp2p drops a seen id before validating it).",
        f"- Moved: IHAVE. Its ids are those of the last 3 s, now at most 3 x "
        f"{n['unique_hb'] + n['unique_ann']:.0f}: {n['bytes']['ihave'] * 8 / 1e6:.2f} Mbit/s "
        f"at any N (`before`: {b['bytes']['ihave'] * 8 / 1e6:.1f} Mbit/s at {top:,}); no "
        "cap needed while the rates are bounded.",
    ]
    burst = {(r["n"], r["policy"]): r for r in res["burst"]}
    bn = max(r["n"] for r in res["burst"])
    if (bn, "holders") in burst:
        h, w = burst[(bn, "holders")], burst[(bn, "newest")]
        out.append(
            f"- Moved: checkpoint provision. When 10% of {bn:,} peers join at once the busiest "
            f"holder serves {h['busiest_gb']:.1f} GB (the writer alone: {w['busiest_gb']:.0f} "
            f"GB), at most {h['busiest_pulls']} pulls at once, 99% done in "
            f"{h['t99_s']:,.0f} s (was {w['t99_s']:,.0f} s).")
    docs = {(r["n"], r["policy"]): r for r in res.get("doc", [])}
    dn = max((r["n"] for r in res.get("doc", [])), default=0)
    if (dn, "node") in docs:
        d, e = docs[(dn, "node")], docs[(dn, "before")]
        verdict = ("above" if d["peak"] > d["cap"] else "under")
        out.append(
            f"- Moved: the run document. Compaction bounds it (before: every peer ever "
            f"seen, {e['entries']:,} entries after {e['hours']:g} h at {dn:,} peers, growing "
            f"without end), and a peer now keeps 2 entries (`info`, `last_seen`; 3 with a "
            f"checkpoint, was 6): it holds the live peers and those gone within the horizon "
            f"({d['horizon_s']:,.0f} s at {dn:,} peers: never under 10 announce intervals), "
            f"{d['peak']:,} at most with 10%/h churn, {verdict} the {d['cap']:,} cap "
            "(about 3 N (1 + N / 36,000) entries, the horizon being N s: the cap is reached near "
            "15,000 peers; was 9,000).")
    out.append(
        f"- Moved: DHT provider records. Every peer re-provided the run key every 30 s, so "
        f"the 20 peers closest to it each took (N - 1) / 30 ADD_PROVIDER a second "
        f"({b['msgs_max']['dht']:,.0f}/s at {top:,} peers, the `busiest` column); now a "
        "rendezvous sample of 20 members per epoch re-provides (node/run/providers.py) and "
        f"each joiner provides once: {n['msgs_max']['dht']:.1f}/s at the busiest.")
    if "partner dials" in n["msgs"]:
        out.append(
            f"- New cost: partners come from the whole live view while a node keeps "
            f"~{n['conns']:.0f} connections, so nearly every partner is dialed on demand "
            f"({n['msgs']['partner dials']:.2f} handshake messages/s per node at {top:,}; "
            "4 round trips added to the round's exchange).")
    ae = n["bytes"]["anti-entropy"] * 8 / 1e6
    out.append(
        f"- Remains, smaller: anti-entropy grows with the document ({ae:.2f} Mbit/s at "
        f"{top:,}), bounded by the 1 MiB delta (1.7 Mbit/s).")
    return out


def _pol(r: dict) -> str:
    return r.get("policy", "before")


def report(res: dict, has_plot: bool, started: str, total_s: float, scenario: str) -> str:
    sc = res["scaling"]
    kinds = list(sc[0]["msgs"])
    nd = [r for r in sc if _pol(r) == "node"]
    lines = [
        "## Swarm simulator: where the design breaks as the swarm grows",
        "",
        f"`node bench sim` on {started}; {total_s:.0f} s in all, one thread, on a machine "
        "shared with other engineers' jobs ("
        + (f"load average {res['load'][0]:.0f} at the start, {res['load'][1]:.0f} at the end"
           if res.get("load") else "load average 10-25")
        + " on 2 cores: wall times are pessimistic; CPU s is the figure to compare). "
        f"Scenario {scenario} (docs/simulator.md: what is real, what is modelled) as "
        "`before` (fixed heartbeat and announce rates, no compaction, the writer serves "
        "every checkpoint) and, with testnet/sim/scenarios/node.toml, `node` (the node's "
        "issue-30 policies, run through its own functions: `heartbeat_interval_s`, "
        "`RunDocSync.announce_interval_s` and `horizon_ms`, `compactable`, "
        "`plan_connections`, `choose_holders` and `UploadSlots`); churn 10%/h unless a "
        "table says otherwise; a 100 MB model and checkpoint."
        + (f" The churn, NoLoCo/DiLoCo, sybil and 100,000-peer results are those of the "
           f"run of {res['reused']} (`--reuse`: they do not depend on these policies)."
           if res.get("reused") else ""),
        "",
        "### Inbound messages per node and second (mean peer; `max`: the busiest)",
        "",
        md_table(["peers", "policy", *kinds, "total", "busiest", "Mbit/s in", "wall s",
                  "CPU s", "virtual s"],
                 [[f"{r['n']:,}", _pol(r), *(_f(r["msgs"][k]) for k in kinds),
                   _f(sum(r["msgs"].values())), _f(sum(r["msgs_max"].values())),
                   _f(sum(r["bytes"].values()) * 8 / 1e6, 2), f"{r['wall_s']:.1f}",
                   f"{r['cpu_s']:.1f}", f"{r['virtual_s']:,.0f}"] for r in sc]),
        "",
        "### Inbound Mbit/s per node, by kind",
        "",
        md_table(["peers", "policy", *kinds, "total"],
                 [[f"{r['n']:,}", _pol(r), *(_f(r["bytes"][k] * 8 / 1e6, 3) for k in kinds),
                   _f(sum(r["bytes"].values()) * 8 / 1e6, 2)] for r in sc]),
        "",
    ]
    if nd:
        lines += [
            "### The node's intervals and connections (policy `node`)",
            "",
            "Unique messages: what each node takes after gossipsub's de-duplication (the "
            "targets: 50 heartbeats/s, 10 announces/s); the tables above count every copy "
            "on the wire (about 5 per message: D = 6 mesh links minus the sender).",
            "",
            md_table(["peers", "heartbeat interval s", "unique heartbeats in /s",
                      "announce interval s", "unique announces in /s", "compaction horizon s",
                      "connections (plan_connections)"],
                     [[f"{r['n']:,}", _f(r["hb_s"], 2), _f(r["unique_hb"]), _f(r["ann_s"], 2),
                       _f(r["unique_ann"]), f"{r['horizon_s']:,.0f}", _f(r["conns"])]
                      for r in nd]),
            "",
        ]
    lines += [
        "### Spread, joining, run-document size",
        "",
        md_table(["peers", "policy", "copies per gossip msg", "write -> 99% (gossip) s",
                  "write -> 99% (anti-entropy) s", "joiners", "join -> ready s (p50)",
                  "join -> first averaged s (p50 / p95)", "document entries"],
                 [[f"{r['n']:,}", _pol(r), f"{r['copies']:.2f}", f"{r['write_t99']:.2f}",
                   f"{r['ae_t99']:.0f}", str(r["joins"]), _f(r["ready_p50"]),
                   f"{_f(r['avg_p50'])} / {_f(r['avg_p95'])}", f"{r['entries']:,}"]
                  for r in sc]),
        "",
    ]
    if res.get("doc"):
        d0 = res["doc"][0]
        lines += [
            f"### Run-document entries over {d0['hours']:g} h of churn 10%/h",
            "",
            "Membership only (testnet/sim/document.py: joins, leaves, `compactable` every "
            "eighth of the horizon); `max_entries` is the document's cap, past which new "
            "keys (joiners) are refused.",
            "",
            md_table(["peers", "policy", "horizon s", "joins", "entries at the end",
                      "most entries", "max_entries"],
                     [[f"{r['n']:,}", r["policy"],
                       f"{r['horizon_s']:,.0f}" if r["horizon_s"] else "none",
                       f"{r['joins']:,}", f"{r['entries']:,}", f"{r['peak']:,}",
                       f"{r['cap']:,}"] for r in res["doc"]]),
            "",
        ]
    if res.get("real"):
        rl = res["real"]
        rows = rl["rows"]
        mean_in = sum(r["inbound_per_s"] for r in rows) / max(1, len(rows))
        lines += [
            "### Real processes against the simulator (a loopback testnet)",
            "",
            f"`node testnet up -n {rl['n']} --no-train`"
            + (f" with `--heartbeat-target {rl['target']:g}`"
               if rl.get("target", 50) != 50 else "")
            + ", every node's `node status --json` "
            f"read twice {rl['window_s']:.0f} s apart (testnet/sim/realcheck.py), load "
            f"average {rl['load'][0]:.0f} on {rl['cpus']} cores (other engineers' jobs and "
            "the testnet's own processes). Document entries: a `--no-train` node keeps no "
            "checkpoint entry, the simulator's peers one each; nodes before issue 30's "
            "2-entry announce kept 5 a node, since then 2.",
            "",
            md_table(["", "heartbeat interval s", "heartbeats in /s per node (unique)",
                      "heartbeats sent /s per node", "announce interval s",
                      "document entries"],
                     [["testnet (min-max over nodes)",
                       f"{min(r['interval_s'] for r in rows):g}-"
                       f"{max(r['interval_s'] for r in rows):g}",
                       f"{mean_in:.1f} (mean; {min(r['inbound_per_s'] for r in rows):.1f}-"
                       f"{max(r['inbound_per_s'] for r in rows):.1f})",
                       f"{sum(r['sent_per_s'] for r in rows) / max(1, len(rows)):.2f}",
                       f"{min(r['announce_s'] for r in rows):g}-"
                       f"{max(r['announce_s'] for r in rows):g}",
                       f"{min(r['entries'] for r in rows)}-{max(r['entries'] for r in rows)}"],
                      ["simulator (node.toml, same N)", _f(rl["sim"]["interval_s"], 2),
                       f"{rl['sim']['inbound_per_s']:.1f} "
                       f"({rl['sim']['inbound_at_measured_send_rate']:.1f} at the measured "
                       "send rate)", f"{1 / rl['sim']['interval_s']:.2f}",
                       _f(rl["sim"]["announce_s"], 2), f"{rl['sim']['entries']}"]]),
            "",
        ]
    lines += [
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
    for label in ("before", "node"):
        rows = [r for r in sc if _pol(r) == label]
        if not rows:
            continue
        over = [r["n"] for r in rows
                if sum(v for k, v in r["msgs"].items() if k != "averaging") > INBOUND_BUDGET]
        gossip_in = sum(v for k, v in rows[-1]["msgs"].items() if k != "averaging")
        mbit = sum(v for k, v in rows[-1]["bytes"].items() if k != "averaging") * 8 / 1e6
        lines.append(
            f"- Budget, `{label}`: {INBOUND_BUDGET:.0f} inbound messages per node and second "
            "(about 1.8 ms of CPU each in py-libp2p, p2p/gossipsub.py's measurement: ~18% of "
            "one core) is exceeded from "
            + (f"{over[0]:,} peers" if over else "no size measured")
            + f"; at {rows[-1]['n']:,} peers a node takes {gossip_in:,.0f} gossip messages/s "
            f"({mbit:.2f} Mbit/s without the weight exchanges).")
    lines += _breakpoints(res)
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
         raw: Path | None = None, reuse: Path | None = None,
         real: Path | None = None) -> str:
    """Run the curves (or, with `raw`, write up again what a run saved) into `doc`.
    `reuse`: an earlier run's raw JSON whose policy-independent results (REUSABLE) are
    taken instead of run again; `real`: testnet/sim/realcheck.py's JSON, reported beside
    the simulator's prediction."""
    from rich.console import Console

    console = Console()
    path = scenario or DEFAULT_SCENARIO
    if raw is not None:
        res = json.loads(raw.read_text())
    else:
        base = load(path)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        res = run(base, quick, log=lambda msg: console.print(msg),
                  reuse=json.loads(reuse.read_text()) if reuse is not None else None)
        res["total_s"], res["machine"] = time.perf_counter() - t0, machine()
        res["load"] = [load0, os.getloadavg()[0]]
        raw = Path(tempfile.gettempdir()) / "peertrain-bench-sim.json"
        raw.write_text(json.dumps(res, default=float))
    if real is not None:
        from protocols.heartbeat import TARGET_INBOUND_PER_S
        from testnet.sim.realcheck import predict

        rl = res["real"] = json.loads(real.read_text())
        sent = sum(r["sent_per_s"] for r in rl["rows"]) / max(1, len(rl["rows"]))
        # this code's prediction, not the file's
        rl["sim"] = predict(rl["n"], sent, rl.get("target", TARGET_INBOUND_PER_S))
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
