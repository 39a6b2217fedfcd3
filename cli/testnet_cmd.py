"""`node testnet up|down|status|logs|partition|heal|kill-stage|add-node`: a local
multi-node testnet."""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import checks
from cli.common import Json, err, fail, out, print_json, redrawn
from cli.logs_cmd import ProgressFold, last_lines
from cli.logs_cmd import render as render_log_line
from cli.render import testnet_table
from testnet import churn, launcher, nat, netns, swarm

app = typer.Typer(no_args_is_help=True, help="Run a local multi-node testnet on loopback "
                                              "(or in network namespaces, as root).")

AGGREGATORS = ("mean", "vc", "median", "krum", "foolsgold", "sybilwall")
NAT_DEFAULT = ("public", "fullcone", "home", "symmetric", "upnp")
Dir = Annotated[Path | None, typer.Option("--dir", help="Where the testnet keeps its state.")]
Page = Annotated[str | None, typer.Option(
    "--page", metavar="HOST:PORT", help="Serve the swarm page here. Default "
    f"{swarm.DEFAULT_HOST}:{swarm.DEFAULT_PORT} (a free port if taken).", show_default=False)]


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
    heartbeat_target: Annotated[float | None, typer.Option(
        help="Every node's `node join --heartbeat-target`: heartbeats a second each should "
             "receive at most (a large testnet on few cores).", show_default=False)] = None,
    scenario: Annotated[str | None, typer.Option(
        help="'sybil': --honest nodes plus one attacker with --sybils identities sending a "
             "poisoned model (docs/robustness.md). 'partition' (root): every process in a "
             "network namespace of its own, for `node testnet partition` and `heal`. "
             "'churn': SIGKILL and restart random nodes at --kill-rate (docs/operator.md). "
             "'nat' (root): a WAN with nodes behind NATs of --kinds (docs/nat.md). "
             "'pipeline': a GPT cut into --stages stages, --replicas nodes each "
             "(docs/pipeline.md).")]
    = None,
    stages: Annotated[int | None, typer.Option(
        help="pipeline scenario: stages (one transformer block each; default 4).")] = None,
    replicas: Annotated[int | None, typer.Option(
        help="pipeline scenario: nodes per stage (default 1); overrides --nodes.")] = None,
    honest: Annotated[int | None, typer.Option(help="sybil scenario: honest nodes.")] = None,
    sybils: Annotated[int, typer.Option(help="sybil scenario: the attacker's identities.")] = 4,
    attack: Annotated[str, typer.Option(help="sybil scenario: label-flip or backdoor.")]
    = "label-flip",
    aggregator: Annotated[str | None, typer.Option(
        help="Override aggregate.method: mean, vc, median, krum, foolsgold, sybilwall.")] = None,
    kill_rate: Annotated[float | None, typer.Option(
        help="churn scenario: kills per minute (default 2); never the bootstrap, at most a "
             "quarter of the nodes down at once.")] = None,
    duration: Annotated[float | None, typer.Option(
        help="churn scenario: seconds of churn (default 600); the testnet runs on after.")]
    = None,
    seed: Annotated[int | None, typer.Option(help="churn scenario: the schedule's seed (0).")]
    = None,
    poisson: Annotated[bool, typer.Option(
        "--poisson", help="churn scenario: Poisson kill times instead of a fixed interval.")]
    = False,
    kinds: Annotated[str | None, typer.Option(
        help="nat scenario: one kind per node, comma-separated, from public, fullcone, home, "
             "symmetric, upnp (default: public,fullcone,home,symmetric,upnp; overrides "
             "--nodes). The bootstrap is always public.")] = None,
    rate: Annotated[str | None, typer.Option(
        help="partition/nat scenario: every WAN link's rate both ways, e.g. 100mbit (tc tbf).")]
    = None,
    rtt: Annotated[str | None, typer.Option(
        help="partition/nat scenario: round-trip time added between any two namespaces, e.g. "
             "50ms (a userspace delay line in the router).")] = None,
    page: Page = None,
    no_page: Annotated[bool, typer.Option(
        "--no-page", help="Serve no swarm page.")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Once up, print the testnet (run, directory, bootstrap, swarm page) as "
        "one JSON document instead of the live table; an error as one JSON object on stderr."
        )] = False,
) -> None:
    """Start a bootstrap and N nodes, then show a live table and serve the swarm page (every
    node on one web page) until Ctrl-C."""
    directory = directory or launcher.default_dir()
    page_at = _page_addr(page, no_page, detach)
    extra = ["--no-train"] if no_train else []
    if heartbeat_target is not None:
        extra += ["--heartbeat-target", f"{checks.heartbeat_target(heartbeat_target):g}"]
    if scenario not in (None, "sybil", "partition", "churn", "nat", "pipeline"):
        raise fail(f"--scenario {scenario}: known scenarios: sybil, partition, churn, nat, "
                   "pipeline", 2)
    if scenario != "pipeline" and (stages is not None or replicas is not None):
        raise fail("--stages and --replicas apply to the pipeline scenario only: add "
                   "--scenario pipeline", 2)
    if scenario == "pipeline":
        stages, replicas = stages or 4, replicas or 1
        if not 2 <= stages <= 64 or not 1 <= replicas <= 16:
            raise fail(f"--stages {stages} --replicas {replicas}: expected 2..64 stages and "
                       "1..16 replicas", 2)
        nodes = stages * replicas
        manifest = manifest or launcher.scenario_manifest_path("pipeline")
    nat_kinds = _nat_kinds(scenario, kinds)
    if nat_kinds is not None:
        nodes = len(nat_kinds)
    rate = _rate(scenario, rate)
    rtt_ms = _rtt(scenario, rtt)
    churn_config = _churn_config(scenario, nodes, kill_rate, duration, seed, poisson)
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
    if scenario == "nat":
        manifest = manifest or launcher.scenario_manifest_path("partition")
        reason = netns.available() or nat.missing_tools(set(nat_kinds or ()))
        if reason:
            raise fail(f"--scenario nat builds NATs in network namespaces: {reason}", 2)
    if scenario == "churn":
        manifest = manifest or launcher.scenario_manifest_path("churn")
    if scenario == "sybil":
        nodes = honest if honest is not None else nodes
        manifest = manifest or launcher.scenario_manifest_path("sybil")
        if attack not in ("label-flip", "backdoor"):
            raise fail(f"--attack {attack}: expected label-flip or backdoor", 2)
    try:
        # --json: no spinner (stderr carries only an error, as one JSON object)
        spinning = contextlib.nullcontext(_Quiet()) if as_json else err.status(
            "starting the testnet")
        with spinning as spinner:
            net = launcher.up(directory, nodes, manifest=manifest, detached=detach,
                              extra_node_args=extra,
                              sybils=sybils if scenario == "sybil" else 0, attack=attack,
                              aggregator=aggregator, netns=scenario == "partition",
                              churn=churn_config, rate=rate, rtt_ms=rtt_ms,
                              stages=stages if scenario == "pipeline" else None,
                              nat={f"node{i}": k for i, k in enumerate(nat_kinds or [], 1)
                                   if k != "public"} if scenario == "nat" else None,
                              on_progress=lambda m: spinner.update(m))
    except launcher.TestnetError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    say = (lambda text: None) if as_json else (
        lambda text: err.print(text, markup=False, highlight=False))
    say(f"testnet up in {net.dir}: run {net.run_id}, bootstrap {net.bootstrap_addr}")
    if detach:
        if as_json:
            print_json(_up_doc(net, None))
        say("see every node on one page with `node testnet page`; stop it with "
            "`node testnet down`")
        return
    # Ctrl-C sets a flag instead of raising KeyboardInterrupt wherever the main thread is:
    # raised inside a status query or the table's rendering (likelier the busier the
    # machine) it could leave the launcher hung on exit (seen in full test runs).
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    page_thread = None
    try:
        page_url = None
        if page_at is not None:
            page_thread = swarm.PageThread(Path(net.dir), *page_at, fallback=page is None)
            try:
                page_url = page_thread.start()
            except swarm.PagePortError as e:
                raise fail(str(e), e.exit_code) from None
            say(f"swarm page {page_url}")
        if as_json:  # no table: the testnet runs until Ctrl-C
            print_json(_up_doc(net, page_url))
            while not stop.wait(1.0):
                pass
        else:
            _live_table(net, stop)
    finally:
        signal.signal(signal.SIGINT, previous)
        if page_thread is not None:
            page_thread.stop()
        churned = launcher.stop_churn(directory)
        stopped = launcher.down(directory)
        say(f"testnet down: {'stopped the churn, ' if churned else ''}"
            f"stopped {stopped} processes")


def _up_doc(net: launcher.Testnet, page_url: str | None) -> dict:
    """What `node testnet up --json` prints once the testnet is up."""
    return {"run": net.run_id, "dir": net.dir, "bootstrap": net.bootstrap_addr,
            "detached": net.detached, "page": page_url,
            "processes": [{"name": p.name, "pid": p.pid, "state_dir": p.state_dir}
                          for p in net.procs]}


class _Quiet:
    """The spinner's stand-in under --json."""

    def update(self, *_: object) -> None:
        pass


def _live_table(net: launcher.Testnet, stop: threading.Event) -> None:
    def view() -> Any:
        current = launcher.Testnet.load(Path(net.dir)) or net  # a churn changes pids
        return testnet_table(launcher.collect_status(current),
                             f"testnet {current.run_id} (Ctrl-C stops it)", width=out.width,
                             churn=churn.summary(churn.load_state(Path(current.dir))))

    with redrawn(out, view()) as live:  # frame after frame when piped
        while not stop.wait(1.0 if out.is_terminal else 5.0):
            live.update(view())


@app.command()
def down(directory: Dir = None, as_json: Json = False) -> None:
    """Stop every process of the testnet."""
    directory = directory or launcher.default_dir()
    churned = launcher.stop_churn(directory)
    stopped = launcher.down(directory)
    if as_json:
        print_json({"dir": str(directory), "stopped": stopped, "churn_stopped": churned})
        return
    if churned:
        err.print("stopped the churn")
    err.print(f"stopped {stopped} processes" if stopped else f"no testnet running in {directory}",
              markup=False, highlight=False)


@app.command()
def status(
    directory: Dir = None,
    as_json: Json = False,
) -> None:
    """Show each testnet process: phase, peers, connections."""
    net = _load(directory or launcher.default_dir())
    rows = launcher.collect_status(net)
    churning = churn.summary(churn.load_state(Path(net.dir)))
    page_url = swarm.served_url(Path(net.dir))
    if as_json:
        cut = (net.netns or {}).get("cut")
        print(json.dumps({"run": net.run_id, "dir": net.dir, "partition": cut,
                          "churn": churning, "page": page_url, "processes": rows}, indent=2))
    else:
        out.print(testnet_table(rows, f"testnet {net.run_id}", width=out.width, churn=churning))
        err.print(f"swarm page {page_url}" if page_url else
                  "swarm page: not served (`node testnet page` serves it)",
                  markup=False, highlight=False)


@app.command("page")
def page_cmd(
    directory: Dir = None,
    listen: Annotated[str | None, typer.Option(
        "--listen", metavar="HOST:PORT", help="Where to serve it. Default "
        f"{swarm.DEFAULT_HOST}:{swarm.DEFAULT_PORT} (a free port if taken).",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the URL as one JSON document once serving; an error as one "
        "JSON object on stderr.")] = False,
) -> None:
    """Serve the swarm page until Ctrl-C: every node of the testnet on one web page (phase,
    step, loss curves, peers and paths, rounds, checkpoints; nodes that are down marked)."""
    from cli.common import run_async

    host, port = _page_addr(listen, False, False, flag="--listen") or (None, None)
    assert host is not None and port is not None
    net = _load(directory or launcher.default_dir())
    swarm_page = swarm.SwarmPage(Path(net.dir))

    def show(url: str) -> None:
        if as_json:
            print_json({"url": url})
            return
        out.print(url, markup=False, highlight=False)
        err.print("serving the swarm page until Ctrl-C", markup=False, highlight=False)

    run_async(lambda: swarm_page.serve(host, port, fallback=listen is None, on_url=show))


def _page_addr(value: str | None, off: bool, detach: bool,
               flag: str = "--page") -> tuple[str, int] | None:
    """HOST:PORT of the swarm page (None: not served); a bad value is one line, exit 2."""
    from node.metrics.service import parse_address

    if off or detach:
        if value is not None:
            raise fail(f"{flag} serves the page of a foreground testnet: leave out "
                       f"{'--no-page' if off else '-d'}, or use `node testnet page`", 2)
        return None
    if value is None:
        return swarm.DEFAULT_HOST, swarm.DEFAULT_PORT
    try:
        return parse_address(value)
    except ValueError as e:
        raise fail(f"{flag} {value}: {e}", 2) from None


def _nat_kinds(scenario: str | None, kinds: str | None) -> list[str] | None:
    """The nat scenario's node kinds, in node order; a bad list is one line and exit 2."""
    if scenario != "nat":
        if kinds is not None:
            raise fail("--kinds applies to the nat scenario only: add --scenario nat", 2)
        return None
    names = [k.strip() for k in (kinds or ",".join(NAT_DEFAULT)).split(",") if k.strip()]
    known = ("public", *nat.KINDS)
    bad = [k for k in names if k not in known]
    if bad or not names:
        raise fail(f"--kinds {kinds}: expected a comma-separated list of {', '.join(known)}",
                   2)
    return names


def _rate(scenario: str | None, rate: str | None) -> str | None:
    if rate is None:
        return None
    if scenario not in ("partition", "nat"):
        raise fail("--rate applies to the partition and nat scenarios (network namespaces)", 2)
    if not re.fullmatch(r"[1-9][0-9]*(kbit|mbit|gbit)", rate):
        raise fail(f"--rate {rate}: expected a rate such as 100mbit, 500kbit or 1gbit", 2)
    return rate


def _rtt(scenario: str | None, rtt: str | None) -> float | None:
    if rtt is None:
        return None
    if scenario not in ("partition", "nat"):
        raise fail("--rtt applies to the partition and nat scenarios (network namespaces)", 2)
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)ms", rtt)
    if not m or not 0 < float(m[1]) <= 10_000:
        raise fail(f"--rtt {rtt}: expected milliseconds such as 50ms (at most 10000ms)", 2)
    return float(m[1])


def _churn_config(scenario: str | None, nodes: int, rate: float | None,
                  duration: float | None, seed: int | None,
                  poisson: bool) -> churn.ChurnConfig | None:
    """The churn scenario's settings, each bad value one line and exit 2."""
    if scenario != "churn":
        for flag, value in (("--kill-rate", rate), ("--duration", duration), ("--seed", seed),
                            ("--poisson", poisson or None)):
            if value is not None:
                raise fail(f"{flag} applies to the churn scenario only: add --scenario churn",
                           2)
        return None
    if nodes < 2:
        raise fail(f"--nodes {nodes}: the churn scenario needs at least 2 nodes", 2)
    rate = 2.0 if rate is None else rate
    if not (math.isfinite(rate) and rate > 0):
        raise fail(f"--kill-rate {rate:g}: expected kills per minute greater than 0", 2)
    duration = churn.DEFAULT_DURATION_S if duration is None else duration
    checks.positive_seconds("--duration", duration)
    if seed is not None and seed < 0:
        raise fail(f"--seed {seed}: expected 0 or more", 2)
    return churn.ChurnConfig(rate=rate, duration_s=duration, seed=seed or 0, poisson=poisson)


@app.command()
def logs(
    node: Annotated[str | None, typer.Argument(help="node1, node2, ... or bootstrap.")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n")] = 40,
    directory: Dir = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="JSON lines: each node.log record with a `node` field added; an "
        "error as one JSON object on stderr.")] = False,
    progress: Annotated[bool, typer.Option(
        "--progress", help="Every progress record (default: one a minute per node).")]
    = False,
) -> None:
    """Print the last log lines of one node, or of all of them."""
    if lines < 1:
        raise fail(f"--lines {lines}: expected at least 1", 2)
    net = _load(directory or launcher.default_dir())
    procs = [p for p in net.procs if node is None or p.name == node]
    if not procs:
        raise fail(f"no node named {node}; have {', '.join(p.name for p in net.procs)}")
    for p in procs:
        path = Path(p.state_dir) / "node.log"
        try:
            raw = last_lines(path, lines, None if progress else ProgressFold())[0]
        except OSError:  # not started far enough to log: its terminal output
            raw = None
        if as_json:
            for line in raw if raw is not None else launcher.tail(
                    Path(p.state_dir) / "stdout.log", lines).splitlines():
                print_json({"node": p.name, **_record(line)})
            continue
        out.rule(p.name)
        if raw is None:
            out.print(launcher.tail(Path(p.state_dir) / "stdout.log", lines), highlight=False,
                      markup=False)
            continue
        for line in raw:
            out.print(render_log_line(line), highlight=False, markup=False)


def _record(line: str) -> dict:
    """A node.log line as its record; any other line (stdout.log) as {"line": text}."""
    try:
        doc = json.loads(line)
    except ValueError:
        doc = None
    return doc if isinstance(doc, dict) else {"line": line}


@app.command()
def partition(
    side: Annotated[list[str] | None, typer.Argument(
        help="Nodes cut off from the rest (default: the second half of the nodes).")] = None,
    directory: Dir = None,
    as_json: Json = False,
) -> None:
    """Split a `--scenario partition` testnet in two: dials across fail, open links drop."""
    net = _load(directory or launcher.default_dir())
    try:
        a, b = launcher.partition(net, side)
    except launcher.TestnetError as e:
        raise fail(str(e)) from None
    if as_json:
        print_json({"sides": [a, b]})
        return
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


@app.command("kill-stage")
def kill_stage(
    stage: Annotated[int, typer.Argument(help="The pipeline stage whose every host dies.")],
    directory: Dir = None,
    no_replace: Annotated[bool, typer.Option(
        "--no-replace", help="Start no replacement node (the stage stays lost).")] = False,
    as_json: Json = False,
) -> None:
    """SIGKILL every host of a stage of a `--scenario pipeline` testnet, then start a
    replacement node that takes the stage and rebuilds it from its neighbours (CheckFree),
    with no human step (docs/pipeline.md)."""
    net = _load(directory or launcher.default_dir())
    try:
        killed, new = launcher.kill_stage(net, stage, replace=not no_replace)
    except launcher.TestnetError as e:
        raise fail(str(e)) from None
    if as_json:
        print_json({"stage": stage, "killed": killed, "replacement": new})
        return
    err.print(f"killed stage {stage}: {' '.join(killed)}"
              + (f"; {new} joins to recover it" if new else ""), markup=False)


@app.command("add-node")
def add_node(
    directory: Dir = None,
    stage: Annotated[int | None, typer.Option(
        help="pipeline testnets: the stage the node is meant for; refused unless it is the "
             "stage a joiner takes (the one with the fewest live hosts).")] = None,
    as_json: Json = False,
) -> None:
    """Start one more node on a running testnet (a pipeline joiner takes the stage with the
    fewest live hosts); `testnet status` lists it and `testnet down` stops it."""
    net = _load(directory or launcher.default_dir())
    try:
        proc, takes = launcher.grow(net, stage)
    except launcher.TestnetError as e:
        raise fail(str(e)) from None
    if as_json:
        print_json({"name": proc.name, "pid": proc.pid, "state_dir": proc.state_dir,
                    "stage": takes})
        return
    err.print(f"{proc.name} joins run {net.run_id}"
              + (f"; it takes stage {takes}" if takes is not None else ""),
              markup=False, highlight=False)
