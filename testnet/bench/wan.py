"""NoLoCo across a WAN: utilization, bytes per outer step and time to a validation loss,
beside what DiLoCo's blocking all-reduce would cost on the same links.

    node bench wan [--quick] [--rate 100mbit] [--rtt 50]      (root: network namespaces)

Four public nodes and a bootstrap, each in its own network namespace; every WAN link is
shaped to `--rate` both ways (tc tbf) and crosses the userspace delay line that adds
`--rtt` (testnet/delay.py, docs/nat.md). The run is a byte-level GPT of 6.4M parameters
(12.8 MB in bf16), so one exchange takes seconds at 100 Mbit/s. Every node's status is
read every SAMPLE_S: steps, compute share, rounds averaged and local, bytes sent, the
validation loss, each exchange's seconds and each partner's wire rate.

DiLoCo is not run in the swarm (docs/training.md: a group all-reduce over strangers is
what NoLoCo removes), so its column is computed from what this run measured, and says so:
an all-reduce of 4 nodes by recursive doubling is 2 pairwise exchanges one after the
other, of the same size over the same links, and DiLoCo's trainers wait for it every outer
step. Its loss per step is taken to equal NoLoCo's (the in-process convergence benchmark,
`node bench convergence`, measures the difference per step; docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testnet import launcher, netns
from testnet.bench.report import DOC, machine, md_table, pyplot, write_section
from testnet.observe import ask

SAMPLE_S = 5.0

MANIFEST = """\
# written by testnet/bench/wan.py
schema = 1

[run]
name = "bench-wan"
description = "WAN benchmark: a GPT whose exchange takes seconds at 100 Mbit/s."

[model]
d_model = {d_model}
n_layers = {n_layers}
n_heads = 4
context = 64

[train]
batch_size = 4
eval_every = 50
eval_batches = 2

[outer]
inner_steps = {inner_steps}
codec = "bf16"

[checkpoint]
every_steps = 1000000       # no checkpoints: they would only add disk noise
"""
FULL = {"d_model": 256, "n_layers": 8, "inner_steps": 50, "seconds": 300}
QUICK = {"d_model": 128, "n_layers": 4, "inner_steps": 50, "seconds": 120}


class BenchUnavailable(Exception):
    """This benchmark cannot run on this machine; the message says why."""


@dataclass
class NodeRun:
    """What one node reported over the run."""

    name: str
    losses: list[tuple[float, float]] = field(default_factory=list)  # (seconds, val loss)
    last: dict[str, Any] = field(default_factory=dict)  # its last status
    exchange_s: list[float] = field(default_factory=list)  # mean seconds per exchange

    def first_below(self, target: float) -> float | None:
        return next((t for t, loss in self.losses if loss <= target), None)


def diloco_cost(step_s: float, inner_steps: int, exchange_s: float, nodes: int) -> dict:
    """DiLoCo on the same links: per outer step its trainers wait for an all-reduce of
    log2(nodes) pairwise exchanges (recursive doubling), each taking `exchange_s`.
    Returns the wait per outer step and the share of wall time computing."""
    rounds = max(1, (nodes - 1).bit_length())
    wait = rounds * exchange_s
    compute = inner_steps * step_s
    return {"wait_s": wait, "compute_share": compute / (compute + wait)}


def target_loss(runs: list[NodeRun]) -> float | None:
    """The loss every node reached: the highest of the nodes' best validation losses."""
    best = [min(loss for _, loss in r.losses) for r in runs if r.losses]
    return max(best) if best and len(best) == len(runs) else None


def _sample(net: launcher.Testnet, runs: dict[str, NodeRun], t0: float) -> None:
    for p in net.procs:
        if p.name == "bootstrap":
            continue
        st = ask(p)
        t = st.get("training") or {}
        if not t:
            continue
        run = runs.setdefault(p.name, NodeRun(p.name))
        run.last = st
        loss = t.get("val_loss")
        if isinstance(loss, float) and (not run.losses or run.losses[-1][1] != loss):
            run.losses.append((time.monotonic() - t0, loss))


def _exchange_seconds(st: dict[str, Any]) -> float | None:
    ex = (st.get("averaging") or {}).get("exchange_seconds") or {}
    return ex["sum"] / ex["count"] if ex.get("count") else None


def main(quick: bool = False, rate: str = "100mbit", rtt_ms: float = 50.0,
         doc: Path | None = None) -> str:
    from rich.console import Console

    reason = netns.available()
    if reason is not None:
        raise BenchUnavailable(f"node bench wan runs nodes in network namespaces: {reason}")
    console = Console()
    sizes = QUICK if quick else FULL
    runs: dict[str, NodeRun] = {}
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "wan.toml"
        manifest.write_text(MANIFEST.format(**sizes))
        directory = Path(tmp) / "tn"
        with console.status(f"starting 4 nodes behind {rate} links with {rtt_ms:g} ms RTT"):
            net = launcher.up(directory, 4, manifest=manifest, detached=True, netns=True,
                              rate=rate, rtt_ms=rtt_ms, timeout=240)
        try:
            t0 = time.monotonic()
            with console.status(f"training for {sizes['seconds']} s") as status:
                while (elapsed := time.monotonic() - t0) < sizes["seconds"]:
                    _sample(net, runs, t0)
                    status.update(f"training: {elapsed:.0f} of {sizes['seconds']} s")
                    time.sleep(SAMPLE_S)  # the sampling period, not a synchronization
                _sample(net, runs, t0)
        finally:
            launcher.down(directory)
    ordered = sorted(runs.values(), key=lambda r: r.name)
    has_plot = plot(ordered, (doc or DOC).parent / "wan.png", rate, rtt_ms)
    text = report(ordered, sizes, rate, rtt_ms, quick)
    text += "\n![wan](wan.png)\n" if has_plot else \
        "\n(No plot: matplotlib is not installed; `pip install -e '.[bench]'`.)\n"
    console.print(text)
    write_section("wan", text, doc) if doc else write_section("wan", text)
    return text


def plot(runs: list[NodeRun], path: Path, rate: str, rtt_ms: float) -> bool:
    """Each node's validation loss over time, the target marked; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in runs:
        ax.plot([t for t, _ in r.losses], [loss for _, loss in r.losses], lw=1, label=r.name)
    target = target_loss(runs)
    if target is not None:
        ax.axhline(target, color="0.5", ls=":", lw=1, label=f"target {target:.3f}")
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"NoLoCo, 4 nodes, every link {rate} with {rtt_ms:g} ms RTT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def report(runs: list[NodeRun], sizes: dict[str, int], rate: str, rtt_ms: float,
           quick: bool) -> str:
    h = sizes["inner_steps"]
    target = target_loss(runs)
    rows, diloco_rows = [], []
    for r in runs:
        t = r.last.get("training") or {}
        steps = max(1, t.get("step", 0))
        wall = t.get("wall_s") or 0.0
        step_s = t.get("compute_fraction", 0) * wall / steps if wall else 0.0
        rounds = t.get("rounds_averaged", 0)
        x = _exchange_seconds(r.last)
        partners = (r.last.get("averaging") or {}).get("partners") or {}
        wire = [p["wire_mb_per_s"] for p in partners.values() if p.get("wire_mb_per_s")]
        reached = r.first_below(target) if target is not None else None
        rows.append([r.name, str(t.get("step", 0)), f"{t.get('compute_fraction', 0):.1%}",
                     str(rounds), str(t.get("rounds_local", 0)),
                     f"{t.get('bytes_sent', 0) / max(1, rounds) / 1e6:.1f}",
                     "-" if x is None else f"{x:.2f}",
                     "-" if not wire else f"{statistics.median(wire):.1f}",
                     "-" if t.get("val_loss") is None else f"{t['val_loss']:.3f}",
                     "-" if reached is None else f"{reached:.0f}"])
        swap = 4 * t.get("params", 0) / (statistics.median(wire) * 1e6) if wire else None
        if swap:
            # the link's own time for a bf16 swap (both ways), without the wait at the
            # boundary that NoLoCo's exchanges include: the cost most favourable to DiLoCo
            cost = diloco_cost(step_s, h, swap, len(runs))
            # DiLoCo reaches the target after as many steps, each longer by its wait / H
            per_step = wall / steps
            slower = (per_step + cost["wait_s"] / h) / per_step if per_step else None
            diloco_rows.append([r.name, f"{swap:.2f}", f"{cost['wait_s']:.2f}",
                                f"{cost['compute_share']:.1%}",
                                "-" if reached is None or slower is None
                                else f"{reached * slower:.0f}"])
    headers = ["node", "steps", "compute share", "rounds averaged", "rounds local",
               "MB sent per averaged round", "s per exchange", "wire MB/s", "val loss",
               f"s to val loss {target:.3f}" if target is not None else "s to target"]
    d_headers = ["node", "s per bf16 swap on the link", "all-reduce wait per outer step (s)",
                 "compute share", "s to the same val loss"]
    return (
        f"## WAN: NoLoCo at {rate}, {rtt_ms:g} ms RTT\n\n"
        f"`node bench wan{' --quick' if quick else ''}` on {machine()}: 4 public nodes and a "
        f"bootstrap in network namespaces, every WAN link {rate} both ways (tc tbf) through "
        f"a delay line adding {rtt_ms:g} ms RTT; a byte-level GPT (d_model {sizes['d_model']}"
        f", {sizes['n_layers']} layers, context 64, batch 4), NoLoCo every {h} steps, bf16 "
        f"on the wire; {sizes.get('seconds')} s of training, all 4 trainers on this "
        f"machine's cores.\n\n{md_table(headers, rows)}\n\n"
        f"Goal (issue 14): >= 95% of wall time computing with NoLoCo.\n\n"
        f"**DiLoCo on the same links, computed, not run**: its trainers wait every outer "
        f"step for a 4-node all-reduce, 2 pairwise swaps one after the other (recursive "
        f"doubling), each taking what a bf16 swap takes at the wire rate measured above "
        f"(NoLoCo's `s per exchange` also holds the wait for a partner at the boundary), "
        f"and its loss per step is taken to be NoLoCo's.\n\n{md_table(d_headers, diloco_rows)}\n"
    )
