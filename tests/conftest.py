"""Shared fixtures and helpers: real node processes on loopback, their control sockets, and
waiting for a condition with a deadline (no sleeps as synchronization).

Every test that starts node processes (a testnet, `node join`, a bench testnet) is marked
`@pytest.mark.slow`; `make test-fast` leaves those out. Deadlines in `wait_until` are upper
bounds for a loaded 2-core machine: a healthy run passes them long before, so they are
generous on purpose (a deadline never slows a passing test down)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio

from node.process.priority import SESSION_NICE_ENV
from node.status.control import query_control
from testnet import launcher

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """The test process's own settings. A hook, not module code: a node process imports
    test modules too (a test's model factory), and must not get these, least of all from
    its trainer thread, where signal.signal raises."""
    # Inherited by every node process a test starts (tests/data/loopback.toml says why).
    os.environ["PEERTRAIN_CONFIG"] = str(REPO / "tests" / "data" / "loopback.toml")
    # A pytest-xdist worker ignores SIGINT, and a child inherits an ignored signal: Python
    # in it would then never raise KeyboardInterrupt, and the tests that Ctrl-C a process
    # (a follower, a watcher, the launcher) would wait in vain. Children get the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The tests' own tensors are tiny: torch's intra-op threads only contend, and beside a
    # busy core (node processes, a CPU burner) two threads made tiny steps ~30x slower.
    # Node processes the tests start choose their own threads.
    torch.set_num_threads(1)
    # Training nodes leave their session's priority alone (node/process/priority.py): the
    # scenario tests' deadlines were set with every node's session equal to the others and
    # to the suite's own. With the testnets' trainers at nice 10 the SybilWall scenario
    # missed its deadline (ci94; ci95 with the suite's session at nice 10 too). The tests
    # of the session nice itself clear this for their own processes.
    os.environ[SESSION_NICE_ENV] = "0"


def feed_in_place(core: Any, feed: Callable[[memoryview], None], chunk: memoryview) -> list:
    """Give `chunk` to a sans-IO core (FrameDecoder, averaging.Exchange) as the lane's reader
    does: bytes go straight into `core.receive_buffer()` whenever it offers one, through
    `feed` otherwise. Returns the events that became ready."""
    from protocols.wire import NEED_DATA

    events = []
    view = memoryview(chunk)
    while view:
        buffer = core.receive_buffer()
        if buffer is None:
            feed(view)
            view = view[len(view) :]
        else:
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            core.received_into(n)
            view = view[n:]
        while (event := core.next_event()) is not NEED_DATA:
            events.append(event)
    return events


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.1) -> Any:
    """Poll a condition until it holds or the deadline passes (then fail, saying what)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


async def await_until(predicate: Callable[[], Any], timeout: float, what: str,
                      interval: float = 0.1) -> Any:
    """`wait_until` for trio tests: polls without blocking the test's own event loop."""
    deadline = trio.current_time() + timeout
    last = None
    while trio.current_time() < deadline:
        last = predicate()
        if last:
            return last
        await trio.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def status(p: launcher.Proc, cmd: str = "status") -> dict:
    """A node's control-socket answer to `cmd`, {} while it cannot answer (starting, busy,
    exiting): for polling inside `wait_until`."""
    try:
        return query_control(Path(p.state_dir), cmd) or {}
    except Exception:
        return {}


def answer(p: launcher.Proc, cmd: str = "status", timeout: float = 60) -> dict:
    """A node's control-socket answer, waiting (bounded) for one: a loaded node may take
    longer than query_control's own 3 s to answer once."""
    return wait_until(lambda: status(p, cmd), timeout, f"{p.name} to answer {cmd!r}")


def training(p: launcher.Proc) -> dict:
    """The `training` part of a node's status, {} when absent or unanswered."""
    return status(p).get("training") or {}


def peers(p: launcher.Proc) -> list[dict]:
    """The live peers a node has heard (its membership service), [] when unanswered."""
    return (status(p).get("membership") or {}).get("peers", [])


def members(p: launcher.Proc) -> list[dict]:
    """The run's members in a node's run document (its membership service)."""
    return (status(p).get("membership") or {}).get("members", [])


def nodes(net: launcher.Testnet) -> list[launcher.Proc]:
    """Every process of a testnet except its bootstrap."""
    return [p for p in net.procs if p.name != "bootstrap"]


def pipeline(p: launcher.Proc) -> dict:
    """The `pipeline` part of a node's status, {} when absent or unanswered."""
    return status(p).get("pipeline") or {}


def host_of(net: launcher.Testnet, stage: int) -> launcher.Proc | None:
    """A live node of `net` that hosts pipeline `stage`, None while none does."""
    return next((p for p in nodes(net) if launcher.alive(p.pid, p.state_dir)
                 and pipeline(p).get("stage") == stage), None)


def wait_for_ends_copy(holder: launcher.Proc, edge: int, step: int = 10) -> None:
    """Until `holder` keeps a copy of edge stage `edge`'s ends taken at `step` or later."""
    wait_until(lambda: (pipeline(holder).get("ends_copies") or {}).get(str(edge), -1) >= step,
               180, f"{holder.name}'s copy of stage {edge}'s ends, taken at step {step} or later")


@contextlib.contextmanager
def pipeline_testnet(directory: Path, stages: int, manifest: Path | None = None
                     ) -> Iterator[launcher.Testnet]:
    """`node testnet up --scenario pipeline` with 4 nodes over `stages` stages (a module
    fixture's testnet: built once, torn down after its last test)."""
    net = launcher.up(directory, 4, manifest=manifest or launcher.scenario_manifest_path(
        "pipeline"), detached=True, stages=stages, timeout=180)
    try:
        yield net
    finally:
        launcher.down(directory)


#: A run that trains fast on a loaded 2-core machine: a one-layer byte GPT of width 32,
#: NoLoCo every 100 steps. Tests write it (or a variant: `FAST_RUN.replace(...)`, `FAST_RUN +
#: "[checkpoint]..."`) as the manifest of their testnet or `node run create`.
FAST_RUN = """
schema = 1
[run]
name = "swarm-test"
[model]
task = "bytes-gpt"
d_model = 32
n_layers = 1
n_heads = 2
context = 32
[train]
batch_size = 8
lr = 3e-3
warmup_steps = 10
eval_every = 50
eval_batches = 2
[outer]
algorithm = "noloco"
inner_steps = 100
codec = "bf16"
"""


@pytest.fixture
def fast_manifest(tmp_path: Path) -> Path:
    """FAST_RUN written to a file: `testnet_factory(n, manifest=fast_manifest)`."""
    path = tmp_path / "fast.toml"
    path.write_text(FAST_RUN)
    return path


def pipeline_net(stages: int, manifest: Callable[[str], str] | None = None
                 ) -> Callable[..., Iterator[launcher.Testnet]]:
    """A module fixture for a file of pipeline tests, `net = pipeline_net(stages=4)`: one
    `pipeline_testnet` for all of the file's tests. `manifest` rewrites the pipeline
    scenario's manifest text first (another recovery rule, say)."""

    @pytest.fixture(scope="module")
    def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[launcher.Testnet]:
        directory = tmp_path_factory.mktemp(f"pipe{stages}")
        path = None
        if manifest is not None:
            path = directory / "manifest.toml"
            path.write_text(manifest(launcher.scenario_manifest_path("pipeline").read_text()))
        with pipeline_testnet(directory / "tn", stages=stages, manifest=path) as net:
            yield net

    return net


def shared_testnet(nodes: int, manifest: str | None = None, **kwargs: Any
                   ) -> Callable[..., Iterator[launcher.Testnet]]:
    """A module fixture, `net = shared_testnet(2)`: one testnet (`launcher.up(...,
    **kwargs)`) for all the tests of a file that only read it or leave it as they found it,
    instead of one each: a testnet's start and first rounds are most of such a test's time.
    `manifest`: the run's manifest text (FAST_RUN, say); the default run's otherwise."""

    @pytest.fixture(scope="module")
    def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[launcher.Testnet]:
        directory = tmp_path_factory.mktemp("shared")
        path = None
        if manifest is not None:
            path = directory / "manifest.toml"
            path.write_text(manifest)
        kwargs.setdefault("detached", True)
        try:
            yield launcher.up(directory / "tn", nodes, manifest=path, **kwargs)
        finally:
            launcher.down(directory / "tn")

    return net


@pytest.fixture
def nat_available() -> None:
    """Skips, saying why, where a testnet cannot build NAT gateways (no network namespaces,
    no root, no nftables): for the "home", "hard" and "cgnat" kinds."""
    from testnet import nat, netns

    reason = netns.available() or nat.missing_tools({"home"})
    if reason:
        pytest.skip(reason)


@pytest.fixture
def upnp_available(nat_available: None) -> None:
    """`nat_available`, and miniupnpd for the gateways that map ports ("upnp")."""
    from testnet import nat

    reason = nat.missing_tools({"upnp"})
    if reason:
        pytest.skip(reason)


def node_context(*, run: Any = None, config: dict[str, Any] | None = None,
                 **parts: Any) -> SimpleNamespace:
    """A stand-in for node.service.NodeContext holding only what the service under test
    reads: `parts` become its attributes (substrate, membership, checkpoints, ...), `config`
    its config's, and `run` (a RunContext or a SimpleNamespace of the fields read) is both
    `ctx.run` and what `ctx.the_run()` returns; `phases` is a fresh Phases unless given.
    What the test left out raises AttributeError, so a service that starts reading more
    fails loudly rather than on a default."""
    from node.service import Phases

    ctx = SimpleNamespace(**{"phases": Phases(), **parts}, run=run)
    if config is not None:
        ctx.config = SimpleNamespace(**config)

    def the_run() -> Any:
        if ctx.run is None:
            raise RuntimeError("this service needs a run; the test gave none")
        return ctx.run

    ctx.the_run = the_run
    return ctx


def run_cli(*args: str, timeout: float = 60, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`node ARGS` in a fresh `python -m cli` process: for commands that start nodes."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env, stdin=subprocess.DEVNULL)


_zygote: subprocess.Popen | None = None


def cli(*args: str, timeout: float = 60, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`node ARGS` in a process forked from one that has imported the CLI already
    (tests/cli_zygote.py): a process of its own per command, its exit status and output,
    without a second of imports each. For commands that end before a node starts."""
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
        # as a module: a script's folder (tests/) would go first on sys.path, and its
        # tests/node, tests/p2p, ... would shadow the packages they test
        _zygote = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote"],
                                   cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert _zygote.stdin is not None and _zygote.stdout is not None
    request = {"argv": list(args), "cwd": str(cwd), "timeout": timeout}
    _zygote.stdin.write(json.dumps(request) + "\n")
    _zygote.stdin.flush()
    answer = json.loads(_zygote.stdout.readline())
    return subprocess.CompletedProcess(["node", *args], answer["code"], answer["stdout"],
                                       answer["stderr"])


def pytest_unconfigure(config: pytest.Config) -> None:
    if _zygote is not None and _zygote.poll() is None:
        _zygote.stdin.close()  # type: ignore[union-attr]  # its loop ends, and it exits
        _zygote.wait(timeout=10)


LOG_DIGEST_LINES = 12  # per node: its last warnings and errors, then its last lines


def node_log_digest(root: Path) -> str:
    """The tail of every node.log under `root`, warnings first: what a failing CI run
    leaves to read once its temporary directories are gone."""
    out = []
    for log in sorted(root.rglob("node.log"))[:12]:
        lines = log.read_text(errors="replace").splitlines()
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        loud = [r for r in records if r.get("level") in ("warning", "error", "critical")]
        picked = loud[-LOG_DIGEST_LINES // 2:] + records[-LOG_DIGEST_LINES // 2:]
        start = records[0].get("ts", 0) if records else 0
        out.append(f"== {log.parent.relative_to(root)} ({len(records)} lines, "
                   f"{len(loud)} warnings or errors)")
        seen = set()
        for r in sorted(picked, key=lambda r: r.get("ts", 0)):
            key = (r.get("ts"), r.get("msg"))
            if key not in seen:
                seen.add(key)
                out.append(f"  +{r.get('ts', 0) - start:7.1f}s {r.get('level', '?'):7} "
                           f"{r.get('logger', '')}: {str(r.get('msg', ''))[:240]}")
    return "\n".join(out)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A failing test of node processes reports the tail of their logs (tests that keep
    their nodes under `tmp_path`: the testnet factory's), before teardown removes them."""
    report = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and isinstance(tmp, Path) and tmp.exists():
        with contextlib.suppress(OSError):
            digest = node_log_digest(tmp)
            if digest:
                report.sections.append(("node logs", digest))
    return report


@pytest.fixture
def testnet_factory(tmp_path: Path) -> Iterator[Callable[..., launcher.Testnet]]:
    """Start testnets under tmp_path; every one is torn down after the test."""
    started: list[Path] = []

    def start(nodes: int, name: str = "tn", **kwargs: Any) -> launcher.Testnet:
        directory = tmp_path / name
        started.append(directory)
        kwargs.setdefault("detached", True)
        return launcher.up(directory, nodes, **kwargs)

    yield start
    for directory in started:
        launcher.down(directory)


# Files that build network namespaces: never two at once (one kernel, one set of names).
NETNS_FILES = {"test_partition.py", "test_nat.py", "test_join_mdns.py",
               "test_bench_join_pull_partition.py", "test_nat_punch.py", "test_webrtc_nat.py",
               "test_reach_netns.py", "test_relay_duplicate_nat.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With pytest-xdist (`make test` and `make test-fast` run `-n 2 --dist loadgroup`):
    a file of node processes (slow, interop) runs on one worker, its tests one after the
    other, so its module fixtures (a testnet) are built once; the files that build network
    namespaces all share one group. So at most two files of node processes run at once,
    one per worker, which is what the suite's deadlines were measured with. In-process
    tests go one by one to whichever worker is free (a group of their own)."""
    for item in items:
        name = item.path.name
        nodes = any(item.iter_markers("slow")) or any(item.iter_markers("interop"))
        group = "netns" if name in NETNS_FILES else name if nodes else item.nodeid
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Refuse to run when --dist loadgroup would silently not group: pytest 9.2 ignores the
    way pytest-xdist 3.8 marks a test's group (pytest-dev/pytest-xdist#1386), and then two
    namespace testnets ran at once and a module's testnet was built twice (seen in CI)."""
    if node.config.getvalue("dist") == "loadgroup" and not all("@" in i for i in ids):
        pytest.exit("pytest-xdist's --dist loadgroup does not group tests with this pytest "
                    f"({pytest.__version__}; pytest-dev/pytest-xdist#1386): install "
                    "pytest<9.2, as pyproject.toml's test extra asks, or run without -n",
                    returncode=4)


async def serving_pair(nursery: trio.Nursery, protocol: str, handler: Callable[[Any], Any]
                       ) -> tuple[Any, Any, Any]:
    """Two real hosts on loopback, in this process: `node` serves `protocol` with
    `handler`; `other` is connected to it. Returns (node, other, node's peer ID)."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p.host import Substrate

    node = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    other = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    node.set_handler(protocol, handler)
    await nursery.start(node.serve)
    await nursery.start(other.serve)
    return node, other, await other.connect(node.addrs()[0])


def averager_pair(**kwargs: Any) -> tuple[list[Any], list[str], list[Any], Any]:
    """Two averaging services on two real hosts on loopback, each the other's partner in
    every round: (substrates, peer ids, averagers, the initiator: the smaller id, which
    dials and connects the lane). `kwargs` go to both Averagers (codecs=["fp32"] unless
    given)."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from node.averaging.service import Averager
    from p2p.host import Substrate

    kwargs = {"codecs": ["fp32"], "step_time": lambda: 0.01, "inner_steps": 1, **kwargs}
    subs = [Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    ids = [s.peer_id.to_base58() for s in subs]
    avgs = [Averager(s, "run", me, (lambda other=other: [other]), **kwargs)
            for s, me, other in zip(subs, ids, reversed(ids), strict=True)]
    return subs, ids, avgs, avgs[ids.index(min(ids))]


async def exchange_both(avgs: list[Any], r: int, vectors: list[Any]) -> list[Any]:
    """Round r's exchange on both averagers at once; their Outcomes."""
    outcomes: list[Any] = [None] * len(avgs)

    async def one(i: int) -> None:
        outcomes[i] = await avgs[i].exchange(r, vectors[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(avgs)):
            nursery.start_soon(one, i)
    return outcomes
