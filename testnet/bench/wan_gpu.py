"""`node bench wan --gpu`: NoLoCo and DiLoCo across the emulated WAN at an H100's speed.

    node bench wan --gpu [--step-ms 27.2] [--compressed CODEC] [--seconds 150] [--scale 1]

Four nodes and a bootstrap in network namespaces, every link `--rate` (100 Mbit/s) both
ways with `--rtt` (50 ms), as `node bench wan`; the run is the 86M-parameter byte-level GPT
(d_model 768, 12 layers, 12 heads, context 1024, batch 16; 85,956,096 parameters), an
outer step every H = 50 inner steps. Each trainer is the timed stand-in
(node/training/timed.py): it takes `--step-ms` per step (27.2 ms: our Trainer.step() with
compile on at batch 16 on an H100, docs/benchmarks.md `trainer`; 35.8 ms before, issue 29)
and hands out a real-size vector that drifts and jitters by the magnitudes measured on the
real trainer. What the network carries, when, and how much of the wall time the trainer
computes are real; the loss is not measured here (`node bench convergence`).

Cases, side by side: NoLoCo and DiLoCo (synchronous, the baseline), each with bf16 on the
wire and with the compressed codec named by `--compressed` (default: one that
protocols/codecs.py knows beyond the dense ones, if any; `--compressed topk`: the sparse
frames of protocols/sparse.py, outer.codec = "topk"). Until a compressed codec is named
its rows say "pending compressed codec".

Memory and CPU: each node holds a handful of whole-model fp32 vectors (the weights, φ and
the outer momentum, the snapshot and its copy for the exchange, the partner's, the mean):
the run refuses to start if 4 nodes' worth is not available (VECTORS_PER_NODE). Every pass
over them (codec, outer step) is CPU work that a GPU node does on the device. Where the
machine cannot carry that (2 shared cores), `--scale S` divides both the vector and every
link's rate by S: each exchange then takes the same seconds, so the exchange's share of a
round, the spans, the rounds averaged and the compute share are those of the full model,
and the bytes per outer step are reported measured and times S (the 86M model's).
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
from pathlib import Path

from node.process.priority import SESSION_NICE_ENV
from testnet import netns
from testnet.bench import wan
from testnet.bench.report import DOC, machine, md_table, write_section

STEP_MS = 27.2  # Trainer.step() + compile, batch 16, H100, bf16 (bench:trainer-cuda)
SECONDS = 150
PARAMS = 85_956_096  # node.training.timed.model_params of MANIFEST's model
VECTORS_PER_NODE = 9  # peak whole-model fp32 vectors a node holds (docstring), measured
PENDING = "pending compressed codec"
# node/averaging/estimates.py's (testnet/ imports no node service): the averager's prior
# wire rate, a 100 Mbit/s link both ways, and the variable that overrides it
PRIOR_ENV, PRIOR_WIRE_BYTES_PER_S = "PEERTRAIN_PRIOR_WIRE_BYTES_PER_S", 25e6
DENSE = {"fp32", "bf16", "int8", "fp32+zstd", "bf16+zstd"}

MANIFEST = """\
# written by testnet/bench/wan_gpu.py
schema = 1

[run]
name = "bench-wan-gpu"
description = "WAN benchmark at H100 speed: the 86M GPT, a timed stand-in trainer."

[model]
d_model = 768
n_layers = 12
n_heads = 12
context = 1024

[train]
batch_size = 16
eval_every = 1000000

[outer]
inner_steps = 50
codec = "{codec}"
{outer}
[checkpoint]
every_steps = 1000000       # no checkpoints: they would only add disk noise
"""


def compressed_codec(name: str | None) -> tuple[str | None, str | None]:
    """(the compressed codec to run, None) or (None, why its rows are pending)."""
    from protocols import codecs, sparse
    from protocols import manifest as mf

    if name is None:
        extra = [c for c in codecs.CODECS if c not in DENSE]
        if not extra:
            return None, "protocols/codecs.py knows no compressed codec yet"
        name = extra[0]
    if name not in codecs.CODECS and name != sparse.CODEC:
        return None, f"protocols/codecs.py does not know {name!r}"
    try:
        mf.parse_manifest(MANIFEST.format(codec=name, outer=""))
    except mf.ManifestError as e:
        return None, f"the manifest refuses codec {name!r}: {e}"
    return name, None


def memory_needed(params: int = PARAMS, nodes: int = 4) -> int:
    return nodes * VECTORS_PER_NODE * 4 * params


def available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def scaled_rate(rate: str, scale: int) -> str:
    """`rate` (tc's form: "100mbit", "500kbit") divided by `scale`, in kbit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate.strip().lower())
    if m is None:
        raise ValueError(f"--rate {rate!r}: expected a number and kbit, mbit or gbit")
    kbit = float(m[1]) * {"kbit": 1, "mbit": 1e3, "gbit": 1e6}[m[2]] / scale
    if kbit < 8:
        raise ValueError(f"--rate {rate} / --scale {scale} is under 8 kbit")
    return f"{kbit:.0f}kbit"


def main(step_ms: float = STEP_MS, seconds: int = SECONDS, rate: str = "100mbit",
         rtt_ms: float = 50.0, compressed: str | None = None, only: str | None = None,
         scale: int = 1, doc: Path | None = None) -> str:
    """Run every case (or `only`: "noloco-bf16", ...) and write the section."""
    from rich.console import Console

    from node.training import timed

    if scale < 1:
        raise ValueError(f"--scale {scale}: expected 1 or more")
    reason = netns.available()
    if reason is not None:
        raise wan.BenchUnavailable(f"node bench wan --gpu runs nodes in network namespaces: "
                                   f"{reason}")
    params = PARAMS // scale
    link = rate if scale == 1 else scaled_rate(rate, scale)
    need, have = memory_needed(params), available_memory()
    if have is not None and need > 0.8 * have:
        raise wan.BenchUnavailable(
            f"4 nodes of {params:,} parameters need about {need / 2**30:.1f} GiB "
            f"({VECTORS_PER_NODE} fp32 vectors of {4 * params / 1e6:.0f} MB each); "
            f"{have / 2**30:.1f} GiB are available: try --scale")
    codec, pending = compressed_codec(compressed)
    cases = [(a, c) for a in ("noloco", "diloco") for c in ("bf16", codec or PENDING)]
    if only is not None:
        cases = [(a, c) for a, c in cases if f"{a}-{c}" == only or a == only]
        if not cases:
            raise ValueError(f"--only {only}: expected noloco, diloco or ALGORITHM-CODEC")
    console = Console()
    runs: list[wan.NodeRun] = []
    loads: list[float] = []
    sizes = {"seconds": seconds}
    # The launcher's nodes inherit the environment: the stand-in, and their session left at
    # its priority. A training node lowers its session to nice 10 so that the machine's
    # other work goes first (node/priority.py); on 2 cores at load 30 that starved the
    # nodes' whole-model vector work (80% of wall time) and every exchange.
    saved = {k: os.environ.get(k) for k in (timed.ENV, SESSION_NICE_ENV, PRIOR_ENV)}
    os.environ[timed.ENV] = f"{step_ms},{params}"
    os.environ[SESSION_NICE_ENV] = "0"
    # the averager's prior wire rate (a 100 Mbit/s link) scaled with the link
    os.environ[PRIOR_ENV] = str(PRIOR_WIRE_BYTES_PER_S / scale)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for algorithm, c in cases:
                if c == PENDING:
                    runs += [wan.NodeRun(f"node{i}", algorithm, codec=PENDING)
                             for i in range(1, 5)]
                    continue
                text = MANIFEST.format(codec=c, outer=wan.ALGORITHMS[algorithm])
                for r in wan.run_algorithm(algorithm, sizes, link, rtt_ms, Path(tmp), console,
                                           manifest_text=text, label=f"{algorithm}-{c}",
                                           loads=loads):
                    r.codec = c
                    runs.append(r)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    text = report(runs, step_ms, seconds, rate, rtt_ms, loads, pending, scale)
    console.print(text)
    write_section("wan-gpu", text, doc or DOC)
    return text


def row(r: wan.NodeRun, scale: int = 1) -> list[str]:
    """One node's line: what its last status said (MB per outer step times `scale`)."""
    if r.codec == PENDING:
        return [r.algorithm, PENDING, r.name, *["-"] * 11]
    t = r.last.get("training") or {}
    averaged, local = t.get("rounds_averaged", 0), t.get("rounds_local", 0)
    outer = averaged + local
    wall = t.get("wall_s") or 0.0
    steps = t.get("step", 0)
    x = wan._exchange_seconds(r.last)
    partners = (r.last.get("averaging") or {}).get("partners") or {}
    wire = [p["wire_mb_per_s"] for p in partners.values() if p.get("wire_mb_per_s")]
    waited = t.get("sync_wait_s", 0.0) / outer if outer else 0.0
    ms = 1000 * t.get("compute_s", 0.0) / steps if steps else 0.0
    return [r.algorithm, r.codec, r.name, str(steps), f"{ms:.1f}",
            f"{t.get('compute_fraction', 0):.1%}",
            f"{t.get('outer_s', 0.0) / wall:.1%}" if wall else "-",
            f"{averaged} / {local}" + (f" ({local - r.local_before_first} after the first "
                                       f"averaged)" if r.local_before_first is not None
                                       and local else ""),
            str(t.get("span", 1)),
            _mb(t.get("bytes_sent", 0) / max(1, outer), scale),
            "-" if x is None else f"{x:.1f}", f"{waited:.1f}",
            "-" if not wire else f"{statistics.median(wire):.1f}",
            "-" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f}"]


def _mb(nbytes: float, scale: int) -> str:
    return f"{nbytes / 1e6:.1f}" if scale == 1 else \
        f"{nbytes * scale / 1e6:.1f} ({nbytes / 1e6:.2f} measured)"


HEADERS = ["algorithm", "codec", "node", "steps", "ms per step", "compute share",
           "outer-step CPU share", "rounds averaged / local", "span (rounds)",
           "MB sent per outer step", "s per exchange", "s waited per outer step",
           "wire MB/s", "peak RSS MB"]


def report(runs: list[wan.NodeRun], step_ms: float, seconds: int, rate: str, rtt_ms: float,
           loads: list[float], pending: str | None, scale: int = 1) -> str:
    load = (f"load average {min(loads):.1f}-{max(loads):.1f} (median "
            f"{statistics.median(loads):.1f}) during the runs" if loads else "load not sampled")
    text = (
        f"## WAN at GPU speed: NoLoCo and DiLoCo, 86M model, {rate}, {rtt_ms:g} ms RTT\n\n"
        f"`node bench wan --gpu` on {machine()}; {load}. 4 nodes and a bootstrap in network "
        f"namespaces, every link {rate} both ways (tc tbf) through a delay line adding "
        f"{rtt_ms:g} ms RTT. The byte-level GPT of issue 29 (d_model 768, 12 layers, 12 heads, "
        f"context 1024, batch 16; {PARAMS:,} parameters), an outer step every 50 inner steps "
        f"or every `span` x 50 where one exchange needs more (docs/training.md, \"Spans\"). "
        f"Each trainer is the timed stand-in (node/training/timed.py): {step_ms:g} ms a step "
        f"(an H100's, measured for our trainer at batch 16), a real-size vector moving by the "
        f"drift and noise measured on the real trainer. {seconds} s of training per case. "
        f"`compute share`: time in steps over wall time since training began; `outer-step "
        f"CPU share`: the part of the rest spent on whole-model vector work in the trainer "
        f"thread (outer step, snapshots), which a GPU node does on the device in "
        f"milliseconds and this CPU stand-in pays on shared cores; `MB sent per outer step`: "
        f"bytes this node sent over its outer steps (DiLoCo: 2 swaps each); `rounds "
        f"averaged / local`: outer steps with a partner and without one (in brackets, "
        f"those without one after the first with one: the rest fell while the span was "
        f"being learnt from the first exchanges).\n\n"
        + (f"Scaled by {scale} (`--scale {scale}`: this machine could not carry 4 nodes' "
           f"whole-model vector work at full size): vectors of {PARAMS // scale:,} values "
           f"over links of {scaled_rate(rate, scale)}, so each exchange takes the seconds "
           f"the 86M model's takes at {rate}; MB per outer step are given for 86M (measured "
           f"x {scale}).\n\n" if scale != 1 else "")
        + f"{md_table(HEADERS, [row(r, scale) for r in runs])}\n\n"
        f"Goal (issue 29): compressed NoLoCo >= 95% compute and >= 95% rounds averaged.\n")
    if pending is not None:
        text += f"\nCompressed rows: {PENDING} ({pending}).\n"
    return text
