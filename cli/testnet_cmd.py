"""`node testnet up|down|status|logs|partition|heal`: a local multi-node testnet."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live

from cli import checks
from cli.common import err, fail, out
from cli.render import testnet_table
from testnet import launcher, netns

app = typer.Typer(no_args_is_help=True, help="Run a local multi-node testnet on loopback "
                                              "(or in network namespaces, as root).")

AGGREGATORS = ("mean", "vc", "median", "krum", "foolsgold", "sybilwall")
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
    scenario: Annotated[str | None, typer.Option(
        help="'sybil': --honest nodes plus one attacker with --sybils identities sending a "
             "poisoned model (docs/robustness.md). 'partition' (root): every process in a "
             "network namespace of its own, for `node testnet partition` and `heal`.")] = None,
    honest: Annotated[int | None, typer.Option(help="sybil scenario: honest nodes.")] = None,
    sybils: Annotated[int, typer.Option(help="sybil scenario: the attacker's identities.")] = 4,
    attack: Annotated[str, typer.Option(help="sybil scenario: label-flip or backdoor.")]
    = "label-flip",
    aggregator: Annotated[str | None, typer.Option(
        help="Override aggregate.method: mean, vc, median, krum, foolsgold, sybilwall.")] = None,
) -> None:
    """Start a bootstrap and N nodes, then show a live table until Ctrl-C."""
    directory = directory or launcher.default_dir()
    extra = ["--no-train"] if no_train else []
    if scenario not in (None, "sybil", "partition"):
        raise fail(f"--scenario {scenario}: known scenarios: sybil, partition", 2)
    for flag, value in (("--nodes", nodes), ("--honest", honest), ("--sybils", sybils)):
        if value is not None and value < 1:
            raise fail(f"{flag} {value}: expected at least 1", 2)
    if aggregator is not None and aggregator not in AGGREGATORS:
        raise fail(f"--aggregator {aggregator}: expected one of {', '.join(AGGREGATORS)}", 2)
    if manifest is not None:
        checks.manifest_file(manifest)  # missing or invalid: one line, exit 2
    if scenario == "partition":
        manifest = manifest or launcher.scenario_manifest_path("partition")
        reason = netns.available()
        if reason:
            raise fail(f"--scenario partition puts each node in a network namespace: {reason}",
                       2)
    if scenario == "sybil":
        nodes = honest if honest is not None else nodes
        manifest = manifest or launcher.scenario_manifest_path("sybil")
        if attack not in ("label-flip", "backdoor"):
            raise fail(f"--attack {attack}: expected label-flip or backdoor", 2)
    try:
        with err.status("starting the testnet") as spinner:
            net = launcher.up(directory, nodes, manifest=manifest, detached=detach,
                              extra_node_args=extra,
                              sybils=sybils if scenario == "sybil" else 0, attack=attack,
                              aggregator=aggregator, netns=scenario == "partition",
                              on_progress=lambda m: spinner.update(m))
    except launcher.TestnetError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    err.print(f"testnet up in {net.dir}: run {net.run_id}, bootstrap {net.bootstrap_addr}",
              markup=False, highlight=False)
    if detach:
        err.print("stop it with `node testnet down`")
        return
    try:
        with Live(console=out, refresh_per_second=2, transient=False) as live:
            while True:
                live.update(testnet_table(launcher.collect_status(net),
                                          f"testnet {net.run_id} (Ctrl-C stops it)",
                                          width=out.width))
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
    err.print(f"stopped {stopped} processes" if stopped else f"no testnet running in {directory}",
              markup=False, highlight=False)


@app.command()
def status(
    directory: Dir = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show each testnet process: phase, peers, connections."""
    net = _load(directory or launcher.default_dir())
    rows = launcher.collect_status(net)
    if as_json:
        cut = (net.netns or {}).get("cut")
        print(json.dumps({"run": net.run_id, "dir": net.dir, "partition": cut,
                          "processes": rows}, indent=2))
    else:
        out.print(testnet_table(rows, f"testnet {net.run_id}", width=out.width))


@app.command()
def logs(
    node: Annotated[str | None, typer.Argument(help="node1, node2, ... or bootstrap.")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n")] = 40,
    directory: Dir = None,
) -> None:
    """Print the last log lines of one node, or of all of them."""
    if lines < 1:
        raise fail(f"--lines {lines}: expected at least 1", 2)
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
            out.print(launcher.tail(Path(p.state_dir) / "stdout.log", lines), highlight=False,
                      markup=False)
            continue
        for line in raw:
            try:
                doc = json.loads(line)
                stamp = datetime.fromtimestamp(doc["ts"]).strftime("%H:%M:%S")
                out.print(f"{stamp} {doc['level']:7} {doc['logger']}: {doc['msg']}",
                          highlight=False, markup=False)
            except (ValueError, KeyError):
                out.print(line, highlight=False, markup=False)


@app.command()
def partition(
    side: Annotated[list[str] | None, typer.Argument(
        help="Nodes cut off from the rest (default: the second half of the nodes).")] = None,
    directory: Dir = None,
) -> None:
    """Split a `--scenario partition` testnet in two: dials across fail, open links drop."""
    net = _load(directory or launcher.default_dir())
    try:
        a, b = launcher.partition(net, side)
    except launcher.TestnetError as e:
        raise fail(str(e)) from None
    err.print(f"partitioned: {' '.join(a)}  |  {' '.join(b)}", markup=False)
    err.print("undo it with `node testnet heal`")


@app.command()
def heal(directory: Dir = None) -> None:
    """Join the two sides of a partitioned testnet again."""
    net = _load(directory or launcher.default_dir())
    try:
        launcher.heal(net)
    except launcher.TestnetError as e:
        raise fail(str(e)) from None
    err.print("healed: every node can reach every other again")
