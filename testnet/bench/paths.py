"""Averaging over every path kind, on shaped WAN links: what each way of reaching a peer
costs an exchange.

    node bench paths [--quick] [--rate 100mbit] [--rtt 50] [--mb 16] [--rounds 5]   (root)

The nat scenario's NATs (testnet/nat.py) with every WAN link shaped to `rate` both ways
and `rtt` ms of round trip between any two WAN hosts (the relayed path crosses it twice).
For each case two hosts (testnet/bench/reach_agent.py processes, the node's own reach,
webrtc and averaging services) start afresh, one dials the other as a node's redialer does,
and once the path is the case's, they run `rounds` averaging rounds of `mb` megabytes of
fp32 weights under `outer.codec = "auto"` (bf16 on a fast path, int8 through a relay),
GAP_S apart (connections idle between rounds, as in a run):

* direct: two public hosts (a bulk lane carries the vectors);
* NAT to public: a home-NAT host dials a public one (a direct TCP connection, one side
  unreachable);
* upnp: a public host dials a UPnP host at its mapping;
* punched: two home-NAT hosts, DCUtR;
* relayed: two symmetric-NAT hosts (no punch works), through a public relay;
* webrtc: two home-NAT hosts with hole punching off: a data channel found by ICE.

The table gives the path each side saw, the route the bytes took, the codec, each round's
seconds (from both sides reaching the boundary to the other's vector received) and the
wire rate (both directions' bytes over those seconds), with rounds lost (a local step).
Results go to docs/benchmarks.md (section `paths`).
"""

from __future__ import annotations

import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testnet import nat, netns
from testnet.bench.reach import RELAYS, Agent, BenchUnavailable, _interrupt, _load, _ready, _wait
from testnet.bench.report import machine, md_table, print_tables, write_section

READY_S = 60.0
PATH_S = 90.0  # a punch, or ICE after its pass interval, lands well inside this
# Between rounds: a run's rounds are tens of seconds apart, and after an idle spell
# longer than its retransmit timeout TCP starts a connection over from slow start (Linux's
# tcp_slow_start_after_idle), so back-to-back rounds would flatter a warm connection
# against a lane (a new connection each round).
GAP_S = 3.0


@dataclass(frozen=True)
class Case:
    label: str
    dialer: str  # agent names: the kind is the name without its digit
    target: str
    path: str  # the path both sides must show (the family: `relayed` is any relay)
    options: dict[str, Any] = field(default_factory=dict)  # reach_agent's reset options


CASES = (
    Case("direct", "public1", "public2", "direct"),
    Case("NAT to public", "home1", "public1", "direct"),
    Case("upnp", "public1", "upnp1", "upnp"),
    Case("punched", "home1", "home2", "punched"),
    Case("relayed", "symmetric1", "symmetric2", "relayed"),
    Case("webrtc", "home1", "home2", "webrtc", {"punch": False, "webrtc": True}),
)
HOSTS = ("public1", "public2", "home1", "home2", "symmetric1", "symmetric2", "upnp1")


def _kind(name: str) -> str:
    return name.rstrip("0123456789")


def _family(path: str | None) -> str:
    return "relayed" if path and path.startswith("relayed") else (path or "not connected")


def _paths_reached(agents: dict[str, Agent], case: Case, ids: dict[str, str]) -> bool:
    """Both sides show a path of the case's family (the UPnP host alone sees `upnp`: its
    dialer cannot tell a mapping from an open port)."""
    seen = [_family(agents[a].ask("state", peer=ids[b])["path"])
            for a, b in ((case.dialer, case.target), (case.target, case.dialer))]
    if case.path == "upnp":
        return seen == ["direct", "upnp"]
    return seen == [case.path, case.path]


def run_case(agents: dict[str, Agent], case: Case, rounds: int, mb: float, step_s: float,
             inner_steps: int) -> dict[str, Any]:
    pair = (case.dialer, case.target)
    for name in pair:
        agents[name].send("reset", average=True, **case.options)
    ids = {name: agents[name].recv()["peer_id"] for name in pair}
    for name in pair:
        if not _wait(lambda n=name: _ready(agents[n], _kind(n)), READY_S):
            return {"error": f"{name} not ready in {READY_S:.0f} s"}
    addrs = agents[case.target].ask("state")["addrs"]
    agents[case.dialer].ask("dial", peer=ids[case.target], addrs=addrs)
    since = time.monotonic()
    if not _wait(lambda: _paths_reached(agents, case, ids), PATH_S):
        seen = [agents[a].ask("state", peer=ids[b])["path"] for a, b in (pair, pair[::-1])]
        return {"error": f"no {case.path} path in {PATH_S:.0f} s (saw {seen})"}
    path_s = time.monotonic() - since
    results = []
    for r in range(1, rounds + 1):
        if r > 1:
            time.sleep(GAP_S)
        for name in pair:
            other = pair[1] if name == pair[0] else pair[0]
            agents[name].send("exchange", peer=ids[other], round=r, mb=mb, step_s=step_s,
                              inner_steps=inner_steps)
        results.append({name: agents[name].recv() for name in pair})
    return {"path_s": path_s, "rounds": results,
            "seen": [results[-1][n].get("path") for n in pair]}


def main(quick: bool = False, rate: str = "100mbit", rtt_ms: float = 50.0,
         mb: float | None = None, rounds: int | None = None, doc: Path | None = None,
         only: list[str] | None = None) -> str:
    from rich.console import Console

    reason = netns.available() or nat.missing_tools({"upnp"})
    if reason:
        raise BenchUnavailable(f"the paths benchmark builds NATs in network namespaces: "
                               f"{reason}")
    mb = mb or (4.0 if quick else 16.0)
    rounds = rounds or (2 if quick else 5)
    # a run's round: 50 inner steps of 0.5 s (the boundary slack in each deadline)
    step_s, inner_steps = 0.5, 50
    cases = [c for c in CASES if only is None or c.label in only]
    console = Console()
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    names = [*RELAYS, *HOSTS]
    natted = {n: _kind(n) for n in HOSTS if _kind(n) != "public"}
    results: dict[str, dict[str, Any]] = {}
    load: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        topo = nat.create(netns.tag_for(tmp), names, natted, rate=rate, rtt_ms=rtt_ms,
                          workdir=tmp)
        agents: dict[str, Agent] = {}
        try:
            relay_addrs: list[str] = []
            for r in RELAYS:  # relays answer STUN too (the webrtc service), as public nodes do
                agents[r] = Agent(topo, r, relay_addrs, Path(tmp))
                relay_addrs = [*relay_addrs, agents[r].ask("reset", webrtc=True)["addrs"][0]]
            for name in HOSTS:
                agents[name] = Agent(topo, name, relay_addrs, Path(tmp))
            for case in cases:
                load.append(_load())
                res = results[case.label] = run_case(agents, case, rounds, mb, step_s,
                                                     inner_steps)
                console.print(f"{case.label}: {_summary(res)}")
                report(results, cases, rate, rtt_ms, mb, rounds, load, doc)
        finally:
            for agent in agents.values():
                agent.stop()
            netns.destroy(topo)
    body = report(results, cases, rate, rtt_ms, mb, rounds, load, doc)
    print_tables(console, [("averaging by path", HEADERS, table(results, cases))])
    return body


HEADERS = ["case", "path (dialer / other)", "route", "codec", "round s: first; median of "
           "the rest [min-max]", "wire MB/s (median)", "rounds lost"]


def _summary(res: dict[str, Any]) -> str:
    if "error" in res:
        return res["error"]
    return " ".join(f"{max(s['seconds'] for s in r.values()):.2f}s"
                    f"{'' if all(s['ok'] for s in r.values()) else ' (lost)'}"
                    for r in res["rounds"])


def _row(case: Case, res: dict[str, Any], rounds: int) -> list[str]:
    if "error" in res:
        return [case.label, res["error"], "-", "-", "-", "-", "-"]
    seen = " / ".join(_family(p) for p in res["seen"])
    routes: dict[str, int] = {}
    codecs = set()
    secs, rates, lost = [], [], 0
    for r in res["rounds"]:
        sides = list(r.values())
        if not all(s.get("ok") for s in sides):
            lost += 1
            secs.append(None)
            continue
        nbytes = 0
        for s in sides:
            for k, v in (s.get("sent") or {}).items():
                routes[k] = routes.get(k, 0) + v
                nbytes += v
            codecs.add(s.get("codec"))
        seconds = max(s["seconds"] for s in sides)
        secs.append(seconds)
        rates.append(nbytes / seconds / 1e6 if seconds > 0 else 0.0)
    first = "lost" if secs[0] is None else f"{secs[0]:.2f}"
    rest = [s for s in secs[1:] if s is not None]
    span = (f"{statistics.median(rest):.2f} [{min(rest):.2f}-{max(rest):.2f}]" if rest
            else "-")
    route = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in sorted(routes.items())) or "-"
    return [case.label, seen, route, ", ".join(sorted(c for c in codecs if c)) or "-",
            f"{first}; {span}", f"{statistics.median(rates):.1f}" if rates else "-",
            f"{lost}/{rounds}"]


def table(results: dict[str, dict[str, Any]], cases: list[Case]) -> list[list[str]]:
    rounds = max((len(r.get("rounds", [])) for r in results.values()), default=0)
    return [_row(c, results[c.label], rounds) for c in cases if c.label in results]


def report(results: dict[str, dict[str, Any]], cases: list[Case], rate: str, rtt_ms: float,
           mb: float, rounds: int, load: list[float], doc: Path | None) -> str:
    done = "" if len(results) == len(cases) else (
        f" **Cut short: {len(results)} of {len(cases)} cases measured.**")
    body = "\n".join([
        f"## Averaging by path at {rate}, {rtt_ms:g} ms RTT (`node bench paths`)",
        "",
        f"{machine()}; load average {min(load):.1f}-{max(load):.1f} during the run "
        f"(a machine shared with other work).{done}",
        "",
        f"NATs of the nat scenario in network namespaces (testnet/nat.py), every WAN link "
        f"shaped to {rate} both ways and {rtt_ms:g} ms RTT between WAN hosts (a relayed "
        f"path crosses it twice). Per case, two hosts started afresh run the node's reach, "
        f"webrtc and averaging services (testnet/bench/reach_agent.py); once the path is "
        f"the case's, {rounds} averaging rounds of {mb:g} MB of fp32 weights with "
        f"`outer.codec = \"auto\"`, {GAP_S:g} s apart, both sides at the boundary together. "
        f"Round seconds: "
        f"the slower side's, boundary to the other's vector received; wire MB/s: both "
        f"directions' bytes (after the codec) over that. The first round includes what a "
        f"first exchange with a peer costs (a lane offered, the rate unknown).",
        "",
        md_table(HEADERS, table(results, cases)),
    ])
    write_section("paths", body,
                  doc or Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md")
    return body
