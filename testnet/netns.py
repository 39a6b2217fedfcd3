"""Network namespaces for a testnet: each process in a namespace of its own, all of them
joined by one router namespace (the "WAN"), so a scenario can cut the network between
groups of nodes or put nodes behind NATs (testnet/nat.py builds those gateways).

    pt-<tag>-r        the router: one veth per node (198.18.<i>.1/24), IPv4 forwarding on
    pt-<tag>-<name>   a node: eth0 = 198.18.<i>.2/24, default route via the router, lo up

Every address comes from 198.18.0.0/15 (RFC 2544, the benchmarking range: routed nowhere,
used by nobody's LAN): WAN links in 198.18/16, NATed LANs in 198.19/16 (testnet/nat.py).

Every packet between two nodes crosses the router, so a partition is routing policy there:
`partition` adds `ip rule from A to B unreachable` for every pair across the cut (a dial
gets "No route to host" at once, like a firewall that rejects) and aborts the TCP
connections that already crossed it (`ss -K` in each namespace: a stateful firewall that
dropped its state). `heal` deletes the rules; reconnecting is then up to the nodes.
`shape` limits a node's uplink with a token bucket (tc tbf).

Why routing policy and not nftables: it needs only iproute2 (`ip`, `ss`, `tc`), which a
fresh Debian or Ubuntu machine has, and no kernel module to load. The root namespace is
never touched (no address, route or rule of the machine changes), and `destroy` removes
everything, including what a crashed launcher left behind. Needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUBNET = "198.18"  # WAN links: 198.18.<i>.0/24, <i> from 1
LAN_SUBNET = "198.19"  # a NATed node's LAN: 198.19.<i>.0/24, gateway .1, node .2
PREFIX = "pt-"  # every namespace of every testnet; <tag> then names one testnet
MAX_NODES = 250
RULE_PREF = 1000  # all partition rules share one priority: `heal` deletes exactly those
DELAY_PREF, DELAY_TABLE, DELAY_DEV = 2000, 100, "dly0"  # after the partition rules
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")


class NetnsError(Exception):
    """A namespace command failed; the message has the command and its stderr."""


def tag_for(directory: str) -> str:
    """A short tag naming one testnet's namespaces (stable for a directory)."""
    return hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:6]


def available() -> str | None:
    """None if namespaces can be used here, else why not (for a skip or a CLI error)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root or with sudo)"
    for tool in ("ip", "ss", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as e:
        return f"cannot create a network namespace: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def _run(argv: list[str], timeout: float = 10.0) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"`{' '.join(argv)}` failed: {e}") from e
    if r.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.returncode}")
    return r.stdout


@dataclass
class Topology:
    """Who lives where; saved in testnet.json so `down`, `partition` and `heal` find it."""

    tag: str
    nodes: dict[str, int] = field(default_factory=dict)  # name -> index i (198.18.<i>.2)
    cut: list[list[str]] | None = None  # the two sides while partitioned
    shaped: dict[str, int] = field(default_factory=dict)  # name -> uplink Mbit/s
    nat: dict[str, str] = field(default_factory=dict)  # name -> NAT kind (testnet/nat.py)
    rate: str | None = None  # every WAN link's rate, both ways (tc tbf), e.g. "100mbit"
    rtt_ms: float | None = None  # added round-trip time across the WAN (testnet/delay.py)
    workdir: str = "/tmp"  # where helpers (STUN responder, miniupnpd) keep config and logs
    detached: bool = False  # helpers outlive the launcher (else they die with it)

    @property
    def router(self) -> str:
        return f"{PREFIX}{self.tag}-r"

    def ns(self, name: str) -> str:
        return f"{PREFIX}{self.tag}-{name}"

    def gateway(self, name: str) -> str:
        """The namespace of the NAT gateway in front of `name` (NATed nodes only)."""
        return f"{PREFIX}{self.tag}-{name}-gw"

    def wan_ip(self, name: str) -> str:
        """The address the WAN sees: the node's own, or its gateway's."""
        return f"{SUBNET}.{self.nodes[name]}.2"

    def ip(self, name: str) -> str:
        """The node's own address (behind a NAT: its LAN address, 198.19.<i>.2)."""
        if name in self.nat:
            return f"{LAN_SUBNET}.{self.nodes[name]}.2"
        return self.wan_ip(name)

    def listen(self, name: str) -> str:
        return f"/ip4/{self.ip(name)}/tcp/0"

    def exec_prefix(self, name: str) -> list[str]:
        """Prefix an argv with this to run it inside `name`'s namespace (same pid: ip execs)."""
        return ["ip", "netns", "exec", self.ns(name)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Topology:
        return cls(**doc)


Gateways = Callable[[Topology, str, str], None]  # (topology, node name, NAT kind)


def create(tag: str, names: list[str], *, nat: dict[str, str] | None = None,
           rate: str | None = None, rtt_ms: float | None = None, workdir: str = "/tmp",
           detached: bool = False, prepare: Callable[[Topology, set[str]], None] | None = None,
           gateway: Gateways | None = None) -> Topology:
    """The router and one namespace per name; on failure everything created is removed.

    `nat` puts some names behind a NAT gateway of that kind, which `gateway` builds once
    the WAN link is up (`prepare` readies the WAN first): testnet/nat.py's `create` passes
    both. `rate` shapes every WAN link both ways (tc tbf, e.g. "100mbit"); `rtt_ms` delays
    every packet crossing the router by half of it (testnet/delay.py)."""
    topo = Topology(tag, rate=rate, rtt_ms=rtt_ms, workdir=workdir, detached=detached)
    for stale in existing(tag):  # left by a crashed launcher of the same directory
        _delete(stale)
    try:
        _run(["ip", "netns", "add", topo.router])
        _run(["ip", "-n", topo.router, "link", "set", "lo", "up"])
        _forwarding(topo.router)
        if rtt_ms:
            _start_delay(topo, rtt_ms)
        if nat and (prepare is None or gateway is None):
            raise NetnsError("NAT gateways need testnet/nat.py: use nat.create")
        if nat and prepare is not None:
            prepare(topo, set(nat.values()))
        for name in names:
            add(topo, name, (nat or {}).get(name), gateway)
    except BaseException:
        destroy(topo)
        raise
    return topo


def _forwarding(namespace: str) -> None:
    _run(["ip", "netns", "exec", namespace, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])


def add(topo: Topology, name: str, nat_kind: str | None = None,
        gateway: Gateways | None = None) -> None:
    """Give `name` a namespace with a link to the router (a node joining later, too);
    with `nat_kind`, a gateway namespace of that kind sits in between (testnet/nat.py)."""
    if not _NAME.match(name):
        raise NetnsError(f"bad node name {name!r}")
    if name in topo.nodes:
        raise NetnsError(f"{name} already has a namespace")
    index = next(i for i in range(1, MAX_NODES + 1) if i not in topo.nodes.values())
    if index >= MAX_NODES:
        raise NetnsError(f"at most {MAX_NODES - 1} namespaces per testnet")
    ns, router = topo.ns(name), topo.router
    topo.nodes[name] = index
    _run(["ip", "netns", "add", ns])
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    # The WAN side: the node itself, or its gateway, on 198.18.<i>.2
    wan_end = ns
    if nat_kind is not None:
        topo.nat[name] = nat_kind
        wan_end = topo.gateway(name)
        _run(["ip", "netns", "add", wan_end])
        _run(["ip", "-n", wan_end, "link", "set", "lo", "up"])
    wan_if = "wan" if nat_kind else "eth0"
    _run(["ip", "link", "add", wan_if, "netns", wan_end, "type", "veth",
          "peer", "name", f"v{index}", "netns", router])
    _run(["ip", "-n", wan_end, "addr", "add", f"{SUBNET}.{index}.2/24", "dev", wan_if])
    _run(["ip", "-n", wan_end, "link", "set", wan_if, "up"])
    _run(["ip", "-n", router, "addr", "add", f"{SUBNET}.{index}.1/24", "dev", f"v{index}"])
    _run(["ip", "-n", router, "link", "set", f"v{index}", "up"])
    _run(["ip", "-n", wan_end, "route", "add", "default", "via", f"{SUBNET}.{index}.1"])
    if topo.rate:
        for namespace, dev in ((router, f"v{index}"), (wan_end, wan_if)):
            _tbf(namespace, dev, topo.rate)
    if topo.rtt_ms:  # what arrives from this link goes through the delay line
        _run(["ip", "-n", router, "rule", "add", "iif", f"v{index}", "lookup", str(DELAY_TABLE),
              "pref", str(DELAY_PREF)])
    if nat_kind is not None:
        if gateway is None:
            raise NetnsError(f"{name} needs a NAT gateway builder (testnet/nat.py)")
        gateway(topo, name, nat_kind)
    if topo.cut is not None:  # a newcomer during a cut lands on the side not named
        topo.cut[0].append(name)
        _rules(topo, "add", [[name], topo.cut[1]])


def _pdeathsig() -> None:  # in the child: die with the launcher (foreground testnets)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def spawn_helper(topo: Topology, namespace: str, argv: list[str], log_name: str) -> int:
    """Start a helper process (STUN responder, miniupnpd, delay line) inside `namespace`;
    its output goes to `log_name` in the testnet's directory. `destroy` kills it."""
    with open(os.path.join(topo.workdir, log_name), "ab") as out:
        p = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], stdin=subprocess.DEVNULL,
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=None if topo.detached else _pdeathsig)
    return p.pid


def _start_delay(topo: Topology, rtt_ms: float) -> None:
    """The router's delay line: a TUN device fed by policy routing (testnet/delay.py)."""
    router = topo.router
    spawn_helper(topo, router, [sys.executable, "-m", "testnet.delay", "--dev", DELAY_DEV,
                                "--delay-ms", f"{rtt_ms / 2:g}"], "delay.log")
    deadline = time.monotonic() + 10.0
    while subprocess.run(["ip", "-n", router, "link", "show", DELAY_DEV], capture_output=True,
                         timeout=10).returncode != 0:
        if time.monotonic() > deadline:
            log = Path(topo.workdir, "delay.log").read_text(errors="replace")[-500:]
            raise NetnsError(f"the delay line did not start: {log}")
        time.sleep(0.05)
    _run(["ip", "-n", router, "link", "set", DELAY_DEV, "up"])
    _run(["ip", "-n", router, "route", "add", "default", "dev", DELAY_DEV, "table",
          str(DELAY_TABLE)])
    # packets come back in on dly0 with sources from every link: no reverse-path check
    _run(["ip", "netns", "exec", router, "sh", "-c",
          f"for f in all default {DELAY_DEV}; do echo 0 > /proc/sys/net/ipv4/conf/$f/rp_filter;"
          " done"])


def _tbf(namespace: str, dev: str, rate: str) -> None:
    _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", dev, "root",
          "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"])


def partition(topo: Topology, side: list[str]) -> list[list[str]]:
    """Cut `side` off from every other namespace; returns the two sides."""
    unknown = [n for n in side if n not in topo.nodes]
    if unknown:
        raise NetnsError(f"no node named {', '.join(unknown)}; have {', '.join(topo.nodes)}")
    other = [n for n in topo.nodes if n not in side]
    if not side or not other:
        raise NetnsError("a partition needs nodes on both sides")
    if topo.cut is not None:
        heal(topo)
    cut = [other, list(side)]
    topo.cut = cut  # first: if adding a rule fails, `heal` still removes those added
    _rules(topo, "add", cut)
    for a, b in (cut, cut[::-1]):  # both ends: the other end's RST is lost in the cut
        far = " or ".join(f"dst {topo.wan_ip(n)}" for n in b)
        for name in a:
            # ss reports one harmless failure for sockets it cannot kill (listeners)
            subprocess.run(
                ["ss", "-N", topo.ns(name), "-K", "-t", f"( {far} )"],
                capture_output=True,
                timeout=10,
            )
    return cut


def heal(topo: Topology) -> None:
    """Remove the cut; idempotent."""
    if topo.cut is not None:
        _rules(topo, "del", topo.cut)
        topo.cut = None


def _rules(topo: Topology, op: str, cut: list[list[str]]) -> None:
    for a, b in (cut, cut[::-1]):
        for x in a:
            for y in b:
                argv = [
                    "ip",
                    "-n",
                    topo.router,
                    "rule",
                    op,
                    "from",
                    topo.wan_ip(x),
                    "to",
                    topo.wan_ip(y),
                    "unreachable",
                    "pref",
                    str(RULE_PREF),
                ]
                if op == "del":
                    subprocess.run(argv, capture_output=True, timeout=10)
                else:
                    _run(argv)


def shape(topo: Topology, name: str, mbit: int) -> None:
    """Limit what `name` sends to `mbit` Mbit/s (a home uplink; tbf, 50 ms of queue)."""
    _run(
        [
            "ip",
            "netns",
            "exec",
            topo.ns(name),
            "tc",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            "256kb",
            "latency",
            "50ms",
        ]
    )
    topo.shaped[name] = mbit


def destroy(topo: Topology) -> None:
    """Delete every namespace of the topology's testnet (links, rules, qdiscs and conntrack
    state go with them), after killing what still runs inside (the STUN responder, a
    miniupnpd, a node a crashed launcher left). Never raises; each command is bounded, so a
    cleanup path cannot hang."""
    for namespace in existing(topo.tag):  # every namespace has the prefix pt-<tag>-
        _delete(namespace)
    topo.nodes.clear()
    topo.nat.clear()
    topo.cut = None


def _delete(namespace: str) -> None:
    """Kill the processes inside `namespace`, then delete it. A namespace deleted with a
    process inside lives on, nameless, as long as that process does."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                              text=True, timeout=10).stdout.split()
        _kill_and_reap([int(pid) for pid in pids if pid.isdigit()])
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)


def _kill_and_reap(pids: list[int], timeout: float = 5.0) -> None:
    """SIGKILL each process and wait (at most `timeout`) until it has exited: a kill is
    delivered asynchronously, and a caller that checks right after `down` must find the
    processes gone (a fresh-clone CI run once saw a killed miniupnpd still running). pidfds
    name the process itself, so a reused pid is never signalled."""
    fds = []
    for pid in pids:
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(pid)
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                os.close(fd)
                continue
            fds.append(fd)
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)  # readable once the process has exited
        waiting, deadline = set(fds), time.monotonic() + timeout
        while waiting and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                waiting.discard(fd)
    finally:
        for fd in fds:
            os.close(fd)


def existing(tag: str) -> list[str]:
    """Namespaces of this tag that exist now (tests check nothing is left behind)."""
    try:
        out = _run(["ip", "netns", "list"])
    except NetnsError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}{tag}-")]
