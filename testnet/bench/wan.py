"""NoLoCo and DiLoCo across a WAN: utilization, bytes per outer step and time to a
validation loss, each run for real in the same emulated internet.

    node bench wan [--quick] [--rate 100mbit] [--rtt 50]      (root: network namespaces)
    node bench wan --gpu [--step-ms 27.2] [--compressed CODEC] [--seconds 150]

Four public nodes and a bootstrap, each in its own network namespace; every WAN link is
shaped to `--rate` both ways (tc tbf) and crosses the userspace delay line that adds
`--rtt` (testnet/delay.py, docs/nat.md). The run is a byte-level GPT of 6.4M parameters
(12.8 MB in bf16), so one exchange takes seconds at 100 Mbit/s. The same testnet is built
twice, once per algorithm:

- NoLoCo: each outer step one pairwise swap, overlapped with the next round's inner steps;
- DiLoCo (`outer.algorithm = "diloco"`, Nesterov, outer lr 0.7, momentum 0.9 as
  OpenDiLoCo): each outer step an all-reduce of the 4 nodes' weights by recursive doubling,
  2 pairwise swaps one after the other (node/ml/optim/allreduce.py), while every trainer waits.

Every node's status is read every SAMPLE_S: steps, compute share, rounds averaged and
local, bytes sent, the validation loss, each exchange's seconds, the time DiLoCo's
trainers waited, and each partner's wire rate.

`--gpu` (issue 29): the same emulated internet at GPU speed. The 86M-parameter model
(d_model 768, 12 layers, 12 heads, context 1024, batch 16) with every trainer taking an
H100's measured step time, stood in by node/training/timed.py (it sleeps the step time and
moves a real-size vector by measured drift and noise), so utilization, rounds averaged and
bytes per outer step are real, convergence is not (`node bench convergence`). Side by side:
NoLoCo and DiLoCo, each in bf16 and in a compressed codec (`--compressed`; its rows say
"pending compressed codec" until protocols/codecs.py and the manifest know one).
"""

from __future__ import annotations

import os
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
{outer}
[checkpoint]
every_steps = 1000000       # no checkpoints: they would only add disk noise
"""
FULL = {"d_model": 256, "n_layers": 8, "inner_steps": 50, "seconds": 300}
QUICK = {"d_model": 128, "n_layers": 4, "inner_steps": 50, "seconds": 120}


ALGORITHMS = {  # the [outer] lines of each run
    "noloco": "",
    "diloco": 'algorithm = "diloco"\nmomentum = 0.9\nnesterov = true\n',
}


class BenchUnavailable(Exception):
    """This benchmark cannot run on this machine; the message says why."""


@dataclass
class NodeRun:
    """What one node reported over the run."""

    name: str
    algorithm: str = "noloco"
    losses: list[tuple[float, float]] = field(default_factory=list)  # (seconds, val loss)
    last: dict[str, Any] = field(default_factory=dict)  # its last status
    exchange_s: list[float] = field(default_factory=list)  # mean seconds per exchange
    codec: str = "bf16"
    peak_rss_mb: float | None = None
    # rounds closed locally before the first averaged one (a span still being learnt)
    local_before_first: int | None = None

    def first_below(self, target: float) -> float | None:
        return next((t for t, loss in self.losses if loss <= target), None)


def target_loss(runs: list[NodeRun]) -> float | None:
    """The loss every node reached: the highest of the nodes' best validation losses."""
    best = [min(loss for _, loss in r.losses) for r in runs if r.losses]
    return max(best) if best and len(best) == len(runs) else None


def _sample(net: launcher.Testnet, runs: dict[str, NodeRun], algorithm: str,
            t0: float) -> None:
    for p in net.procs:
        if p.name == "bootstrap":
            continue
        st = ask(p)
        t = st.get("training") or {}
        if not t:
            continue
        run = runs.setdefault(p.name, NodeRun(p.name, algorithm))
        run.last = st
        if run.local_before_first is None and t.get("rounds_averaged"):
            run.local_before_first = t.get("rounds_local", 0)
        loss = t.get("val_loss")
        if isinstance(loss, float) and (not run.losses or run.losses[-1][1] != loss):
            run.losses.append((time.monotonic() - t0, loss))


def _exchange_seconds(st: dict[str, Any]) -> float | None:
    ex = (st.get("averaging") or {}).get("exchange_seconds") or {}
    return ex["sum"] / ex["count"] if ex.get("count") else None


def run_algorithm(algorithm: str, sizes: dict[str, int], rate: str, rtt_ms: float,
                  work: Path, console: Any, manifest_text: str | None = None,
                  label: str | None = None, loads: list[float] | None = None) -> list[NodeRun]:
    """One testnet of 4 nodes behind shaped links, training `algorithm` for the run's
    seconds; what each node reported. `loads` collects the 1-minute load average at each
    sample; each node's peak RSS is read before the testnet goes down."""
    label = label or algorithm
    manifest = work / f"wan-{label}.toml"
    manifest.write_text(manifest_text or MANIFEST.format(**sizes, outer=ALGORITHMS[algorithm]))
    directory = work / f"tn-{label}"
    runs: dict[str, NodeRun] = {}
    with console.status(f"{label}: starting 4 nodes behind {rate} links with "
                        f"{rtt_ms:g} ms RTT"):
        net = launcher.up(directory, 4, manifest=manifest, detached=True, netns=True,
                          rate=rate, rtt_ms=rtt_ms, timeout=240)
    try:
        t0 = time.monotonic()
        with console.status(f"{label}: training for {sizes['seconds']} s") as status:
            while (elapsed := time.monotonic() - t0) < sizes["seconds"]:
                _sample(net, runs, algorithm, t0)
                if loads is not None:
                    loads.append(os.getloadavg()[0])
                status.update(f"{label}: training, {elapsed:.0f} of {sizes['seconds']} s")
                time.sleep(SAMPLE_S)  # the sampling period, not a synchronization
            _sample(net, runs, algorithm, t0)
            for p in net.procs:
                if p.name in runs:
                    runs[p.name].peak_rss_mb = _peak_rss_mb(p.pid)
    finally:
        launcher.down(directory)
    return sorted(runs.values(), key=lambda r: r.name)


def _peak_rss_mb(pid: int) -> float | None:
    """A process's peak resident memory (VmHWM), None if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def main(quick: bool = False, rate: str = "100mbit", rtt_ms: float = 50.0,
         doc: Path | None = None) -> str:
    from rich.console import Console

    reason = netns.available()
    if reason is not None:
        raise BenchUnavailable(f"node bench wan runs nodes in network namespaces: {reason}")
    console = Console()
    sizes = QUICK if quick else FULL
    runs: list[NodeRun] = []
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in ALGORITHMS:
            runs += run_algorithm(algorithm, sizes, rate, rtt_ms, Path(tmp), console)
    has_plot = plot(runs, (doc or DOC).parent / "wan.png", rate, rtt_ms)
    text = report(runs, sizes, rate, rtt_ms, quick)
    text += "\n![wan](wan.png)\n" if has_plot else \
        "\n(No plot: matplotlib is not installed; `pip install -e '.[bench]'`.)\n"
    console.print(text)
    write_section("wan", text, doc) if doc else write_section("wan", text)
    return text


def plot(runs: list[NodeRun], path: Path, rate: str, rtt_ms: float) -> bool:
    """Each node's validation loss over time, NoLoCo solid and DiLoCo dashed, the target
    marked; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors: dict[str, Any] = {}
    for r in runs:
        color = colors.setdefault(r.name, f"C{len(colors)}")
        ax.plot([t for t, _ in r.losses], [loss for _, loss in r.losses], lw=1, color=color,
                ls="-" if r.algorithm == "noloco" else "--", label=f"{r.algorithm} {r.name}")
    target = target_loss(runs)
    if target is not None:
        ax.axhline(target, color="0.5", ls=":", lw=1, label=f"target {target:.3f}")
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"NoLoCo (solid) and DiLoCo (dashed), 4 nodes, every link {rate} with "
                 f"{rtt_ms:g} ms RTT")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def report(runs: list[NodeRun], sizes: dict[str, int], rate: str, rtt_ms: float,
           quick: bool) -> str:
    h = sizes["inner_steps"]
    target = target_loss(runs)
    rows = []
    for r in runs:
        t = r.last.get("training") or {}
        rounds = t.get("rounds_averaged", 0)
        outer_steps = rounds + t.get("rounds_local", 0)
        x = _exchange_seconds(r.last)
        partners = (r.last.get("averaging") or {}).get("partners") or {}
        wire = [p["wire_mb_per_s"] for p in partners.values() if p.get("wire_mb_per_s")]
        reached = r.first_below(target) if target is not None else None
        waited = t.get("sync_wait_s", 0.0) / outer_steps if outer_steps else 0.0
        rows.append([r.algorithm, r.name, str(t.get("step", 0)),
                     f"{t.get('compute_fraction', 0):.1%}", str(rounds),
                     str(t.get("rounds_local", 0)),
                     f"{t.get('bytes_sent', 0) / max(1, rounds) / 1e6:.1f}",
                     "-" if x is None else f"{x:.2f}", f"{waited:.2f}",
                     "-" if not wire else f"{statistics.median(wire):.1f}",
                     "-" if t.get("val_loss") is None else f"{t['val_loss']:.3f}",
                     "-" if reached is None else f"{reached:.0f}"])
    headers = ["algorithm", "node", "steps", "compute share", "rounds averaged",
               "rounds local", "MB sent per averaged round", "s per exchange",
               "s waited per outer step", "wire MB/s", "val loss",
               f"s to val loss {target:.3f}" if target is not None else "s to target"]
    return (
        f"## WAN: NoLoCo and DiLoCo at {rate}, {rtt_ms:g} ms RTT\n\n"
        f"`node bench wan{' --quick' if quick else ''}` on {machine()}: 4 public nodes and a "
        f"bootstrap in network namespaces, every WAN link {rate} both ways (tc tbf) through "
        f"a delay line adding {rtt_ms:g} ms RTT; a byte-level GPT (d_model {sizes['d_model']}"
        f", {sizes['n_layers']} layers, context 64, batch 4), an outer step every {h} steps, "
        f"bf16 on the wire; {sizes.get('seconds')} s of training per algorithm, all 4 "
        f"trainers on this machine's cores. NoLoCo swaps with one partner per outer step "
        f"while the next round computes; DiLoCo all-reduces the 4 nodes' weights (2 swaps "
        f"one after the other, recursive doubling) while its trainers wait (`s waited per "
        f"outer step`); its `MB sent` per round counts both swaps.\n\n"
        f"{md_table(headers, rows)}\n\n"
        f"Goal (issue 14): >= 95% of wall time computing with NoLoCo.\n"
    )
