"""The resource budget: how many inbound streams, buffered bytes and connections we give.

Why: before it, one peer could hold 200 idle streams on every protocol (each a task and up
to a 256 KiB Yamux receive window) and nothing said no. Like libp2p's resource manager, a
stream is admitted or refused *before* its handler runs, with a reason, and counted. Two
checkpoints: `admit_stream` when a stream arrives (before protocol negotiation: a stream
that never negotiates counts too) and `admit_protocol` once its protocol is known.

Bytes in flight are what Yamux holds unread for a peer (its per-stream receive buffers):
the only buffering below our handlers we can measure; the handlers' own buffers are
bounded by each protocol's StreamLimits. The defaults are declared here, once, and listed
in docs/robustness.md; node/ may hand in other numbers (NodeConfig.budget).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class BudgetLimits:
    """Inbound resources one node gives; the defaults are docs/robustness.md's table."""

    streams_per_peer: int = 64  # inbound streams of one peer, every protocol together
    streams_per_peer_protocol: int = 16  # inbound streams of one peer on one protocol
    streams_total: int = 1024  # inbound streams of all peers
    bytes_per_peer: int = 32 << 20  # unread bytes Yamux buffers for one peer
    bytes_total: int = 256 << 20  # unread bytes Yamux buffers for all peers
    # Connections from one IP and from one range (/24 IPv4, /48 IPv6). High: a loopback
    # testnet has every peer on 127.0.0.1, and NATs put many honest peers behind one IP.
    conns_per_ip: int = 128
    conns_per_subnet: int = 512

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def subnet_of(ip: str) -> str:
    """The range an address is counted in: its /24 (IPv4) or /48 (IPv6)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    prefix = 24 if addr.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


class Budget:
    """Counters of what is in use, and the admission checks against `limits`.

    `admit_*` return None (admitted: the caller must `release_*` later) or the reason for
    refusing. Every refusal is counted in `refused` by reason.
    """

    def __init__(self, limits: BudgetLimits | None = None) -> None:
        self.limits = limits or BudgetLimits()
        self.streams: Counter[str] = Counter()  # peer -> inbound streams open
        self.by_protocol: Counter[tuple[str, str]] = Counter()  # (peer, protocol) -> open
        self.streams_open = 0
        self.conns_by_ip: Counter[str] = Counter()
        self.conns_by_subnet: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()

    # -- streams ------------------------------------------------------------------------

    def admit_stream(self, peer: str, peer_bytes: int = 0, total_bytes: int = 0) -> str | None:
        lim = self.limits
        reason = None
        if self.streams_open >= lim.streams_total:
            reason = "streams_total"
        elif self.streams[peer] >= lim.streams_per_peer:
            reason = "streams_per_peer"
        elif peer_bytes > lim.bytes_per_peer:
            reason = "bytes_per_peer"
        elif total_bytes > lim.bytes_total:
            reason = "bytes_total"
        if reason is not None:
            self.refused[reason] += 1
            return reason
        self.streams[peer] += 1
        self.streams_open += 1
        return None

    def release_stream(self, peer: str) -> None:
        self.streams_open -= 1
        _decrement(self.streams, peer)

    def admit_protocol(self, peer: str, protocol: str) -> str | None:
        if self.by_protocol[(peer, protocol)] >= self.limits.streams_per_peer_protocol:
            self.refused["streams_per_peer_protocol"] += 1
            return "streams_per_peer_protocol"
        self.by_protocol[(peer, protocol)] += 1
        return None

    def release_protocol(self, peer: str, protocol: str) -> None:
        _decrement(self.by_protocol, (peer, protocol))

    # -- connections ----------------------------------------------------------------------

    def admit_connection(self, ip: str) -> str | None:
        """Count a new connection from `ip`; refuse it over the per-IP or per-range limit."""
        subnet = subnet_of(ip)
        reason = None
        if self.conns_by_ip[ip] >= self.limits.conns_per_ip:
            reason = "conns_per_ip"
        elif self.conns_by_subnet[subnet] >= self.limits.conns_per_subnet:
            reason = "conns_per_subnet"
        if reason is not None:
            self.refused[reason] += 1
            return reason
        self.conns_by_ip[ip] += 1
        self.conns_by_subnet[subnet] += 1
        return None

    def release_connection(self, ip: str) -> None:
        _decrement(self.conns_by_ip, ip)
        _decrement(self.conns_by_subnet, subnet_of(ip))

    def statistics(self) -> dict[str, Any]:
        busiest = self.streams.most_common(5)
        return {
            "limits": self.limits.as_dict(),
            "inbound_streams": self.streams_open,
            "busiest_peers": dict(busiest),
            "connections_by_ip": dict(self.conns_by_ip.most_common(5)),
            "refused": dict(self.refused),
        }


def _decrement(counter: Counter, key: Any) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
