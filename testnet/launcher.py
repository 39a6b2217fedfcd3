"""A local testnet: one bootstrap and N node processes on loopback, each with a state dir.

The testnet's directory holds `testnet.json` (who runs where, with which pid) and one
state directory per process. Nothing is left behind:

* `down` sends SIGTERM to every process group it started, then SIGKILL after a deadline;
* in the foreground, children get PR_SET_PDEATHSIG, so the kernel kills them if the
  launcher dies (even by SIGKILL); detached testnets (`-d`) outlive the launcher on purpose.

With `netns=True` (root only) every process runs in a network namespace of its own behind
one router (testnet/netns.py), so `partition` can cut the testnet in two and `heal` can
join it again; `down` deletes the namespaces, and so does the next `up` in the same
directory if a crashed launcher left them behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import platformdirs

from node.files import atomic_write
from node.run.store import RunStore
from node.status.control import NETNS_ENV, ControlUnavailable, query_control
from protocols import manifest as mf
from testnet import churn as churn_mod
from testnet import nat as nat_mod
from testnet import netns as ns
from testnet.churn import ChurnConfig, Kill, kill_schedule
from testnet.dirlock import DirLocked, locked

STATE_FILE = "testnet.json"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
T = TypeVar("T")
EXIT_WAIT_S = 10.0  # restart_node: how long a just-killed node may take to be gone
# What one node process takes, measured (docs/operator.md, "How many nodes"): RSS of a
# training node of the default manifest, and its threads (trio workers, zeroconf, torch).
NODE_MB = 500  # measured: 468 MB (2026-11-27, default manifest, 30 s in)
NODE_THREADS = 24  # measured: 6 at rest; trio worker threads come and go
NODES_PER_CPU = 16  # a stated bound, not a measurement: a node at rest takes ~5% of a core


class TestnetError(Exception):
    """Something a user of `node testnet` must know about; the message says what."""

    __test__ = False  # not a pytest class


def default_dir() -> Path:
    return Path(platformdirs.user_state_dir("peertrain", appauthor=False)) / "testnet"


@dataclass
class Proc:
    name: str
    state_dir: str
    pid: int
    args: list[str] = field(default_factory=list)


@dataclass
class Testnet:
    dir: str
    run_id: str
    bootstrap_addr: str
    procs: list[Proc]
    detached: bool
    launcher_pid: int
    netns: dict[str, Any] | None = None  # testnet/netns.py Topology, when namespaced
    churn_pid: int | None = None  # the churn driver (testnet/churn.py), while one runs
    # `up`'s extra node flags (--no-train): a node added later (add-node, a kill-stage
    # replacement) joins as the others did
    node_args: list[str] = field(default_factory=list)

    def save(self) -> None:
        atomic_write(Path(self.dir) / STATE_FILE, json.dumps(asdict(self), indent=2).encode())

    @classmethod
    def load(cls, directory: Path) -> Testnet | None:
        try:
            doc = json.loads((Path(directory) / STATE_FILE).read_text())
        except FileNotFoundError:
            return None
        doc["procs"] = [Proc(**p) for p in doc["procs"]]
        return cls(**doc)

    def refresh(self) -> None:
        """Read testnet.json again (under the directory's lock): another command may have
        started or replaced processes since this object was loaded."""
        fresh = Testnet.load(Path(self.dir))
        if fresh is not None:
            vars(self).update(vars(fresh))


def capacity() -> tuple[int, str]:
    """How many node processes this machine holds, and how that is derived: the least of
    available memory / NODE_MB, free process slots (RLIMIT_NPROC) / NODE_THREADS, and
    NODES_PER_CPU per CPU."""
    import resource

    cpus = os.cpu_count() or 1
    try:
        meminfo = Path("/proc/meminfo").read_text()
        avail_mb = int(next(line.split()[1] for line in meminfo.splitlines()
                            if line.startswith("MemAvailable:"))) // 1024
    except (OSError, StopIteration, ValueError):
        avail_mb = 4096
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    slots = soft if soft != resource.RLIM_INFINITY else 1 << 20
    bounds = {f"{avail_mb} MB available / {NODE_MB} MB per node": avail_mb // NODE_MB,
              f"{slots} processes allowed / {NODE_THREADS} threads per node":
                  slots // NODE_THREADS,
              f"{cpus} CPUs x {NODES_PER_CPU}": cpus * NODES_PER_CPU}
    why, n = min(bounds.items(), key=lambda kv: kv[1])
    return max(n, 1), why


def batch_size() -> int:
    """Processes started at once: each imports Python, libp2p and torch (1-3 CPU s), so
    hundreds at once starve each other past every start-up deadline."""
    return max(8, 4 * (os.cpu_count() or 1))


def testnet_manifest(m: mf.Manifest, directory: Path) -> mf.Manifest:
    """`m` with its run name tagged with the testnet's directory, so that two testnets on
    one machine train two runs (two run-ids) and never merge through mDNS or a joiner that
    knows both: a run-id names a run, and two testnets are two runs. The same directory
    gives the same run-id again, so a testnet brought up again resumes its checkpoints."""
    import hashlib

    tag = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:8]
    doc = m.model_dump(by_alias=True)
    doc["run"] = {**doc["run"], "name": f"{m.run.name[:55]}.{tag}"}
    return mf.Manifest.model_validate(doc)


@contextlib.contextmanager
def _locked(net: Testnet) -> Iterator[None]:
    """The testnet directory's lock (testnet/dirlock.py), with `net` read again under it."""
    try:
        with locked(Path(net.dir), on_wait=lambda msg: print(msg, file=sys.stderr, flush=True)):
            net.refresh()
            yield
    except DirLocked as e:
        raise TestnetError(str(e)) from None


def _serialized(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn(net, ...)` under the testnet directory's lock, `net` read again first: every
    command that starts, stops or records processes (testnet/dirlock.py)."""
    @functools.wraps(fn)
    def wrapper(net: Testnet, *args: Any, **kwargs: Any) -> T:
        with _locked(net):
            return fn(net, *args, **kwargs)
    return wrapper


def default_manifest_path() -> Path:
    return Path(str(resources.files("testnet") / "default_manifest.toml"))


def scenario_manifest_path(scenario: str) -> Path:
    """The run a scenario trains (testnet/<scenario>_manifest.toml)."""
    return Path(str(resources.files("testnet") / f"{scenario}_manifest.toml"))


def _pdeathsig() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def alive(pid: int, state_dir: str | None = None) -> bool:
    """True if `pid` runs and (when given) is the node for `state_dir`: pids get reused."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":  # a zombie: exited, not yet reaped
        return False
    if cmdline == [b""]:  # in the middle of an exec (`ip netns exec` execs the node)
        return True
    return state_dir is None or state_dir.encode() in cmdline


def _spawn(name: str, state_dir: Path, args: list[str], detached: bool,
           env: dict[str, str], topo: ns.Topology | None = None) -> Proc:
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "cli", *args, "--state-dir", str(state_dir)]
    if topo is not None:  # in its namespace, listening on its own address there
        argv = [*topo.exec_prefix(name), *(topo.listen(name) if a == LOOPBACK else a
                                           for a in argv)]
        env = {**env, NETNS_ENV: topo.ns(name)}
    log = open(state_dir / "stdout.log", "ab")  # noqa: SIM115 - handed to the child
    # A session of its own: Ctrl-C at the terminal does not reach it, `down` signals its
    # group, and under Linux's autogroup scheduling each node gets an equal share of the
    # CPU, as separate machines would; a node that trains lowers its session's priority
    # (node/process/priority.py), so a joiner goes first. Tried on 2026-11-26: every node in the
    # launcher's session changed which node outpaces which, and the sybil and pipeline
    # scenario tests failed in 2 of 3 runs (docs/architecture.md, "Testnet").
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True, env=env,
                             preexec_fn=None if detached else _pdeathsig)
    except OSError as e:  # fork's EAGAIN (process limit), ENOMEM: one line, then `down`
        raise TestnetError(f"cannot start {name}: {e.strerror or e}") from None
    finally:
        log.close()
    return Proc(name, str(state_dir), p.pid, args)


def _wait_for(predicate, timeout: float, what: str, procs: list[Proc]) -> Any:
    """Poll `predicate` until it returns a value; fail early if a process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if not alive(p.pid, p.state_dir):
                raise TestnetError(f"{p.name} exited while waiting for {what}:\n"
                                   + tail(Path(p.state_dir) / "stdout.log", 15))
        time.sleep(0.1)
    raise TestnetError(f"timed out after {timeout:g} s waiting for {what}")


def tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def up(directory: Path, nodes: int, *, manifest: Path | None = None, detached: bool = False,
       extra_node_args: list[str] | None = None, timeout: float = 60.0,
       sybils: int = 0, attack: str | None = None, aggregator: str | None = None,
       netns: bool = False, neighbours: dict[str, list[str]] | None = None,
       churn: ChurnConfig | None = None, nat: dict[str, str] | None = None,
       rate: str | None = None, rtt_ms: float | None = None,
       stages: int | None = None, on_progress=lambda msg: None) -> Testnet:
    """Start a bootstrap and `nodes` nodes; return once every node is running.

    With `sybils` > 0, one attacker joins too with that many identities (`sybil1`, ...), all
    training the same poisoned model (`attack`); `aggregator` overrides the manifest's
    aggregate.method (docs/robustness.md). `netns`: each process in a network namespace of
    its own (root only), for `partition` and `heal`. `neighbours` fixes who exchanges with
    whom every round, by process name (`{"node1": ["sybil1", "sybil2"]}`; the relation is
    made symmetric), instead of the run's random pairing: a scenario whose outcome depends
    on who meets whom becomes deterministic. Processes not named keep the run's pairing.
    `churn`: once every node runs, start killing and restarting nodes (testnet/churn.py).
    `nat` (implies `netns`): node name -> NAT kind (testnet/nat.py) for nodes behind a NAT
    gateway; the rest and the bootstrap are public. `rate` shapes every WAN link (tc tbf);
    `rtt_ms` adds that round-trip time between any two namespaces (testnet/delay.py).
    `stages`: the manifest's pipeline is cut into that many stages of one block each
    (pipeline_stages); the nodes place themselves, one stage each (docs/pipeline.md).
    """
    if nodes < 1:
        raise TestnetError("--nodes must be at least 1")
    if sybils and attack not in ("label-flip", "backdoor"):
        raise TestnetError("sybils need an attack: label-flip or backdoor")
    most, why = capacity()
    if nodes + sybils + 1 > most:  # and the bootstrap
        raise TestnetError(f"--nodes {nodes}: this machine holds at most {most} node "
                           f"processes with the bootstrap ({why}); start fewer")
    directory = Path(directory).resolve()
    try:
        with locked(directory, on_wait=on_progress):
            return _up(directory, nodes, manifest=manifest, detached=detached,
                       extra_node_args=extra_node_args, timeout=timeout, sybils=sybils,
                       attack=attack, aggregator=aggregator, netns=netns,
                       neighbours=neighbours, churn=churn, nat=nat, rate=rate, rtt_ms=rtt_ms,
                       stages=stages, on_progress=on_progress)
    except DirLocked as e:
        raise TestnetError(str(e)) from None


def _up(directory: Path, nodes: int, *, manifest: Path | None, detached: bool,
        extra_node_args: list[str] | None, timeout: float, sybils: int, attack: str | None,
        aggregator: str | None, netns: bool, neighbours: dict[str, list[str]] | None,
        churn: ChurnConfig | None, nat: dict[str, str] | None, rate: str | None,
        rtt_ms: float | None, stages: int | None, on_progress) -> Testnet:
    existing = Testnet.load(directory)
    if existing and any(alive(p.pid, p.state_dir) for p in existing.procs):
        raise TestnetError(f"a testnet is already running in {directory}; "
                           "run `node testnet down` first")
    directory.mkdir(parents=True, exist_ok=True)
    try:
        m = mf.load_manifest_file(manifest or default_manifest_path())
    except mf.ManifestError as e:
        raise TestnetError(str(e)) from e
    if aggregator is not None:
        try:
            m = mf.Manifest.model_validate({**m.model_dump(by_alias=True),
                                            "aggregate": {**m.aggregate.model_dump(),
                                                          "method": aggregator}})
        except ValueError as e:
            raise TestnetError(f"--aggregator {aggregator}: {e}") from e
    if stages is not None:
        m = pipeline_stages(m, stages)
    m = testnet_manifest(m, directory)
    # Before anything starts: a topology naming processes we will not start is refused.
    fixed = _neighbour_args(directory, [*(f"node{i}" for i in range(1, nodes + 1)),
                                        *(f"sybil{i}" for i in range(1, sybils + 1))],
                            neighbours or {})
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    boot_dir = directory / "bootstrap"
    run_id = RunStore(boot_dir).put(mf.canonical_bytes(m))
    (boot_dir / "addrs.json").unlink(missing_ok=True)
    procs: list[Proc] = []
    net = Testnet(str(directory), run_id, "", procs, detached, os.getpid(),
                  node_args=list(extra_node_args or []))
    topo = None
    try:
        if netns or nat:
            reason = ns.available()
            if reason:
                raise TestnetError(f"cannot place nodes in network namespaces: {reason}")
            on_progress("creating network namespaces")
            names = ["bootstrap", *(f"node{i}" for i in range(1, nodes + 1)),
                     *(f"sybil{i}" for i in range(1, sybils + 1))]
            try:
                if nat:
                    topo = nat_mod.create(ns.tag_for(str(directory)), names, nat, rate=rate,
                                          rtt_ms=rtt_ms, workdir=str(directory),
                                          detached=detached)
                else:
                    topo = ns.create(ns.tag_for(str(directory)), names, rate=rate,
                                     rtt_ms=rtt_ms, workdir=str(directory), detached=detached)
            except ns.NetnsError as e:
                raise TestnetError(f"cannot create the network namespaces: {e}") from e
            net.netns = topo.to_json()
            net.save()
        on_progress("starting the bootstrap")
        procs.append(_spawn("bootstrap", boot_dir, ["bootstrap", "--listen", LOOPBACK],
                            detached, env, topo))
        net.save()
        addrs = _wait_for(lambda: _read_addrs(boot_dir), timeout, "the bootstrap to listen", procs)
        net.bootstrap_addr = addrs[0]
        on_progress(f"starting {nodes} nodes on run {run_id}")
        joins = [(f"node{i}", [*(extra_node_args or []), *fixed.get(f"node{i}", [])])
                 for i in range(1, nodes + 1)]
        joins += [(f"sybil{i}", ["--attack", str(attack), *fixed.get(f"sybil{i}", [])])
                  for i in range(1, sybils + 1)]
        batch = batch_size()
        for start in range(0, len(joins), batch):
            started = []
            for name, args in joins[start:start + batch]:
                d = directory / name
                (d / "addrs.json").unlink(missing_ok=True)
                started.append(_spawn(name, d, ["join", run_id, "--bootstrap",
                                                net.bootstrap_addr, "--listen", LOOPBACK, *args],
                                      detached, env, topo))
                procs.append(started[-1])
                net.save()  # each pid recorded as it starts: `down` finds every one
            if start + batch < len(joins):
                on_progress(f"started {len(procs) - 1} of {len(joins)} nodes")
                _wait_for(lambda s=started: all(_read_addrs(Path(p.state_dir)) for p in s),
                          timeout, f"nodes {started[0].name}..{started[-1].name} to listen",
                          started)
        _wait_for(lambda: all(_phase(p) == "running" for p in procs), timeout,
                  "every node to join the run", procs)
        if churn is not None:
            on_progress("starting the churn")
            start_churn(net, churn)
    except BaseException:
        down(directory)
        raise
    return net


def pipeline_stages(m: mf.Manifest, stages: int) -> mf.Manifest:
    """`m` with its [pipeline] cut into `stages` stages of one transformer block each."""
    if m.pipeline is None:
        raise TestnetError("--stages needs a manifest with a [pipeline] section")
    doc = m.model_dump(by_alias=True)
    doc["model"] = {**doc["model"], "n_layers": stages}
    doc["pipeline"] = {**doc["pipeline"], "stages": stages, "layers": []}
    if stages < 3:  # no interior stage to rebuild: CheckFree does not apply
        doc["pipeline"]["recovery"] = "none"
    try:
        return mf.Manifest.model_validate(doc)
    except ValueError as e:
        raise TestnetError(f"--stages {stages}: {e}") from e


def _pipelines(net: Testnet) -> Iterator[tuple[Proc, dict[str, Any]]]:
    """(process, its pipeline status) for each live node that answers and hosts a stage."""
    for p in net.procs:
        if p.name == "bootstrap" or not alive(p.pid, p.state_dir):
            continue
        try:
            st = query_control(Path(p.state_dir), timeout=2.0)
        except (ControlUnavailable, ValueError):
            continue
        pipe = st.get("pipeline") or {}
        if isinstance(pipe.get("stage"), int) and isinstance(pipe.get("stages"), int):
            yield p, pipe


def stage_hosts(net: Testnet, stage: int) -> list[Proc]:
    """The live processes that report hosting `stage` (their control socket's status)."""
    return [p for p, pipe in _pipelines(net) if pipe["stage"] == stage]


def stage_counts(net: Testnet) -> list[int] | None:
    """Live hosts per stage, as the testnet's nodes report them; None: no node hosts a
    stage (not a pipeline run, or none has chosen yet)."""
    counts: list[int] | None = None
    for _, pipe in _pipelines(net):
        counts = counts or [0] * pipe["stages"]
        if 0 <= pipe["stage"] < len(counts):
            counts[pipe["stage"]] += 1
    return counts


def next_name(net: Testnet) -> str:
    """The first `nodeN` this testnet has not used (N from the process count up)."""
    names = {p.name for p in net.procs}
    n = len(net.procs)
    while f"node{n}" in names:
        n += 1
    return f"node{n}"


@_serialized
def grow(net: Testnet, stage: int | None = None) -> tuple[Proc, int | None]:
    """`node testnet add-node`: one more node joins the running testnet, named under the
    directory's lock (two at once get two names). Returns it and, in a pipeline run, the
    stage it will take: placement gives a joiner the stage with the fewest live hosts
    (node/pipe/placement.py), and nodes take no orders, so `stage` is checked against that
    rather than imposed."""
    if not any(alive(p.pid, p.state_dir) for p in net.procs):
        raise TestnetError(f"no testnet running in {net.dir}; start one with "
                           "`node testnet up`")
    counts = stage_counts(net)
    takes = None
    if counts is not None:
        from node.pipe.placement import choose

        takes = choose({f"{s}/{i}": s for s, c in enumerate(counts) for i in range(c)},
                       len(counts))
    if stage is not None:
        if counts is None:
            raise TestnetError(f"--stage {stage}: no node of this testnet hosts a pipeline "
                               "stage (start one with `--scenario pipeline`)")
        if not 0 <= stage < len(counts):
            raise TestnetError(f"--stage {stage}: this pipeline has stages 0 to "
                               f"{len(counts) - 1}")
        if stage != takes:
            raise TestnetError(f"--stage {stage}: a joiner takes the stage with the fewest "
                               f"live hosts, stage {takes} ({counts[takes]} hosts) now, not "
                               f"stage {stage} ({counts[stage]})")
    return add_node(net, next_name(net)), takes


@_serialized
def kill_stage(net: Testnet, stage: int, *, replace: bool = True, timeout: float = 60.0
               ) -> tuple[list[str], str | None]:
    """SIGKILL every host of `stage`; once a surviving node's view has lost them (its
    heartbeat ttl), start a replacement node, which takes the empty stage and recovers it
    (docs/pipeline.md). Returns (the killed, the replacement's name). Under the testnet
    directory's lock: a second kill-stage waits, then names its replacement afresh."""
    hosts = stage_hosts(net, stage)
    if not hosts:
        raise TestnetError(f"no live process hosts stage {stage} (is this a `--scenario "
                           "pipeline` testnet?)")
    ids = set()
    for p in hosts:
        with contextlib.suppress(ControlUnavailable, ValueError):
            ids.add(query_control(Path(p.state_dir), timeout=2.0)["peer_id"])
        kill_node(net, p.name)
    survivors = [p for p in net.procs if p.name != "bootstrap" and p not in hosts
                 and alive(p.pid, p.state_dir)]
    if not replace:
        return [p.name for p in hosts], None

    def gone() -> bool:
        for p in survivors:
            try:
                st = query_control(Path(p.state_dir), timeout=2.0)
            except (ControlUnavailable, ValueError):
                continue
            live = {e["peer_id"] for e in (st.get("membership") or {}).get("peers", [])}
            return not live & ids
        return True
    _wait_for(gone, timeout, f"stage {stage}'s hosts to leave the survivors' view", [])
    return [p.name for p in hosts], add_node(net, next_name(net)).name


def symmetric(neighbours: dict[str, list[str]]) -> dict[str, list[str]]:
    """The neighbour relation made symmetric: b in a's list puts a in b's."""
    out: dict[str, set[str]] = {}
    for a, bs in neighbours.items():
        for b in bs:
            if a != b:
                out.setdefault(a, set()).add(b)
                out.setdefault(b, set()).add(a)
    return {a: sorted(bs) for a, bs in sorted(out.items())}


def _neighbour_args(directory: Path, names: list[str],
                    neighbours: dict[str, list[str]]) -> dict[str, list[str]]:
    """`--neighbour <peer id>` flags per process name. Peer ids are known before anything
    starts: each named process's identity is created in its state directory now."""
    relation = symmetric(neighbours)
    unknown = sorted(set(relation) - set(names))
    if unknown:
        raise TestnetError(f"neighbours name processes this testnet does not have: {unknown}")
    if not relation:
        return {}
    from p2p.identity import load_or_create_identity, peer_id_of

    ids = {name: peer_id_of(load_or_create_identity(directory / name)) for name in relation}
    return {name: [arg for b in bs for arg in ("--neighbour", ids[b])]
            for name, bs in relation.items()}


def _read_addrs(state_dir: Path) -> list[str] | None:
    try:
        return json.loads((state_dir / "addrs.json").read_text())["addrs"] or None
    except (OSError, ValueError, KeyError):
        return None


def _phase(p: Proc) -> str | None:
    try:
        return query_control(Path(p.state_dir), timeout=1.0)["phase"]
    except (ControlUnavailable, ValueError, KeyError):
        return None


def collect_status(net: Testnet) -> list[dict[str, Any]]:
    rows = []
    for p in net.procs:
        row: dict[str, Any] = {"name": p.name, "pid": p.pid, "state_dir": p.state_dir}
        if not alive(p.pid, p.state_dir):
            row["error"] = "exited"
        else:
            try:
                row["status"] = query_control(Path(p.state_dir), timeout=1.0)
            except ControlUnavailable as e:
                row["error"] = "starting" if "no node" in str(e) else "not answering"
        rows.append(row)
    return rows


@_serialized
def start_churn(net: Testnet, config: ChurnConfig) -> list[Kill]:
    """Start the churn driver (testnet/churn.py) on this testnet; returns its schedule.

    The bootstrap is never on the schedule. The driver's pid is in testnet.json before it
    starts (it waits for a `go` on stdin), so `down` always finds it."""
    if net.churn_pid is not None and alive(net.churn_pid):
        raise TestnetError("a churn is already running on this testnet")
    names = [p.name for p in net.procs if p.name != "bootstrap"]
    if len(names) < 2:
        raise TestnetError("churn needs at least 2 nodes")
    schedule = kill_schedule(names, config.rate, config.duration_s, config.seed,
                             config.poisson)
    state = churn_mod.new_state(config, schedule, len(names))
    atomic_write(Path(net.dir) / churn_mod.STATE_FILE, json.dumps(state, indent=1).encode())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(Path(net.dir) / "churn.log", "ab")  # noqa: SIM115 - handed to the child
    p = subprocess.Popen([sys.executable, "-m", "testnet.churn_driver", net.dir],
                         stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True, env=env,
                         preexec_fn=None if net.detached else _pdeathsig)
    log.close()
    net.churn_pid = p.pid
    net.save()
    assert p.stdin is not None
    p.stdin.write(b"go\n")
    p.stdin.close()
    return schedule


def stop_churn(directory: Path, timeout: float = 10.0) -> bool:
    """Stop the churn driver, if one runs: SIGTERM (it stops between two actions), then
    SIGKILL after `timeout`. True if one was running."""
    net = Testnet.load(Path(directory).resolve())
    pid = net.churn_pid if net else None
    if pid is None or not alive(pid, "testnet.churn_driver"):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive(pid, "testnet.churn_driver"):
        _reap()
        time.sleep(0.05)
    if alive(pid, "testnet.churn_driver"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _reap()
    return True


def down(directory: Path, timeout: float = 10.0) -> int:
    """Stop every process of the testnet; returns how many were running (nodes, bootstrap).

    A churn driver is stopped first, so that it restarts nothing while the nodes stop;
    before the directory's lock, which a restart of the driver's may be waiting for (it
    obeys SIGTERM between two actions)."""
    stop_churn(directory)
    try:
        with locked(Path(directory)):
            return _down(directory, timeout)
    except DirLocked as e:
        raise TestnetError(str(e)) from None


def _down(directory: Path, timeout: float) -> int:
    stop_churn(directory)
    net = Testnet.load(Path(directory).resolve())  # (again: the churn changes pids)
    if net is None:  # namespaces a launcher left before it could record them
        ns.destroy(ns.Topology(ns.tag_for(str(Path(directory).resolve()))))
        return 0
    running = [p for p in net.procs if alive(p.pid, p.state_dir)]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p.pid, p.state_dir) for p in running):
        _reap()
        time.sleep(0.05)
    for p in running:
        if alive(p.pid, p.state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    _reap()
    if net.netns:
        ns.destroy(ns.Topology.from_json(net.netns))
    ns.destroy(ns.Topology(ns.tag_for(net.dir)))  # also any a crashed `up` left unrecorded
    (Path(net.dir) / STATE_FILE).unlink(missing_ok=True)
    return len(running)


def _reap() -> None:
    """Collect our own exited children so they do not linger as zombies."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def kill_node(net: Testnet, name: str, sig: int = signal.SIGKILL) -> Proc:
    for p in net.procs:
        if p.name == name:
            os.killpg(p.pid, sig)
            return p
    raise TestnetError(f"no process named {name} in this testnet")


@_serialized
def restart_node(net: Testnet, name: str) -> Proc:
    """Start a (killed) node again with its same state directory: same identity. A node
    SIGKILLed a moment ago gets up to EXIT_WAIT_S to be gone (the signal is asynchronous:
    `kill-stage` then a restart raced it)."""
    for i, p in enumerate(net.procs):
        if p.name == name:
            deadline = time.monotonic() + EXIT_WAIT_S
            while alive(p.pid, p.state_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
            if alive(p.pid, p.state_dir):
                raise TestnetError(f"{name} is still running")
            (Path(p.state_dir) / "addrs.json").unlink(missing_ok=True)
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
            new = _spawn(name, Path(p.state_dir), p.args, net.detached, env, topology(net))
            net.procs[i] = new
            net.save()
            return new
    raise TestnetError(f"no process named {name} in this testnet")


@_serialized
def add_node(net: Testnet, name: str, extra_args: list[str] | None = None) -> Proc:
    """Start one more node joining the run (a late joiner); returns at once."""
    if any(p.name == name for p in net.procs):
        raise TestnetError(f"{name} is already part of this testnet")
    topo = topology(net)
    if topo is not None:
        try:
            ns.add(topo, name)
        except ns.NetnsError as e:
            raise TestnetError(f"cannot give {name} a network namespace: {e}") from e
        finally:
            net.netns = topo.to_json()
            net.save()
    d = Path(net.dir) / name
    (d / "addrs.json").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = _spawn(name, d, ["join", net.run_id, "--bootstrap", net.bootstrap_addr,
                            "--listen", LOOPBACK, *net.node_args, *(extra_args or [])],
                  net.detached, env, topo)
    net.procs.append(proc)
    net.save()
    return proc


def topology(net: Testnet) -> ns.Topology | None:
    return ns.Topology.from_json(net.netns) if net.netns else None


@_serialized
def partition(net: Testnet, side: list[str] | None = None) -> list[list[str]]:
    """Cut the testnet in two: `side` (default: the second half of the nodes) against the
    rest. Dials across fail at once and open connections across are aborted."""
    topo = topology(net)
    if topo is None:
        raise TestnetError("this testnet has no network namespaces; start it with "
                           "`node testnet up --scenario partition` (as root)")
    if not side:
        nodes = [p.name for p in net.procs if p.name != "bootstrap"]
        side = nodes[(len(nodes) + 1) // 2:]
    try:
        cut = ns.partition(topo, side)
    except ns.NetnsError as e:
        raise TestnetError(str(e)) from e
    finally:  # a half-made cut is recorded too, so that `heal` removes it
        net.netns = topo.to_json()
        net.save()
    return cut


@_serialized
def heal(net: Testnet) -> None:
    """Undo `partition`: every namespace reaches every other again."""
    topo = topology(net)
    if topo is None:
        raise TestnetError("this testnet has no network namespaces to heal")
    ns.heal(topo)
    net.netns = topo.to_json()
    net.save()
