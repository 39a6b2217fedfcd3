"""`node testnet up|down|status|logs`: a local multi-node testnet on loopback."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live

from cli.common import err, fail, out
from cli.render import testnet_table
from testnet import launcher

app = typer.Typer(no_args_is_help=True, help="Run a local multi-node testnet on loopback.")

Dir = Annotated[Path | None, typer.Option("--dir", help="Where the testnet keeps its state.")]


def _load(directory: Path) -> launcher.Testnet:
    net = launcher.Testnet.load(directory)
    if net is None:
        raise fail(f"no testnet in {directory}; start one with `node testnet up`")
    return net


@app.command()
def up(
    nodes: Annotated[int, typer.Option("--nodes", "-n", help="Number of nodes.")] = 4,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once up.")] = False,
    manifest: Annotated[Path | None, typer.Option(help="Run manifest (default: demo).")] = None,
    directory: Dir = None,
    no_train: Annotated[bool, typer.Option("--no-train", help="Nodes join without training.")]
    = False,
) -> None:
    """Start a bootstrap and N nodes, then show a live table until Ctrl-C."""
    directory = directory or launcher.default_dir()
    extra = ["--no-train"] if no_train else []
    try:
        with err.status("starting the testnet") as spinner:
            net = launcher.up(directory, nodes, manifest=manifest, detached=detach,
                              extra_node_args=extra,
                              on_progress=lambda m: spinner.update(m))
    except launcher.TestnetError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    err.print(f"testnet up in {net.dir}: run {net.run_id}, bootstrap {net.bootstrap_addr}")
    if detach:
        err.print("stop it with `node testnet down`")
        return
    try:
        with Live(console=out, refresh_per_second=2, transient=False) as live:
            while True:
                live.update(testnet_table(launcher.collect_status(net),
                                          f"testnet {net.run_id} (Ctrl-C stops it)"))
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        stopped = launcher.down(directory)
        err.print(f"testnet down: stopped {stopped} processes")


@app.command()
def down(directory: Dir = None) -> None:
    """Stop every process of the testnet."""
    directory = directory or launcher.default_dir()
    stopped = launcher.down(directory)
    err.print(f"stopped {stopped} processes" if stopped else f"no testnet running in {directory}")


@app.command()
def status(
    directory: Dir = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show each testnet process: phase, peers, connections."""
    net = _load(directory or launcher.default_dir())
    rows = launcher.collect_status(net)
    if as_json:
        print(json.dumps({"run": net.run_id, "dir": net.dir, "processes": rows}, indent=2))
    else:
        out.print(testnet_table(rows, f"testnet {net.run_id}"))


@app.command()
def logs(
    node: Annotated[str | None, typer.Argument(help="node1, node2, ... or bootstrap.")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n")] = 40,
    directory: Dir = None,
) -> None:
    """Print the last log lines of one node, or of all of them."""
    net = _load(directory or launcher.default_dir())
    procs = [p for p in net.procs if node is None or p.name == node]
    if not procs:
        raise fail(f"no node named {node}; have {', '.join(p.name for p in net.procs)}")
    for p in procs:
        out.rule(p.name)
        path = Path(p.state_dir) / "node.log"
        try:
            raw = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            out.print(launcher.tail(Path(p.state_dir) / "stdout.log", lines), highlight=False)
            continue
        for line in raw:
            try:
                doc = json.loads(line)
                stamp = datetime.fromtimestamp(doc["ts"]).strftime("%H:%M:%S")
                out.print(f"{stamp} {doc['level']:7} {doc['logger']}: {doc['msg']}",
                          highlight=False, markup=False)
            except (ValueError, KeyError):
                out.print(line, highlight=False, markup=False)
