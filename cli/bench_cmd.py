"""`node bench ...`: the benchmarks behind docs/benchmarks.md, runnable by anyone."""

from __future__ import annotations

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


@app.command("all")
def run_all(quick: Quick = False) -> None:
    """Every benchmark, one after the other."""
    p2p(quick)
    utilization(quick)
