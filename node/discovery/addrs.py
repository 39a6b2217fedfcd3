"""Which of a node's addresses another machine can dial.

A node listening on 0.0.0.0 reports `/ip4/0.0.0.0/tcp/P/p2p/ID`: where it listens, not
where it can be reached. For a ticket and for mDNS that becomes one address per IPv4
interface (ifaddr, which zeroconf already depends on). Order: announced addresses first
(the operator said so), then private/LAN addresses, loopback last (useful on this
machine only).
"""

from __future__ import annotations

import ipaddress


def _ip(addr: str) -> str | None:
    parts = addr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None


def interface_ipv4s() -> list[str]:
    import ifaddr

    ips = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                ips.append(ip.ip)
    return ips


def expand_unspecified(addrs: list[str]) -> list[str]:
    """0.0.0.0 in an address becomes each interface's IPv4 (same port and peer id)."""
    out: list[str] = []
    for a in addrs:
        if _ip(a) == "0.0.0.0":
            out += [a.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in interface_ipv4s()]
        else:
            out.append(a)
    return list(dict.fromkeys(out))


def _rank(addr: str) -> int:
    try:
        ip = ipaddress.ip_address(_ip(addr) or "")
    except ValueError:
        return 1  # a DNS name: the operator's choice
    if ip.is_loopback:
        return 3
    if ip.is_link_local or ip.is_unspecified:
        return 4
    return 2 if ip.is_private else 0


def shareable(addrs: list[str], announce: list[str], limit: int = 4) -> list[str]:
    """Up to `limit` addresses to hand to another machine, best first: announced, public,
    private, then loopback (kept only when nothing else exists: a one-machine testnet)."""
    announced = [a for a in addrs if any(a.startswith(x.rstrip("/") + "/") for x in announce)]
    rest = sorted((a for a in expand_unspecified(addrs) if a not in announced), key=_rank)
    ranked = [*announced, *rest]
    if any(_rank(a) < 3 for a in ranked):
        ranked = [a for a in ranked if _rank(a) < 3]
    return ranked[:limit]
