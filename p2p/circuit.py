"""Circuit relay v2, the client's two calls: reserve a slot on a relay, dial through one.

py-libp2p 0.8.1 ships the messages and a relay (`libp2p.relay.circuit_v2`), but its swarm
skips `/p2p-circuit` addresses when dialing and its client transport does its own relay
discovery, whose negative protocol checks are cached forever (notes/libp2p.md). These two
functions speak the hop protocol directly over a stream the substrate opens, so a relayed
dial is one more address kind for `Substrate.connect`, and a reservation is one request
the relay service makes when it chooses to.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as PbPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

__all__ = ["HOP_PROTOCOL", "STOP_PROTOCOL", "CircuitError", "Reservation", "dial", "is_relayed",
           "reserve", "split"]

STATUS_TEXT = {
    StatusCode.RESERVATION_REFUSED: "reservation refused",
    StatusCode.RESOURCE_LIMIT_EXCEEDED: "the relay is at its limit",
    StatusCode.PERMISSION_DENIED: "permission denied (the relay is not public, or refuses us)",
    StatusCode.CONNECTION_FAILED: "the relay could not reach the peer",
    StatusCode.NO_RESERVATION: "the peer has no reservation on that relay",
    StatusCode.MALFORMED_MESSAGE: "the relay could not parse our request",
}


class CircuitError(Exception):
    """A reservation or relayed dial the relay refused or that broke; the message says why."""


@dataclass(frozen=True)
class Reservation:
    relay: str  # the relay's peer id
    expires_unix: float  # the relay's expiry (its clock, unix seconds)
    addrs: tuple[str, ...]  # the relay's addresses it sent, each ending in /p2p/<relay>
    limit_s: int  # the relay's per-circuit duration limit (0: none)
    limit_bytes: int  # its per-circuit byte limit (0: none)

    def circuit_addrs(self) -> list[str]:
        """Where others can dial us through this relay (no /p2p/<us> suffix: the host's
        address list appends it)."""
        return [f"{a}/p2p-circuit" for a in self.addrs]


def is_relayed(conn: Any) -> bool:
    """True if `conn` goes through a circuit relay (a connection closing under us: False).
    Both ends build the raw connection as RELAYED with the `/p2p-circuit` address, so this
    holds from the moment the swarm announces it (the gate's per-IP count reads it then)."""
    try:
        if str(getattr(conn.get_connection_type(), "value", "")) == "relayed":
            return True
        return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())
    except Exception:  # a connection closing under us: count it as what it most likely was
        return False


def split(addr: str) -> tuple[str, ID]:
    """`<relay addr>/p2p/<relay>/p2p-circuit/p2p/<peer>` -> (relay part, peer id)."""
    head, sep, tail = addr.partition("/p2p-circuit")
    if not sep or not tail.startswith("/p2p/") or "/p2p/" not in head:
        raise CircuitError(f"not a relayed address: {addr} (expected "
                           "<relay multiaddr>/p2p/<relay id>/p2p-circuit/p2p/<peer id>)")
    try:
        multiaddr.Multiaddr(addr)  # checks each part: a peer id must be a multihash
        return head, ID.from_base58(tail[len("/p2p/"):])
    except Exception as e:
        raise CircuitError(f"bad relayed address {addr}: {e}") from e


async def _hop(host: IHost, relay: ID, msg: HopMessage, timeout: float):
    stream = await host.new_stream(relay, [TProtocol(HOP_PROTOCOL)])
    try:
        with trio.fail_after(timeout):
            await write_delimited_msg(stream, msg)
            resp = await read_delimited_msg(stream, HopMessage)
    except BaseException:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await stream.reset()
        raise
    code = StatusCode(resp.status) if resp.HasField("status") else StatusCode.UNUSED
    if code != StatusCode.OK:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await stream.reset()
        raise CircuitError(f"relay {relay.to_base58()} said {code.name}: "
                           f"{STATUS_TEXT.get(code, 'refused')}")
    return stream, resp


async def reserve(host: IHost, relay: ID, timeout: float = 10.0) -> Reservation:
    """Ask a connected relay for a reservation (or renew ours)."""
    try:
        stream, resp = await _hop(host, relay, HopMessage(type=HopMessage.RESERVE), timeout)
    except CircuitError:
        raise
    except trio.TooSlowError:
        raise CircuitError(f"relay {relay.to_base58()} did not answer within {timeout:g} s")\
            from None
    except Exception as e:
        raise CircuitError(f"relay {relay.to_base58()}: {e!r}") from e
    await stream.close()
    addrs = []
    for raw in resp.reservation.addrs:
        try:
            a = str(multiaddr.Multiaddr(raw))
        except Exception:
            continue
        if a.endswith(f"/p2p/{relay.to_base58()}") and "/p2p-circuit" not in a:
            addrs.append(a)
    expires = float(resp.reservation.expire or time.time())
    return Reservation(relay.to_base58(), expires, tuple(addrs), int(resp.limit.duration),
                       int(resp.limit.data))


async def dial(host: IHost, addr: str, timeout: float) -> ID:
    """Open a connection to the peer at a relayed address: a hop CONNECT on the relay,
    then Noise and Yamux over that stream. The relay must be connected already or
    dialable at the address's relay part."""
    relay_part, peer = split(addr)
    relay = ID.from_base58(relay_part.rsplit("/p2p/", 1)[1])
    with trio.fail_after(timeout):
        if relay not in host.get_network().get_connections_map():
            transport = relay_part.rsplit("/p2p/", 1)[0]
            if transport:
                host.get_peerstore().add_addrs(relay, [multiaddr.Multiaddr(transport)], 600)
        msg = HopMessage(type=HopMessage.CONNECT, peer=PbPeerId(id=peer.to_bytes()))
        stream, _ = await _hop(host, relay, msg, timeout)
        circuit = multiaddr.Multiaddr(addr)
        raw = RawConnection(stream=stream, initiator=True,
                            connection_type=ConnectionType.RELAYED, addresses=[circuit])
        conn = await host.upgrade_outbound_connection(raw, peer)
    # as py-libp2p's relay does on the other side: the path shows as relayed
    with contextlib.suppress(Exception):
        conn.set_transport_info([circuit], ConnectionType.RELAYED)  # type: ignore[attr-defined]
    return peer
