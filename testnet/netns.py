"""Network namespaces for a testnet: each process in a namespace of its own, all of them
joined by one router namespace, so a scenario can cut the network between groups of nodes.

    pt-<tag>-r        the router: one veth per node (10.77.<i>.1/24), IPv4 forwarding on
    pt-<tag>-<name>   a node: eth0 = 10.77.<i>.2/24, default route via the router, lo up

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
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

SUBNET = "10.77"
MAX_NODES = 250
RULE_PREF = 1000  # all partition rules share one priority: `heal` deletes exactly those
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
    probe = f"pt-probe-{os.getpid()}"
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
    nodes: dict[str, int] = field(default_factory=dict)  # name -> index i (10.77.<i>.2)
    cut: list[list[str]] | None = None  # the two sides while partitioned
    shaped: dict[str, int] = field(default_factory=dict)  # name -> uplink Mbit/s

    @property
    def router(self) -> str:
        return f"pt-{self.tag}-r"

    def ns(self, name: str) -> str:
        return f"pt-{self.tag}-{name}"

    def ip(self, name: str) -> str:
        return f"{SUBNET}.{self.nodes[name]}.2"

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


def create(tag: str, names: list[str]) -> Topology:
    """The router and one namespace per name; on failure everything created is removed."""
    topo = Topology(tag)
    for stale in existing(tag):  # left by a crashed launcher of the same directory
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=10)
    try:
        _run(["ip", "netns", "add", topo.router])
        _run(["ip", "-n", topo.router, "link", "set", "lo", "up"])
        _run(
            [
                "ip",
                "netns",
                "exec",
                topo.router,
                "sh",
                "-c",
                "echo 1 > /proc/sys/net/ipv4/ip_forward",
            ]
        )
        for name in names:
            add(topo, name)
    except BaseException:
        destroy(topo)
        raise
    return topo


def add(topo: Topology, name: str) -> None:
    """Give `name` a namespace with a link to the router (a node joining later, too)."""
    if not _NAME.match(name):
        raise NetnsError(f"bad node name {name!r}")
    if name in topo.nodes:
        raise NetnsError(f"{name} already has a namespace")
    index = next(i for i in range(MAX_NODES + 1) if i not in topo.nodes.values())
    if index >= MAX_NODES:
        raise NetnsError(f"at most {MAX_NODES} namespaces per testnet")
    ns, router = topo.ns(name), topo.router
    topo.nodes[name] = index
    _run(["ip", "netns", "add", ns])
    _run(
        [
            "ip",
            "link",
            "add",
            "eth0",
            "netns",
            ns,
            "type",
            "veth",
            "peer",
            "name",
            f"v{index}",
            "netns",
            router,
        ]
    )
    _run(["ip", "-n", ns, "addr", "add", f"{SUBNET}.{index}.2/24", "dev", "eth0"])
    _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    _run(["ip", "-n", router, "addr", "add", f"{SUBNET}.{index}.1/24", "dev", f"v{index}"])
    _run(["ip", "-n", router, "link", "set", f"v{index}", "up"])
    _run(["ip", "-n", ns, "route", "add", "default", "via", f"{SUBNET}.{index}.1"])
    if topo.cut is not None:  # a newcomer during a cut lands on the side not named
        topo.cut[0].append(name)
        _rules(topo, "add", [[name], topo.cut[1]])


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
        far = " or ".join(f"dst {topo.ip(n)}" for n in b)
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
                    topo.ip(x),
                    "to",
                    topo.ip(y),
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
    """Delete every namespace of the topology (links and rules go with them). Never raises;
    each command is bounded, so a cleanup path cannot hang."""
    for name in topo.nodes:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["ip", "netns", "del", topo.ns(name)], capture_output=True, timeout=10)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["ip", "netns", "del", topo.router], capture_output=True, timeout=10)
    topo.nodes.clear()
    topo.cut = None


def existing(tag: str) -> list[str]:
    """Namespaces of this tag that exist now (tests check nothing is left behind)."""
    try:
        out = _run(["ip", "netns", "list"])
    except NetnsError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"pt-{tag}-")]
