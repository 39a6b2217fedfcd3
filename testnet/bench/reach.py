"""The reachability matrix: which path each pair of NAT kinds ends up on, how long from the
first dial, and how often.

    node bench reach [--quick] [--attempts N] [--pairs home-upnp,upnp-upnp]   (root)

Builds the nat scenario's NATs (testnet/nat.py) for two hosts of each kind (public,
fullcone, home, symmetric, upnp) plus two public relays, each host a process
(testnet/bench/reach_agent.py) running the node's own reach services: reachability and
UPnP, relays, hole punching, paths. For every pair of kinds, `attempts` times:

1. both hosts start afresh (new identity and port: a peer met for the first time) and
   wait until they know their reachability and, if private, hold a relay reservation;
2. one dials the other at its advertised addresses in order, as a node's redialer does
   (direct ones first, 5 s each, relayed ones last); the dialer alternates;
3. the dialer's path to the other is recorded until it is final: direct, upnp or
   punched; or relayed once a punch has failed (or nobody is to punch); else after 60 s.

The table gives the final path (how many attempts ended on it), the time from the dial to
that path (median and range), and how many attempts connected at all. Results go to
docs/benchmarks.md (section `reach`).
"""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from testnet import nat, netns
from testnet.bench.report import machine, md_table, print_tables, write_section

KINDS = ("public", "fullcone", "home", "symmetric", "upnp")
RELAYS = ("relay1", "relay2")
REPO = Path(__file__).resolve().parents[2]
READY_S = 60.0
FINAL_S = 60.0
DIRECT = ("direct", "upnp", "punched")


class BenchUnavailable(Exception):
    """This benchmark cannot run on this machine; the message says why."""


class Agent:
    """One reach_agent process in its namespace, spoken to line by line."""

    def __init__(self, topo: netns.Topology, name: str, relays: list[str], logdir: Path):
        self.name = name
        self.proc = subprocess.Popen(
            [*topo.exec_prefix(name), sys.executable, "-m", "testnet.bench.reach_agent",
             "--ip", topo.ip(name), "--relays", ",".join(relays),
             "--log", str(logdir / f"{name}.log")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
            stderr=open(logdir / f"{name}.err", "ab"),  # noqa: SIM115 - the child's now
            start_new_session=True)  # a Ctrl-C reaches the bench, which stops us

    def send(self, cmd: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited (see its log)")
        return json.loads(line)

    def ask(self, cmd: str, **kw: Any) -> dict[str, Any]:
        self.send(cmd, **kw)
        return self.recv()

    def stop(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _ready(agent: Agent, kind: str) -> bool:
    st = agent.ask("state")
    if kind == "upnp":
        return st["reach"] == "public" and st["via"] == "upnp"
    if kind in ("public", "fullcone"):
        return st["reach"] == "public"
    return st["reach"] == "private" and st["reservations"] >= 1


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def _final(dialer: Agent, other: Agent, peer: str, me: str, since: float) -> dict | None:
    """The dialer's timeline once its path is final, else None."""
    tl = dialer.ask("timeline", peer=peer)
    path = (tl.get("transitions") or [[0, None]])[-1][1]
    if path in DIRECT:
        return tl
    if path and path.startswith("relayed"):
        mine = dialer.ask("state", peer=peer)
        theirs = other.ask("state", peer=me)
        punches = [s.get("punch") or {} for s in (mine, theirs)]
        if any(p.get("state") in ("retrying", "gave up") for p in punches):
            return tl  # a punch failed: the relay it is (retries come later)
        roles = [s.get("role") or "" for s in (mine, theirs)]
        if "drives" not in roles and time.monotonic() - since > 15:
            return tl  # nobody punches: a direct dial was the only way
    return None


def attempt(agents: dict[str, Agent], a: str, b: str, kinds: dict[str, str], i: int
            ) -> dict[str, Any]:
    """One attempt between agents a and b; the dialer alternates with `i`."""
    for name in (a, b):
        agents[name].send("reset")
    ids = {name: agents[name].recv()["peer_id"] for name in (a, b)}
    for name in (a, b):
        if not _wait(lambda n=name: _ready(agents[n], kinds[n]), READY_S):
            return {"path": "not ready", "ready": name}
    dialer, target = (a, b) if i % 2 == 0 else (b, a)
    addrs = agents[target].ask("state")["addrs"]
    agents[dialer].ask("dial", peer=ids[target], addrs=addrs)
    since = time.monotonic()
    tl: dict | None = None
    while time.monotonic() - since < FINAL_S:
        tl = _final(agents[dialer], agents[target], ids[target], ids[dialer], since)
        if tl is not None:
            break
        time.sleep(0.25)
    if tl is None:
        tl = agents[dialer].ask("timeline", peer=ids[target])
    transitions = tl.get("transitions") or [[0, None]]
    path = transitions[-1][1]
    path = "relayed" if path and path.startswith("relayed") else (path or "not connected")
    # when the final kind first appeared
    t = next((t for t, p in transitions if p and (p == path or
              (path == "relayed" and p.startswith("relayed")))), None)
    return {"path": path, "s": t, "dialer": dialer, "errors": tl.get("errors", [])}


def pairs() -> list[tuple[str, str]]:
    """Every pair of kinds; those between private kinds (the punches) first."""
    every = [(x, y) for i, x in enumerate(KINDS) for y in KINDS[i:]]
    private = {"home", "symmetric"}
    return sorted(every, key=lambda p: not (set(p) <= private))


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """`--pairs home-upnp,upnp-upnp`: the pairs to measure, checked against KINDS."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        x, sep, y = item.partition("-")
        if not sep or x not in KINDS or y not in KINDS:
            raise ValueError(f"--pairs: {item!r} is not KIND-KIND with kinds among "
                             f"{', '.join(KINDS)}")
        out.append((x, y))
    return out


def main(quick: bool = False, attempts: int | None = None, doc: Path | None = None,
         keep_logs: Path | None = None, only: list[tuple[str, str]] | None = None) -> str:
    """`only`: measure these pairs (either order) into a section of their own
    (`reach-pairs`), leaving the full matrix's section as it is."""
    from rich.console import Console

    reason = netns.available() or nat.missing_tools({"upnp"})
    if reason:
        raise BenchUnavailable(f"the reach benchmark builds NATs in network namespaces: {reason}")
    n = attempts or (3 if quick else 10)
    todo = [p for p in pairs() if only is None or p in only or p[::-1] in only]
    console = Console()
    # SIGTERM (and SIGINT where a shell ignored it) unwinds like Ctrl-C: agents stopped,
    # namespaces deleted
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    names = [*RELAYS, *(f"{k}{j}" for k in KINDS for j in (1, 2))]
    kinds = {name: name.rstrip("12") for name in names}
    kinds.update(dict.fromkeys(RELAYS, "public"))
    natted = {name: k for name, k in kinds.items() if k != "public"}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    load = []
    with tempfile.TemporaryDirectory() as tmp:
        tag = netns.tag_for(tmp)
        topo = nat.create(tag, names, natted, workdir=tmp)
        agents: dict[str, Agent] = {}
        try:
            relay_addrs: list[str] = []
            for r in RELAYS:  # the second relay knows the first: each answers AutoNAT
                agents[r] = Agent(topo, r, relay_addrs, Path(tmp))
                relay_addrs = [*relay_addrs, agents[r].ask("reset")["addrs"][0]]
            for name in names[len(RELAYS):]:
                agents[name] = Agent(topo, name, relay_addrs, Path(tmp))
            for x, y in todo:
                a, b = f"{x}1", f"{y}2" if x == y else f"{y}1"
                runs = []
                for i in range(n):
                    load.append(_load())
                    runs.append(attempt(agents, a, b, kinds, i))
                    console.print(f"{x} <-> {y} #{i + 1}: {runs[-1]['path']} "
                                  f"{_secs(runs[-1].get('s'))}")
                results[(x, y)] = runs
                report(results, n, kinds, load, doc, todo)  # so far: a cut run keeps these
        finally:
            for agent in agents.values():
                agent.stop()
            netns.destroy(topo)
            if keep_logs is not None:
                shutil.copytree(tmp, keep_logs, dirs_exist_ok=True)
                (keep_logs / "results.json").write_text(json.dumps(
                    [{"pair": list(k), "runs": v} for k, v in results.items()], indent=1))
    body = report(results, n, kinds, load, doc, todo)
    print_tables(console, [("reachability matrix", HEADERS, table(results, n, kinds))])
    return body


HEADERS = ["pair", "path (attempts)", "time from the first dial to that path: median "
           "[min-max]", "connected", "other outcomes"]


def report(results: dict[tuple[str, str], list[dict[str, Any]]], n: int,
           kinds: dict[str, str], load: list[float], doc: Path | None,
           todo: list[tuple[str, str]] | None = None) -> str:
    """The section of docs/benchmarks.md for the pairs measured so far (`reach`, or
    `reach-pairs` for a run of some pairs only)."""
    todo = todo if todo is not None else pairs()
    done = "" if len(results) == len(todo) else (
        f" **Cut short: {len(results)} of {len(todo)} pairs measured.**")
    some = todo != pairs()
    title = ("## Reachability matrix, some pairs (`node bench reach --pairs "
             f"{','.join(f'{x}-{y}' for x, y in todo)}`)" if some
             else "## Reachability matrix (`node bench reach`)")
    body = "\n".join([
        title,
        "",
        f"{machine()}; load average {min(load):.1f}-{max(load):.1f} during the run "
        f"(a machine shared with other work).{done}",
        "",
        "NATs of the nat scenario in network namespaces (testnet/nat.py), no added delay. "
        f"{n} attempts per pair, each between two hosts started afresh (new identity and "
        "port) running the node's reach services; the dialer alternates, and the time is "
        "given for each side dialing. Time: from the first dial to the moment the final "
        "path appeared, on the dialer (a dial tries the peer's advertised addresses in "
        "order, 5 s each, as a node's redialer does). A relayed path is final once a "
        "punch failed, or when no side is to punch.",
        "",
        md_table(HEADERS, table(results, n, kinds)),
    ])
    write_section("reach-pairs" if some else "reach", body,
                  doc or Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md")
    return body


def table(results: dict[tuple[str, str], list[dict[str, Any]]], n: int,
          kinds: dict[str, str]) -> list[list[str]]:
    """One row per pair: the most common final path, the time to it when each side dials
    (median and range), how many attempts connected, the other outcomes."""
    rows = []
    for (x, y), runs in results.items():
        paths = Counter(r["path"] for r in runs)
        best, count = paths.most_common(1)[0]
        connected = sum(1 for r in runs if r["path"] in (*DIRECT, "relayed"))
        others = ", ".join(f"{p} {c}" for p, c in paths.items() if p != best) or "-"
        spans = []
        for first in (x, y) if x != y else (x,):
            times = [r["s"] for r in runs if r["path"] == best and r.get("s") is not None
                     and (x == y or kinds.get(r.get("dialer", "")) == first)]
            spans.append(f"{_span(times)}" if x == y else f"{first} dials: {_span(times)}")
        rows.append([f"{x} ↔ {y}", f"{best} ({count}/{n})", "; ".join(spans),
                     f"{connected}/{n}", others])
    return rows


def _span(times: list[float]) -> str:
    if not times:
        return "-"
    return f"{statistics.median(times):.2f} s [{min(times):.2f}-{max(times):.2f}]"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _secs(s: float | None) -> str:
    return "-" if s is None else f"after {s:.2f} s"


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        return float("nan")
