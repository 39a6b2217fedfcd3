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
def convergence(quick: Quick = False) -> None:
    """NoLoCo vs DiLoCo vs NoLoCo-over-all vs none vs synchronous, equal compute (PNG)."""
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


@app.command("all")
def run_all(quick: Quick = False) -> None:
    """Every benchmark, one after the other."""
    p2p(quick)
    utilization(quick)
    convergence(quick)
