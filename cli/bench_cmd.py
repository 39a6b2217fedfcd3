"""`node bench ...`: the benchmarks behind docs/benchmarks.md, runnable by anyone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Run benchmarks; results go to docs/benchmarks.md.")

Quick = Annotated[bool, typer.Option("--quick", help="Smaller sizes, a rough number fast.")]


@app.command()
def p2p(quick: Quick = False) -> None:
    """One-stream throughput, DHT put/get latency, join to first peer."""
    from testnet.bench import p2p as bench

    bench.main(quick=quick)


@app.command()
def utilization(
    quick: Quick = False,
    nodes: Annotated[int, typer.Option("--nodes", "-n")] = 4,
) -> None:
    """Fraction of wall time each trainer computes in a testnet."""
    from testnet.bench import utilization as bench

    bench.main(quick=quick, nodes=nodes)


@app.command()
def convergence(
    quick: Quick = False,
    pipeline: Annotated[bool, typer.Option(
        "--pipeline", help="2 stages x 4 replicas, random routing on and off, instead.")]
    = False,
    compression: Annotated[bool, typer.Option(
        "--compression", help="bf16 vs topk-compressed NoLoCo and DiLoCo, 8 and 32 replicas, "
        "instead.")] = False,
    workers: Annotated[int, typer.Option(
        "--workers", help="--compression: runs at a time, one process each.")] = 2,
) -> None:
    """NoLoCo vs DiLoCo vs NoLoCo-over-all vs none vs synchronous, equal compute (PNG)."""
    if compression:
        from testnet.bench import compression as cbench

        cbench.main(quick=quick, workers=workers)
        return
    if pipeline:
        from testnet.bench import pipeconv

        pipeconv.main(quick=quick)
        return
    from testnet.bench import convergence as bench

    bench.main(quick=quick)


@app.command()
def exchange(
    quick: Quick = False,
    hivemind_venv: Annotated[Path | None, typer.Option(
        help="A venv with hivemind==1.1.12 and torch==2.13.0, for the side-by-side run.")]
    = None,
) -> None:
    """Wall time of one pairwise exchange between two node processes, per codec."""
    from testnet.bench import exchange as bench

    bench.main(quick=quick, hivemind_venv=hivemind_venv)


@app.command()
def trainer(
    quick: Quick = False,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (auto: cuda if present).")]
    = "auto",
    d_model: Annotated[int | None, typer.Option(min=1,
        help="Model width (default 768 on CUDA: the 86M model; 128 on a CPU).")] = None,
    layers: Annotated[int | None, typer.Option(min=1, help="Layers (default 12 CUDA, 4 CPU).")]
    = None,
    heads: Annotated[int | None, typer.Option(min=1, help="Heads (default 12 CUDA, 4 CPU).")]
    = None,
    context: Annotated[int | None, typer.Option(
        min=1, help="Context (default 1024 CUDA, 128 CPU).")]
    = None,
    batch: Annotated[int | None, typer.Option(min=1, help="Batch (default 16).")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="Timed steps per block.")] = None,
    rounds: Annotated[int | None, typer.Option(min=1, help="Interleaved rounds of blocks.")] = None,
    compile_: Annotated[bool, typer.Option(
        "--compile/--no-compile", help="Also the torch.compile variants.")] = True,
    threads: Annotated[int, typer.Option(min=1, help="torch threads (a node's default: 1).")] = 1,
    peak_tflops: Annotated[float | None, typer.Option(
        help="The device's peak TFLOP/s for MFU, where the built-in table has none.")]
    = None,
) -> None:
    """ms/step, tokens/s and MFU: the trainer vs a plain torch loop vs that loop compiled."""
    from cli.common import fail
    from node.ml import device as dev

    try:
        dev.precheck(device)
    except dev.DeviceError as e:
        raise fail(str(e), 2) from None
    from node.ml.trainer.errors import ConfigError
    from testnet.bench import trainer as bench

    try:
        bench.main(device=device, quick=quick, d_model=d_model, layers=layers, heads=heads,
                   context=context, batch=batch, steps=steps, rounds=rounds,
                   compile_=compile_, threads=threads, peak_tflops=peak_tflops)
    except (ConfigError, dev.DeviceError) as e:  # heads not dividing d_model, no such GPU
        raise fail(str(e), 2) from None


@app.command()
def robust(quick: Quick = False) -> None:
    """Sybil attacks against five aggregators, and variance correction (PNG)."""
    from testnet.bench import robust as bench

    bench.main(quick=quick)


@app.command()
def join(
    quick: Quick = False,
    nodes: Annotated[int, typer.Option("--nodes", "-n", help="Nodes training the run.")] = 4,
    joins: Annotated[int, typer.Option(help="Joiners, one after the other.")] = 3,
) -> None:
    """Join to first step on a running testnet (25 MB model), phase by phase."""
    from testnet.bench import join as bench

    bench.main(quick=quick, nodes=nodes, joins=joins)


@app.command()
def pull(quick: Quick = False) -> None:
    """Checkpoint download from one provider vs three (loopback; rate-limited as root)."""
    from testnet.bench import pull as bench

    bench.main(quick=quick)


@app.command()
def partition(quick: Quick = False) -> None:
    """Run-document convergence after a partition heals (root: network namespaces)."""
    from cli.common import fail
    from testnet.bench import partition as bench

    try:
        bench.main(quick=quick)
    except bench.BenchUnavailable as e:
        raise fail(str(e), 2) from None


@app.command()
def reach(quick: Quick = False,
          attempts: Annotated[int | None, typer.Option(
              help="Attempts per pair of NAT kinds (default 10; 3 with --quick).")] = None,
          pairs: Annotated[str | None, typer.Option(
              help="Only these pairs, e.g. home-upnp,upnp-upnp (a section of their own); "
                   "kinds: public, fullcone, home, symmetric, upnp.")] = None,
          ) -> None:
    """The reachability matrix: path, time to it and success rate for every pair of NAT
    kinds (root: NATs in network namespaces)."""
    from cli.common import fail
    from testnet.bench import reach as bench

    try:
        only = bench.parse_pairs(pairs) if pairs is not None else None
    except ValueError as e:
        raise fail(str(e), 2) from None
    try:
        bench.main(quick=quick, attempts=attempts, only=only)
    except bench.BenchUnavailable as e:
        raise fail(str(e), 2) from None


@app.command()
def wan(quick: Quick = False,
        rate: Annotated[str, typer.Option(help="Every WAN link's rate, both ways.")] = "100mbit",
        rtt: Annotated[float, typer.Option(help="Round-trip time added between any two "
                                           "nodes, in ms.")] = 50.0,
        gpu: Annotated[bool, typer.Option(
            "--gpu", help="The 86M model at an H100's step time (a timed stand-in "
            "trainer): NoLoCo and DiLoCo, bf16 and compressed.")] = False,
        step_ms: Annotated[float, typer.Option(help="--gpu: ms per inner step.")] = 27.2,
        compressed: Annotated[str | None, typer.Option(
            help="--gpu: the compressed codec (default: one protocols/codecs.py knows).",
            show_default=False)] = None,
        seconds: Annotated[int, typer.Option(help="--gpu: seconds per case.")] = 150,
        scale: Annotated[int, typer.Option(
            help="--gpu: divide the vector and every link's rate by this (same seconds "
                 "per exchange, less CPU and memory).")] = 1,
        only: Annotated[str | None, typer.Option(
            help="--gpu: one case (noloco, diloco, or e.g. noloco-bf16).",
            show_default=False)] = None) -> None:
    """NoLoCo and DiLoCo, each run across shaped WAN links: utilization, bytes per outer
    step, time to a validation loss (root: namespaces)."""
    from cli.common import fail
    from testnet.bench import wan as bench

    try:
        if gpu:
            from testnet.bench import wan_gpu

            wan_gpu.main(step_ms=step_ms, seconds=seconds, rate=rate, rtt_ms=rtt,
                         compressed=compressed, only=only, scale=scale)
        else:
            bench.main(quick=quick, rate=rate, rtt_ms=rtt)
    except bench.BenchUnavailable as e:
        raise fail(str(e), 2) from None
    except ValueError as e:
        raise fail(str(e), 2) from None


@app.command()
def paths(quick: Quick = False,
          rate: Annotated[str, typer.Option(help="Every WAN link's rate, both ways.")] = "100mbit",
          rtt: Annotated[float, typer.Option(help="Round-trip time added between any two "
                                             "WAN hosts, in ms.")] = 50.0,
          mb: Annotated[float | None, typer.Option(
              help="Megabytes of fp32 weights per exchange (default 16; 4 with --quick).")
          ] = None,
          rounds: Annotated[int | None, typer.Option(
              help="Averaging rounds per path (default 5; 2 with --quick).")] = None,
          ) -> None:
    """Averaging over each path kind (direct, upnp, punched, relayed, webrtc) on shaped
    WAN links: the route, codec, round seconds and wire rate (root: NATs in namespaces)."""
    from cli.common import fail
    from testnet.bench import paths as bench

    try:
        bench.main(quick=quick, rate=rate, rtt_ms=rtt, mb=mb, rounds=rounds)
    except bench.BenchUnavailable as e:
        raise fail(str(e), 2) from None


@app.command()
def churn(quick: Quick = False) -> None:
    """Training through churn: 8 nodes, random SIGKILLs and restarts for 10 min (PNG)."""
    from testnet.bench import churn as bench

    bench.main(quick=quick)


@app.command()
def checkfree(quick: Quick = False) -> None:
    """Pipeline stage recovery: CheckFree, CheckFree+ vs checkpoint, re-init, average (PNG)."""
    from testnet.bench import checkfree as bench

    bench.main(quick=quick)


@app.command("kill-stage")
def kill_stage(
    quick: Quick = False,
    case: Annotated[list[str] | None, typer.Option(
        "--case", help="interior, edge-plus, edge-default, restart, replica, twice, "
        "adjacent (repeatable; default: all).")] = None,
    load: Annotated[str, typer.Option(
        "--load", help="idle, burner (beside one `yes` process) or both.")] = "both",
) -> None:
    """Pipeline stages killed live (one, a replica, twice, adjacent, an edge), timed."""
    from testnet.bench import killstage as bench

    try:
        bench.main(quick=quick, names=case, load=load)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@app.command()
def soak(quick: Quick = False) -> None:
    """A public node takes 10,000 connections from 1,000 identities: RSS, fds, a fresh peer."""
    from testnet.bench import soak as bench

    bench.main(quick=quick)


@app.command()
def sim(quick: Quick = False,
        scenario: Annotated[Path | None, typer.Option(
            help="A scenario file (TOML; default testnet/sim/scenarios/default.toml).")]
        = None,
        reuse: Annotated[Path | None, typer.Option(
            help="An earlier run's raw JSON: take its churn, NoLoCo/DiLoCo, sybil and "
                 "100,000-peer results instead of running them again.")] = None,
        real: Annotated[Path | None, typer.Option(
            help="A loopback testnet's heartbeat rates (python -m testnet.sim.realcheck "
                 "DIR), reported beside the simulator's.")] = None) -> None:
    """The swarm simulator's curves, 10 to 10,000 peers on virtual time: traffic per node,
    spread, joins, churn, NoLoCo vs DiLoCo, sybils, checkpoint bursts (PNG)."""
    from cli.common import fail
    from testnet.sim import bench
    from testnet.sim.scenario import ScenarioError

    try:
        bench.main(quick=quick, scenario=scenario, reuse=reuse, real=real)
    except ScenarioError as e:
        raise fail(str(e), 2) from None


@app.command("all")
def run_all(quick: Quick = False) -> None:
    """Every benchmark, one after the other."""
    p2p(quick)
    utilization(quick)
    convergence(quick)
    convergence(quick, pipeline=True)
    checkfree(quick)
    kill_stage(quick)
    robust(quick)
    join(quick)
    pull(quick)
    churn(quick)
    soak(quick)
    sim(quick)
    from testnet.netns import available

    if available() is None:  # root only
        partition(quick)
