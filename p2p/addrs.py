"""Which addresses a node advertises and which it dials: one policy for both.

A node listening on `/ip4/0.0.0.0/tcp/P` advertised exactly that (identify, peer records,
status, tickets): an address nobody can dial, and one a peer's dialer turns into a dial of
its own machine (a hole punch once dialed its own host 31 times). A peer's DCUtR CONNECT
could also point our dials at any port of our machine. The rules here:

* **Advertise**: an unspecified address becomes one address per interface IP of this
  machine (same port); loopback and link-local ones only when there is nothing else (a
  one-machine testnet). The unspecified address itself is never advertised.
* **Dial**: never an unspecified address, nor one of our own listen addresses; a loopback
  address only when the peer is on this machine (we listen on loopback ourselves: a
  loopback testnet, or the caller knows the peer is local); a private or link-local one
  only when we have an address in the same private block (we may share that network: a
  LAN, the 198.18/15 namespace testnets), so a server with only a public address never
  sends SYNs into its provider's private ranges because a peer advertised a LAN address.

Addresses are strings (`/ip4/1.2.3.4/tcp/5/...`); DNS names and other protocols pass.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable
from dataclasses import dataclass

IP = ipaddress.IPv4Address | ipaddress.IPv6Address

# Ranges routed nowhere on the internet. An address in one is dialed only by a node that
# has an address in the same block (it may share that network).
PRIVATE_BLOCKS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",  # RFC 1918, 6598
    "198.18.0.0/15",  # RFC 2544: the namespace testnets' WAN and LANs
    "169.254.0.0/16", "fc00::/7", "fe80::/10",  # link-local, unique local
))
_IFACE_TTL_S = 5.0  # interfaces change rarely; identify asks for our addresses often
_iface_cache: tuple[float, tuple[str, ...]] | None = None


def ip_of(addr: str) -> IP | None:
    """The IP of `/ip4/...` or `/ip6/...`, else None (a DNS name, garbage)."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        return ipaddress.ip_address(parts[2].split("%")[0])
    except ValueError:
        return None


def port_of(addr: str) -> int | None:
    parts = addr.split("/")
    if len(parts) < 5 or parts[3] != "tcp":
        return None
    try:
        return int(parts[4])
    except ValueError:
        return None


def block_of(ip: IP) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """The private block `ip` is in, None for a public address."""
    return next((b for b in PRIVATE_BLOCKS if b.version == ip.version and ip in b), None)


def interface_ips() -> list[str]:
    """This machine's (this namespace's) interface IPs, v4 and v6 (cached a few seconds)."""
    global _iface_cache
    now = time.monotonic()
    if _iface_cache is None or now - _iface_cache[0] > _IFACE_TTL_S:
        import ifaddr

        ips: list[str] = []
        for adapter in ifaddr.get_adapters():
            for ip in adapter.ips:
                ips.append(ip.ip if isinstance(ip.ip, str) else ip.ip[0])
        _iface_cache = (now, tuple(dict.fromkeys(ips)))
    return list(_iface_cache[1])


def _rank(ip: IP) -> int:
    if ip.is_loopback:
        return 2
    if ip.is_link_local:
        return 3
    return 0 if block_of(ip) is None else 1


def expand(addrs: Iterable[str], interfaces: list[str] | None = None) -> list[str]:
    """The addresses to advertise for `addrs`: an unspecified one becomes one per
    interface IP of its family (loopback and link-local only when nothing else exists);
    an unspecified address is never returned."""
    ifaces = interface_ips() if interfaces is None else interfaces
    out: list[str] = []
    for a in addrs:
        ip = ip_of(a)
        if ip is None or not ip.is_unspecified:
            out.append(a)
            continue
        fam = [i for i in (ip_of(f"/ip{ip.version}/{x}") for x in ifaces) if i is not None
               and i.version == ip.version and not i.is_unspecified]
        if any(_rank(i) < 2 for i in fam):
            fam = [i for i in fam if _rank(i) < 2]
        head = f"/ip{ip.version}/{a.split('/')[2]}/"
        out += [a.replace(head, f"/ip{ip.version}/{i}/", 1) for i in fam]
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Network:
    """Where this node sits, as far as dialing goes: its own IPs (interfaces and listen
    addresses), its listen addresses, and whether it listens on loopback itself."""

    own_ips: frozenset[str]
    listen: tuple[str, ...] = ()  # bound listen addresses (an unspecified IP kept)

    @classmethod
    def of(cls, listen: Iterable[str], interfaces: list[str] | None = None) -> Network:
        listen = tuple(a.split("/p2p/")[0] for a in listen)
        ifaces = interface_ips() if interfaces is None else interfaces
        ips = {str(i) for i in (ip_of(a) for a in listen) if i is not None}
        ips |= {str(ipaddress.ip_address(x.split("%")[0])) for x in ifaces if _valid(x)}
        return cls(frozenset(ips), listen)

    @property
    def loopback(self) -> bool:
        """We listen on a loopback address ourselves: peers on this machine are our
        network (a loopback testnet)."""
        return any((ip := ip_of(a)) is not None and ip.is_loopback for a in self.listen)

    def is_own(self, ip: IP | str) -> bool:
        """`ip` is this machine's (a server there is on our machine)."""
        ip = ipaddress.ip_address(str(ip))
        return ip.is_loopback or str(ip) in self.own_ips

    def own_address(self, addr: str) -> bool:
        """`addr` is one of our listen addresses (our IP, or any when we listen on the
        unspecified one, with our listen port)."""
        ip, port = ip_of(addr), port_of(addr)
        if ip is None or port is None:
            return False
        for a in self.listen:
            lip = ip_of(a)
            if lip is None or port_of(a) != port or lip.version != ip.version:
                continue
            if lip == ip or (lip.is_unspecified and self.is_own(ip)):
                return True
        return False

    def refuse(self, addr: str, *, peer_local: bool = False) -> str | None:
        """Why we must not dial `addr`, or None if we may. `peer_local`: the caller knows
        the peer is on this machine (loopback then reaches it)."""
        ip = ip_of(addr)
        if ip is None:
            return None
        if ip.is_unspecified:
            return "an unspecified address (where a node listens, not where it is)"
        if self.own_address(addr):
            return "one of this node's own listen addresses"
        if ip.is_loopback:
            if peer_local or self.loopback:
                return None
            return "a loopback address, and the peer is not on this machine"
        block = block_of(ip)
        if block is not None and not any(
                block_of(o) == block for o in map(ipaddress.ip_address, self.own_ips)):
            return f"a private address ({block}) of a network this node is not on"
        return None

    def dialable(self, addrs: Iterable[str], *, peer_local: bool = False) -> list[str]:
        return [a for a in addrs if self.refuse(a, peer_local=peer_local) is None]


def _valid(x: str) -> bool:
    try:
        ipaddress.ip_address(x.split("%")[0])
        return True
    except ValueError:
        return False
