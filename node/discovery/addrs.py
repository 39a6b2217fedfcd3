"""Which of a node's addresses another machine can dial.

The advertising policy itself is p2p/addrs.py (the host applies it to identify and peer
records too): an unspecified listen address becomes one address per interface IP, never
`0.0.0.0`; loopback only when there is nothing else. Here: the order in which a ticket
and mDNS offer them. Announced addresses first (the operator said so), then public, then
private/LAN addresses, loopback last (useful on this machine only).
"""

from __future__ import annotations

from p2p import addrs as policy


def expand_unspecified(addrs: list[str]) -> list[str]:
    """0.0.0.0 in an address becomes each interface's IP (same port and peer id)."""
    return policy.expand(addrs)


def _rank(addr: str) -> int:
    ip = policy.ip_of(addr)
    if ip is None:
        return 1  # a DNS name: the operator's choice
    if ip.is_loopback:
        return 3
    if ip.is_link_local or ip.is_unspecified:
        return 4
    return 2 if policy.block_of(ip) is not None else 0


def shareable(addrs: list[str], announce: list[str], limit: int = 4) -> list[str]:
    """Up to `limit` addresses to hand to another machine, best first: announced, public,
    private, then loopback (kept only when nothing else exists: a one-machine testnet)."""
    announced = [a for a in addrs if any(a.startswith(x.rstrip("/") + "/") for x in announce)]
    rest = sorted((a for a in expand_unspecified(addrs) if a not in announced), key=_rank)
    ranked = [a for a in [*announced, *rest] if _rank(a) < 4]
    if any(_rank(a) < 3 for a in ranked):
        ranked = [a for a in ranked if _rank(a) < 3]
    return ranked[:limit]
