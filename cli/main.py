"""The `node` / `peertrain` command line: a thin face over node/ and testnet/.

Errors a user can cause (a wrong run-id, an unreachable bootstrap, a bad manifest) are
printed as one plain-text line with a documented exit code (docs/operator.md); Ctrl-C
exits quietly with 130, SIGTERM with 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import checks, config_cmd
from cli.common import App, Json, StateDir, err, fail, out, print_json, run_async
from cli.lifecycle import EXIT_SIGINT
from node.config import NodeConfig, default_state_dir
from node.errors import NodeError
from node.process import state_lock
from node.status.control import ControlUnavailable, query_control
from node.status.logs import setup_logging
from node.training.data_check import check_text_files

app = App(no_args_is_help=True, pretty_exceptions_enable=False,
          context_settings={"help_option_names": ["-h", "--help"]},
          help="peertrain: contribute a CPU or GPU to a shared training run.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"peertrain {version('peertrain')}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option(
        "--version", "-V", callback=_version, is_eager=True,
        help="Print the version and exit.")] = False,
) -> None:
    """peertrain: contribute a CPU or GPU to a shared training run."""
run_app = typer.Typer(no_args_is_help=True, help="Create and inspect run manifests.")
app.add_typer(run_app, name="run")


Bootstrap = Annotated[list[str] | None, typer.Option(
    "--bootstrap", "-b", help="Multiaddr of a peer to start from (repeatable). Default: "
    "$PEERTRAIN_BOOTSTRAP, the config file, remembered peers, mDNS.", show_default=False)]
Listen = Annotated[list[str] | None, typer.Option(
    "--listen", help="Multiaddr to listen on (repeatable). Default /ip4/0.0.0.0/tcp/0.",
    show_default=False)]
Announce = Annotated[list[str] | None, typer.Option(
    "--announce", help="Address others should dial, e.g. a public IP or port forward: "
    "/ip4/203.0.113.7/tcp/4101 (repeatable). Advertised before the listen addresses.",
    show_default=False)]
Mdns = Annotated[bool | None, typer.Option(
    "--mdns/--no-mdns", help="Advertise and find peers on the local network. Default: on.",
    show_default=False)]
LogLevel = Annotated[str | None, typer.Option(
    "--log-level", help="debug, info, warning or error. Default: info.", show_default=False)]
Metrics = Annotated[str | None, typer.Option(
    "--metrics", metavar="HOST:PORT", help="Serve Prometheus /metrics and the status page "
    "here. Default 127.0.0.1:9470 (a free port if taken; the URL is in metrics.json).",
    show_default=False)]
NoMetrics = Annotated[bool | None, typer.Option(
    "--no-metrics", help="Serve no metrics port.", show_default=False)]
NoUpnp = Annotated[bool | None, typer.Option(
    "--no-upnp", help="Never ask the LAN's gateway for a port mapping (docs/nat.md).",
    show_default=False)]
NoPunch = Annotated[bool | None, typer.Option(
    "--no-punch", help="Never hole-punch a peer reached through a relay; neither drive nor "
    "answer DCUtR (docs/nat.md).", show_default=False)]
Config = config_cmd.ConfigOpt
BOOTSTRAP_PORT = 4101  # `node bootstrap`'s default: a fixed port to forward and hand out
BOOTSTRAP_LISTEN = f"/ip4/0.0.0.0/tcp/{BOOTSTRAP_PORT}"


def announce_addrs(values: list[str]) -> list[str]:
    """Each --announce is /ip4|ip6|dns4|dns6/HOST/tcp/PORT, without /p2p/ (we add our id)."""
    import multiaddr

    for a in values:
        try:
            names = [p.name for p in multiaddr.Multiaddr(a).protocols()]
        except Exception:
            names = []
        if len(names) != 2 or names[0] not in ("ip4", "ip6", "dns4", "dns6", "dns") or (
                names[1] != "tcp"):
            raise fail(f"--announce {a}: expected /ip4/ADDR/tcp/PORT (or ip6, dns4, dns6), "
                       "e.g. /ip4/203.0.113.7/tcp/4101", 2)
    return list(values)


def parse_peer_addrs(values: list[str], source: str) -> list[str]:
    """Bootstrap addresses must name their peer; a typo is an error now, not a log line."""
    from p2p.host import DialError, parse_peer_addr

    for a in values:
        try:
            parse_peer_addr(a)
        except DialError as e:
            flag = "--bootstrap" if source == "--bootstrap" else f"bootstrap ({source})"
            raise fail(f"{flag} {a}: {e.reason}", 2) from None
    return values


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
    run_id: Annotated[str, typer.Argument(
        help="The run to join (from `node run create`), or a ticket (`node run ticket`).",
        show_default=False)],
    bootstrap: Bootstrap = None,
    state_dir: StateDir = None,
    listen: Listen = None,
    announce: Announce = None,
    mdns: Mdns = None,
    device: Annotated[str | None, typer.Option(
        help="auto, cpu, cuda or cuda:N. Default: auto.", show_default=False)] = None,
    join_timeout: Annotated[float | None, typer.Option(
        help="Seconds to look for the run. Default: 30.", show_default=False)] = None,
    heartbeat_target: Annotated[float | None, typer.Option(
        help="Heartbeats a second each node should receive at most; a run of N beats every "
             "max(1 s, N / this). Default: 50.", show_default=False)] = None,
    want_peers: Annotated[int | None, typer.Option(
        help="Run members to keep connected. Default: 8.", show_default=False)] = None,
    max_peers: Annotated[int | None, typer.Option(
        help="Connections past which the oldest unprotected are closed. Default: 32.",
        show_default=False)] = None,
    rundoc_horizon: Annotated[float | None, typer.Option(
        help="Seconds after which a departed peer's run-document entries are compacted. "
             "Default: 3600.", show_default=False)] = None,
    no_train: Annotated[bool | None, typer.Option(
        "--no-train", help="Join without training.", show_default=False)] = None,
    data: Annotated[list[Path] | None, typer.Option(
        "--data", help="Your own text/JSONL files or directories to train on (repeatable).",
        show_default=False)] = None,
    attack: Annotated[str | None, typer.Option(
        help="Testnets only: act as a sybil sending a poisoned model (label-flip or backdoor)"
             " to test a run's defences. See docs/robustness.md.", show_default=False)] = None,
    neighbour: Annotated[list[str] | None, typer.Option(
        "--neighbour", help="Testnets only: exchange with exactly this peer id every round"
        " (repeatable; each must name us too), not the run's pairing.",
        show_default=False)] = None,
    log_level: LogLevel = None,
    metrics: Metrics = None,
    no_metrics: NoMetrics = None,
    no_upnp: NoUpnp = None,
    no_punch: NoPunch = None,
    config: Config = None,
) -> None:
    """Join a training run: find it through the DHT, verify its manifest, contribute."""
    from node.daemon import run_node
    from protocols import manifest as mf
    from protocols import ticket as tk

    ticket_addrs: list[str] = []
    if run_id.strip().startswith("pt"):
        try:
            ticket = tk.decode(run_id)
        except tk.TicketError as e:
            raise fail(f"not a ticket: {e}", 2) from None
        run_id, ticket_addrs = ticket.run_id, ticket.peer_addrs()
    try:
        run_id = mf.validate_run_id(run_id)
    except mf.ManifestError as e:
        raise fail(str(e), 2) from None
    v = config_cmd.effective("join", config, {
        "bootstrap": bootstrap, "state_dir": state_dir, "listen": listen, "announce": announce,
        "mdns": mdns, "device": device, "join_timeout": join_timeout, "no_train": no_train,
        "data": data, "attack": attack, "neighbour": neighbour, "log_level": log_level,
        "metrics": metrics, "no_metrics": no_metrics, "no_upnp": no_upnp,
        "no_punch": no_punch, "heartbeat_target": heartbeat_target, "want_peers": want_peers,
        "max_peers": max_peers, "rundoc_horizon": rundoc_horizon,
    }, {"bootstrap": [], "state_dir": None, "listen": None, "announce": [], "mdns": True,
        "device": "auto", "join_timeout": 30.0, "no_train": False, "data": [], "attack": None,
        "neighbour": [], "log_level": "info", "metrics": None, "no_metrics": False,
        "no_upnp": False, "no_punch": False, "heartbeat_target": NodeConfig.heartbeat_target_per_s,
        "want_peers": NodeConfig.want_peers, "max_peers": NodeConfig.max_peers,
        "rundoc_horizon": NodeConfig.rundoc_horizon_s})
    if ticket_addrs:
        v["bootstrap_from"] = "--bootstrap and the ticket" if bootstrap else "the ticket"
        v["bootstrap"] = [*(bootstrap or []), *ticket_addrs]
    device = checks.device(v["device"])
    attack = v["attack"]
    if attack not in (None, "label-flip", "backdoor"):
        raise fail(f"--attack {attack}: expected label-flip or backdoor", 2)
    join_timeout = checks.positive_seconds("--join-timeout", v["join_timeout"])
    scale = checks.scale(v["heartbeat_target"], v["want_peers"], v["max_peers"],
                         v["rundoc_horizon"])
    listen = checks.listen_addrs(v["listen"])
    log_level = checks.log_level(v["log_level"])
    boot = parse_peer_addrs(v["bootstrap"], v["bootstrap_from"])
    metrics_at = checks.metrics_addr(v["metrics"], v["no_metrics"])
    files = [str(p) for p in v["data"]]
    if files:
        if v["no_train"]:
            raise fail("--data trains on your files; it cannot go with --no-train", 2)
        try:
            check_text_files(files)
        except NodeError as e:
            raise fail(str(e), e.exit_code) from None
    state_dir = lock_state_dir(Path(v["state_dir"]) if v["state_dir"] else None)
    setup_logging(state_dir, log_level)
    node_config = NodeConfig(
        state_dir=state_dir, run_id=run_id, bootstrap=boot, bootstrap_from=v["bootstrap_from"],
        listen=listen, announce=announce_addrs(v["announce"]), mdns=v["mdns"], device=device,
        join_timeout_s=join_timeout, train=not v["no_train"], data=files, attack=attack,
        neighbours=list(v["neighbour"]), upnp=not v["no_upnp"], punch=not v["no_punch"],
        **scale, **metrics_at)
    run_async(lambda: run_node(node_config))


@app.command("bootstrap")
def bootstrap_cmd(
    state_dir: StateDir = None,
    listen: Annotated[list[str] | None, typer.Option(
        "--listen", help=f"Multiaddr to listen on (repeatable). Default {BOOTSTRAP_LISTEN}: "
        "a fixed port, to open or forward and hand out.", show_default=False)] = None,
    announce: Announce = None,
    bootstrap: Bootstrap = None,
    mdns: Mdns = None,
    log_level: LogLevel = None,
    metrics: Metrics = None,
    no_metrics: NoMetrics = None,
    no_upnp: NoUpnp = None,
    config: Config = None,
) -> None:
    """Run a bootstrap peer: a DHT and gossip entry point serving the runs it holds."""
    from node.daemon import run_node

    v = config_cmd.effective("bootstrap", config, {
        "state_dir": state_dir, "listen": listen, "announce": announce, "bootstrap": bootstrap,
        "mdns": mdns, "log_level": log_level, "metrics": metrics, "no_metrics": no_metrics,
        "no_upnp": no_upnp,
    }, {"state_dir": None, "listen": [BOOTSTRAP_LISTEN], "announce": [], "bootstrap": [],
        "mdns": True, "log_level": "info", "metrics": None, "no_metrics": False,
        "no_upnp": False})
    listen = checks.listen_addrs(v["listen"])
    log_level = checks.log_level(v["log_level"])
    boot = parse_peer_addrs(v["bootstrap"], v["bootstrap_from"])
    metrics_at = checks.metrics_addr(v["metrics"], v["no_metrics"])
    state_dir = lock_state_dir(Path(v["state_dir"]) if v["state_dir"] else None)
    setup_logging(state_dir, log_level)
    node_config = NodeConfig(state_dir=state_dir, run_id=None, bootstrap=boot,
                             bootstrap_from=v["bootstrap_from"], listen=listen,
                             announce=announce_addrs(v["announce"]), mdns=v["mdns"],
                             upnp=not v["no_upnp"], **metrics_at)
    run_async(lambda: run_node(node_config))


@run_app.command("create")
def run_create(
    manifest: Annotated[Path, typer.Argument(help="The run manifest (TOML).")],
    state_dir: StateDir = None,
    as_json: Json = False,
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
    if as_json:
        print_json({"run_id": run_id, "name": m.run.name, "state_dir": str(state_dir)})
    else:
        print(run_id)


@run_app.command("ticket")
def run_ticket(
    run_id: Annotated[str, typer.Argument(help="The run to hand out.", show_default=False)],
    state_dir: StateDir = None,
    as_json: Json = False,
) -> None:
    """Print a join ticket: the run-id and this node's reachable addresses, in one string
    that `node join` takes in place of the run-id (the local node must be running)."""
    from node.discovery.addrs import shareable
    from protocols import manifest as mf
    from protocols import ticket as tk

    try:
        run_id = mf.validate_run_id(run_id)
    except mf.ManifestError as e:
        raise fail(str(e), 2) from None
    state_dir = state_dir or default_state_dir()
    try:
        st = query_control(state_dir)
    except ControlUnavailable as e:
        raise fail(f"{e}; a ticket names a running node: start `node bootstrap` or "
                   "`node join` there first", 1) from None
    addrs = shareable(list(st.get("addrs") or []), list(st.get("announce") or []))
    if not addrs:
        raise fail(f"the node in {state_dir} reports no address to hand out", 1)
    served = (st.get("manifests") or {}).get("runs_served") or []
    warning = None
    if run_id not in served and st.get("run") != run_id:
        warning = (f"the node in {state_dir} does not hold run {run_id}: joiners will reach "
                   "it but must find the run's manifest elsewhere")
    ticket = tk.encode(run_id, st["peer_id"], addrs)
    if as_json:
        print_json({"ticket": ticket, "run_id": run_id, "peer_id": st["peer_id"],
                    "addrs": addrs, "warning": warning})
        return
    if warning:
        err.print(f"warning: {warning}", highlight=False, markup=False)
    print(ticket)


@run_app.command("show")
def run_show(
    manifest: Annotated[Path, typer.Argument(help="The run manifest (TOML).")],
    as_json: Json = False,
) -> None:
    """Print a manifest's canonical form and run-id without storing anything."""
    from protocols import manifest as mf

    m = checks.manifest_file(manifest)
    data = mf.canonical_bytes(m)
    if as_json:
        print_json({"run_id": mf.run_id(data), "manifest": json.loads(data)})
        return
    out.print_json(data.decode())
    print(mf.run_id(data))


@app.command()
def status(
    state_dir: StateDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output (with "
                                          "--watch: one JSON document per line).")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Redraw until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(
        "--interval", metavar="SECONDS", help="How often --watch asks the node.")] = 2.0,
) -> None:
    """Show what the local node is doing: run, peers, addresses, uptime."""
    from cli.render import node_status_table

    state_dir = state_dir or default_state_dir()
    if not watch:
        try:
            st = query_control(state_dir)
        except ControlUnavailable as e:
            raise fail(str(e)) from None
        if as_json:
            print(json.dumps(st, indent=2))
        else:
            out.print(node_status_table(st))
        return
    interval = checks.positive_seconds("--interval", interval)
    try:
        _watch_status(state_dir, interval, as_json)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_SIGINT) from None


def _watch_status(state_dir: Path, interval: float, as_json: bool) -> None:
    """Ask the node every `interval` s and redraw; a node that stops (or is not started
    yet) is a line in the view, not the end of the watch."""
    import time

    from rich.text import Text

    from cli.common import redrawn
    from cli.render import node_status_table

    def view() -> Any:
        try:
            st = query_control(state_dir)
        except ControlUnavailable as e:
            return None, Text(f"{e} (watching; Ctrl-C to stop)")
        return st, node_status_table(st)

    if as_json:
        while True:
            st, _ = view()
            print(json.dumps(st if st is not None else {"error": "no node answering"}),
                  flush=True)
            time.sleep(interval)
    with redrawn(out, view()[1]) as live:  # frames, not nothing, when piped
        while True:
            time.sleep(interval)
            live.update(view()[1])


from cli import bench_cmd, ckpt_cmd, logs_cmd, testnet_cmd  # noqa: E402  (sub-commands)

app.add_typer(testnet_cmd.app, name="testnet")
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(ckpt_cmd.app, name="ckpt")
app.add_typer(config_cmd.app, name="config")
app.command("logs")(logs_cmd.logs)
