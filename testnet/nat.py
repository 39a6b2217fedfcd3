"""NAT gateways for the nat scenario: a node's namespace behind a gateway namespace.

    node (198.19.<i>.2) -lan- gateway (198.19.<i>.1 | 198.18.<i>.2) -wan- router (198.18.<i>.1)

The gateway forwards and translates with nftables; each kind is the behaviour of a real
class of NAT (measured with py-libp2p in ../shared/notes/nat.md):

* `fullcone`: masquerade (port-preserving) plus a DNAT of everything arriving on the WAN
  to the node: anyone who knows the gateway's address and the node's port reaches it.
* `home`: port-preserving masquerade; unsolicited packets, forwarded or to the gateway
  itself, are dropped silently (a home router: no RST, so TCP hole punching can work).
* `symmetric`: masquerade with fully random ports (a new mapping per destination) and the
  same silent drop: hole punching cannot guess the port.
* `upnp`: masquerade, unsolicited forwarded packets dropped unless miniupnpd mapped them;
  the gateway runs Debian's miniupnpd (UPnP IGD and NAT-PMP on the LAN side). miniupnpd
  refuses to map when its WAN address is reserved (198.18/15) unless a STUN check says
  the gateway is not behind a restrictive NAT: the WAN router runs our STUN responder
  (testnet/stun.py) on 198.18.0.1 and 198.18.0.2 for that. The gateway's own ports answer
  unsolicited packets with RST (the STUN check needs unsolicited answers to come in).
* `upnp-deny`: the same gateway, but its miniupnpd refuses every mapping (a router with
  UPnP locked down): what a node does when its gateway says no.

Everything lives in namespaces this module creates; nothing runs in the root namespace.
Helper processes (STUN responder, miniupnpd) are killed with their namespace
(netns.destroy kills whatever runs inside before deleting it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from testnet import netns as ns

KINDS = ("fullcone", "home", "symmetric", "upnp", "upnp-deny")
STUN_IP, STUN_ALT_IP, STUN_PORT = "198.18.0.1", "198.18.0.2", 3478
MINIUPNPD = "/usr/sbin/miniupnpd"


class NatUnavailable(ns.NetnsError):
    """A tool a NAT kind needs is not installed."""


def missing_tools(kinds: set[str]) -> str | None:
    """None if the tools these NAT kinds need are here, else what is missing (a skip reason
    or a CLI error)."""
    if shutil.which("nft") is None:
        return "the `nft` command (nftables) is not installed: apt-get install nftables"
    if kinds & {"upnp", "upnp-deny"} and not Path(MINIUPNPD).exists():
        return "miniupnpd is not installed: apt-get install miniupnpd"
    return None


def create(tag: str, names: list[str], kinds: dict[str, str], *, rate: str | None = None,
           rtt_ms: float | None = None, workdir: str = "/tmp",
           detached: bool = False) -> ns.Topology:
    """netns.create with the names in `kinds` behind NAT gateways of those kinds."""
    return ns.create(tag, names, nat=kinds, rate=rate, rtt_ms=rtt_ms, workdir=workdir,
                     detached=detached, prepare=prepare_wan, gateway=build_gateway)


def prepare_wan(topo: ns.Topology, kinds: set[str]) -> None:
    """What the WAN needs for these NAT kinds: a STUN responder for miniupnpd's check."""
    reason = missing_tools(kinds)
    if reason:
        raise NatUnavailable(reason)
    unknown = kinds - set(KINDS)
    if unknown:
        raise ns.NetnsError(f"unknown NAT kind {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(KINDS)}")
    if kinds & {"upnp", "upnp-deny"}:
        for ip in (STUN_IP, STUN_ALT_IP):
            ns._run(["ip", "-n", topo.router, "addr", "add", f"{ip}/32", "dev", "lo"])
        ns.spawn_helper(topo, topo.router, [sys.executable, "-m", "testnet.stun", "--ip",
                                            STUN_IP, "--alt-ip", STUN_ALT_IP, "--port",
                                            str(STUN_PORT)], "stun.log")


def _ruleset(kind: str, node_ip: str) -> str:
    """The gateway's nftables ruleset for one NAT kind (see the module docstring)."""
    masq = "masquerade fully-random" if kind == "symmetric" else "masquerade"
    if kind.startswith("upnp"):  # the table and chain names miniupnpd's nft backend expects
        return f"""
table inet filter {{
  chain forward {{ type filter hook forward priority 0; policy accept;
    ct state established,related accept; jump miniupnpd; iifname "wan" drop; }}
  chain miniupnpd {{ }}
  chain prerouting {{ type nat hook prerouting priority -100; policy accept;
    jump prerouting_miniupnpd; }}
  chain postrouting {{ type nat hook postrouting priority 100; policy accept;
    jump postrouting_miniupnpd; oifname "wan" {masq}; }}
  chain prerouting_miniupnpd {{ }}
  chain postrouting_miniupnpd {{ }}
}}
"""
    rules = f"""
table ip pt_nat {{
  chain postrouting {{ type nat hook postrouting priority 100; policy accept;
    oifname "wan" {masq}; }}
"""
    if kind == "fullcone":
        rules += f"""  chain prerouting {{ type nat hook prerouting priority -100; policy accept;
    iifname "wan" dnat to {node_ip}; }}
"""
    rules += "}\n"
    if kind in ("home", "symmetric"):
        rules += """
table inet pt_filter {
  chain forward { type filter hook forward priority 0; policy accept;
    ct state established,related accept; iifname "wan" drop; }
  chain input { type filter hook input priority 0; policy accept;
    ct state established,related accept; iifname "wan" drop; }
}
"""
    return rules


def build_gateway(topo: ns.Topology, name: str, kind: str) -> None:
    """The LAN link between `name` and its gateway, the gateway's NAT, and (upnp) its
    miniupnpd. The WAN link exists already (netns.add)."""
    if kind not in KINDS:
        raise ns.NetnsError(f"unknown NAT kind {kind!r}; known: {', '.join(KINDS)}")
    i = topo.nodes[name]
    node, gw = topo.ns(name), topo.gateway(name)
    lan_gw, node_ip = f"{ns.LAN_SUBNET}.{i}.1", f"{ns.LAN_SUBNET}.{i}.2"
    ns._run(["ip", "link", "add", "eth0", "netns", node, "type", "veth",
             "peer", "name", "lan", "netns", gw])
    ns._run(["ip", "-n", node, "addr", "add", f"{node_ip}/24", "dev", "eth0"])
    ns._run(["ip", "-n", gw, "addr", "add", f"{lan_gw}/24", "dev", "lan"])
    for namespace, dev in ((node, "eth0"), (gw, "lan")):
        ns._run(["ip", "-n", namespace, "link", "set", dev, "up"])
    ns._run(["ip", "-n", node, "route", "add", "default", "via", lan_gw])
    ns._forwarding(gw)
    nft = subprocess.run(["ip", "netns", "exec", gw, "nft", "-f", "-"],
                         input=_ruleset(kind, node_ip), capture_output=True, text=True,
                         timeout=10)
    if nft.returncode != 0:
        raise ns.NetnsError(f"nft in {gw} failed: {nft.stderr.strip()}")
    if kind.startswith("upnp"):
        _start_miniupnpd(topo, name, refuse=kind == "upnp-deny")


def miniupnpd_conf(topo: ns.Topology, name: str, refuse: bool = False) -> str:
    i = topo.nodes[name]
    allow = [] if refuse else [f"allow 1024-65535 {ns.LAN_SUBNET}.{i}.0/24 1024-65535"]
    return "\n".join([
        "ext_ifname=wan",
        "listening_ip=lan",
        "port=0",  # the HTTP (SOAP) port: any
        "enable_upnp=yes",
        "enable_natpmp=yes",
        "secure_mode=yes",  # a client maps ports to itself only
        "system_uptime=yes",
        f"uuid=00000000-0000-0000-0000-{i:012d}",
        # a reserved WAN address (198.18/15) is refused unless STUN vouches for it
        "ext_perform_stun=yes",
        f"ext_stun_host={STUN_IP}",
        f"ext_stun_port={STUN_PORT}",
        "upnp_table_name=filter",
        "upnp_nat_table_name=filter",
        "upnp_forward_chain=miniupnpd",
        "upnp_nat_chain=prerouting_miniupnpd",
        "upnp_nat_postrouting_chain=postrouting_miniupnpd",
        *allow,
        "deny 0-65535 0.0.0.0/0 0-65535",
        "",
    ])


def _start_miniupnpd(topo: ns.Topology, name: str, refuse: bool) -> None:
    work = Path(topo.workdir)
    conf = work / f"miniupnpd-{name}.conf"
    conf.write_text(miniupnpd_conf(topo, name, refuse))
    # -d: stay in the foreground, log to stderr (into the log file); -P: its pid file
    ns.spawn_helper(topo, topo.gateway(name), [MINIUPNPD, "-d", "-f", str(conf), "-P",
                                               str(work / f"miniupnpd-{name}.pid")],
                    f"miniupnpd-{name}.log")
    # Ready once it listens for SSDP on the LAN (UDP 1900): wait, bounded.
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        ss = subprocess.run(["ss", "-N", topo.gateway(name), "-lun", "sport", "= :1900"],
                            capture_output=True, text=True, timeout=10)
        if ":1900" in ss.stdout:
            return
        time.sleep(0.1)
    log = (work / f"miniupnpd-{name}.log").read_text(errors="replace")[-1500:]
    raise ns.NetnsError(f"miniupnpd in {topo.gateway(name)} did not start:\n{log}")
