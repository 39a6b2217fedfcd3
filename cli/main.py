"""The `node` / `peertrain` command line: a thin face over node/ and testnet/.

Errors a user can cause (a wrong run-id, an unreachable bootstrap, a bad manifest) are
printed as one plain-text line with a documented exit code (docs/operator.md); Ctrl-C
exits quietly with 130, SIGTERM with 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cli import checks
from cli.common import App, fail, out, run_async
from node import state_lock
from node.config import NodeConfig, default_state_dir
from node.errors import NodeError
from node.status.control import ControlUnavailable, query_control
from node.status.logs import setup_logging
from node.training.data_check import check_text_files

app = App(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
          help="peertrain: contribute a CPU or GPU to a shared training run.")
run_app = typer.Typer(no_args_is_help=True, help="Create and inspect run manifests.")
app.add_typer(run_app, name="run")


StateDir = Annotated[Path | None, typer.Option(
    "--state-dir", help="Identity, logs and run data. Default: the user data dir.")]
Bootstrap = Annotated[list[str] | None, typer.Option(
    "--bootstrap", "-b", help="Multiaddr of a peer to start from (repeatable).")]
Listen = Annotated[list[str] | None, typer.Option(
    "--listen", help="Multiaddr to listen on (repeatable). Default /ip4/0.0.0.0/tcp/0.")]
LogLevel = Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")]


def lock_state_dir(state_dir: Path | None) -> Path:
    """Take the state directory's lock (held until exit) before anything there is written:
    a second node on a live directory is refused and touches nothing (exit 6)."""
    state_dir = state_dir or default_state_dir()
    try:
        _held_locks.append(state_lock.acquire(state_dir))
    except NodeError as e:
        raise fail(str(e), e.exit_code) from None
    return state_dir


_held_locks: list[state_lock.StateLock] = []


@app.command()
def join(
    run_id: Annotated[str, typer.Argument(help="The run to join (from `node run create`).")],
    bootstrap: Bootstrap = None,
    state_dir: StateDir = None,
    listen: Listen = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    join_timeout: Annotated[float, typer.Option(help="Seconds to look for the run.")] = 30.0,
    no_train: Annotated[bool, typer.Option("--no-train", help="Join without training.")] = False,
    data: Annotated[list[Path] | None, typer.Option(
        "--data", help="Your own text/JSONL files or directories to train on (repeatable).")]
    = None,
    attack: Annotated[str | None, typer.Option(
        help="Testnets only: act as a sybil sending a poisoned model (label-flip or backdoor)"
             " to test a run's defences. See docs/robustness.md.")] = None,
    neighbour: Annotated[list[str] | None, typer.Option(
        "--neighbour", help="Testnets only: exchange with exactly this peer id every round"
        " (repeatable; each must name us too), not the run's pairing.")] = None,
    log_level: LogLevel = "info",
) -> None:
    """Join a training run: find it through the DHT, verify its manifest, contribute."""
    from node.daemon import run_node
    from protocols import manifest as mf

    try:
        run_id = mf.validate_run_id(run_id)
    except mf.ManifestError as e:
        raise fail(str(e), 2) from None
    device = checks.device(device)
    if attack not in (None, "label-flip", "backdoor"):
        raise fail(f"--attack {attack}: expected label-flip or backdoor", 2)
    checks.positive_seconds("--join-timeout", join_timeout)
    listen = checks.listen_addrs(listen)
    log_level = checks.log_level(log_level)
    files = [str(p) for p in data or []]
    if files:
        if no_train:
            raise fail("--data trains on your files; it cannot go with --no-train", 2)
        try:
            check_text_files(files)
        except NodeError as e:
            raise fail(str(e), e.exit_code) from None
    state_dir = lock_state_dir(state_dir)
    setup_logging(state_dir, log_level)
    config = NodeConfig(state_dir=state_dir, run_id=run_id, bootstrap=list(bootstrap or []),
                        listen=listen, device=device, join_timeout_s=join_timeout,
                        train=not no_train, data=files, attack=attack,
                        neighbours=list(neighbour or []))
    run_async(lambda: run_node(config))


@app.command("bootstrap")
def bootstrap_cmd(
    state_dir: StateDir = None,
    listen: Listen = None,
    bootstrap: Bootstrap = None,
    log_level: LogLevel = "info",
) -> None:
    """Run a bootstrap peer: a DHT and gossip entry point serving the runs it holds."""
    from node.daemon import run_node

    listen = checks.listen_addrs(listen)
    log_level = checks.log_level(log_level)
    state_dir = lock_state_dir(state_dir)
    setup_logging(state_dir, log_level)
    config = NodeConfig(state_dir=state_dir, run_id=None, bootstrap=list(bootstrap or []),
                        listen=listen)
    run_async(lambda: run_node(config))


@run_app.command("create")
def run_create(
    manifest: Annotated[Path, typer.Argument(help="The run manifest (TOML).")],
    state_dir: StateDir = None,
) -> None:
    """Validate a manifest, store it for serving, and print its run-id."""
    from node.run.store import RunStore
    from protocols import manifest as mf

    m = checks.manifest_file(manifest)
    state_dir = state_dir or default_state_dir()
    try:
        run_id = RunStore(state_dir).put(mf.canonical_bytes(m))
    except OSError as e:
        raise fail(f"cannot use state directory {state_dir}: {e.strerror or e}", 6) from None
    print(run_id)


@run_app.command("show")
def run_show(
    manifest: Annotated[Path, typer.Argument(help="The run manifest (TOML).")],
) -> None:
    """Print a manifest's canonical form and run-id without storing anything."""
    from protocols import manifest as mf

    m = checks.manifest_file(manifest)
    data = mf.canonical_bytes(m)
    out.print_json(data.decode())
    print(mf.run_id(data))


@app.command()
def status(
    state_dir: StateDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show what the local node is doing: run, peers, addresses, uptime."""
    try:
        st = query_control(state_dir or default_state_dir())
    except ControlUnavailable as e:
        raise fail(str(e)) from None
    if as_json:
        print(json.dumps(st, indent=2))
        return
    from cli.render import node_status_table

    out.print(node_status_table(st))


from cli import bench_cmd, ckpt_cmd, testnet_cmd  # noqa: E402  (sub-commands)

app.add_typer(testnet_cmd.app, name="testnet")
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(ckpt_cmd.app, name="ckpt")
