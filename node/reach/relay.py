"""The relay a public node serves: py-libp2p's circuit relay v2 with every limit enforced.

py-libp2p 0.8.1's `CircuitV2Protocol` handles the hop and stop messages, reservations and
their per-peer circuit counts. What it leaves open, `BoundedRelay` closes:

* no cap on circuits across all peers: each destination may hold `circuits_per_peer`,
  and any number of destinations may exist; here `circuits` bounds them together;
* the circuit duration was checked only when data arrived, so a silent circuit held its
  slot forever; here the whole circuit runs under a deadline;
* bytes are counted on the relayed stream pair, both directions together, and the circuit
  closes when the next chunk would pass `circuit_bytes` (py-libp2p's per-circuit counter
  answered the source with a status message inside the relayed byte stream);
* a reservation for another peer id (`HopMessage.peer`) was accepted: it is always for
  the peer on the connection;
* every refusal and every forced close is one log line that says which limit and its
  value, and is counted in `node status` (`relay.serving`).

Only a public node relays (`serving()`): a private one answers PERMISSION_DENIED.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.connection_types import ConnectionType
from libp2p.io.exceptions import IncompleteReadError
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, StopMessage
from libp2p.relay.circuit_v2.protocol import (
    STREAM_READ_TIMEOUT,
    CircuitV2Protocol,
    _is_relayed_stream,
)
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits as LibLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg
from libp2p.tools.constants import MAX_READ_LEN

from p2p.gate import Misbehaviour, remote_ip

log = logging.getLogger("node.relay")


@dataclass(frozen=True)
class RelayLimits:
    """What one relay gives away (docs/nat.md lists these defaults). Generous next to
    go-libp2p's (2 min, 128 KiB per circuit): in a run, a relayed circuit carries a whole
    libp2p connection (gossip, heartbeats, averaging) between two NATed trainers."""

    reservations: int = 16  # peers holding a slot at once
    # slots held by peers on one IP: one host with 50 identities took all 16 (go-libp2p
    # caps reservations per IP too)
    reservations_per_ip: int = 4
    reservation_ttl_s: int = 3600  # a reservation lasts this long unless renewed
    circuits: int = 32  # open circuits, all peers together
    circuits_per_peer: int = 4  # open circuits to one reserved peer
    duration_s: int = 1800  # one circuit's lifetime; a redial opens a new one
    circuit_bytes: int = 512 * 2**20  # one circuit's bytes, both directions together

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class Circuit:
    src: str
    dst: str
    opened: float = field(default_factory=time.monotonic)
    bytes: int = 0
    closed: str | None = None  # the limit that closed it
    scopes: list[trio.CancelScope] = field(default_factory=list)  # its two directions


def _short(peer: ID | str) -> str:
    s = peer if isinstance(peer, str) else peer.to_base58()
    return f"…{s[-6:]}"


async def _reset(stream: INetStream | None) -> None:
    if stream is None:
        return
    with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
        await stream.reset()


async def _close(stream: INetStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.close()
        except Exception:
            await _reset(stream)


class BoundedRelay(CircuitV2Protocol):
    """The hop side of circuit relay v2 with `RelayLimits` enforced (module docstring).
    Its handlers are registered by the relay service behind the host's gate; the host is
    set by `attach` (a restarted host is a new object)."""

    def __init__(self, limits: RelayLimits, serving: Callable[[], bool]) -> None:
        lib = LibLimits(duration=limits.duration_s, data=limits.circuit_bytes,
                        max_circuit_conns=limits.circuits_per_peer,
                        max_reservations=limits.reservations,
                        reservation_ttl=limits.reservation_ttl_s)
        super().__init__(None, limits=lib, allow_hop=True)  # type: ignore[arg-type]
        self.bounds = limits
        self.serving = serving
        self.open: dict[int, Circuit] = {}  # id(hop stream) -> circuit
        self.refused: Counter[str] = Counter()
        self.closed: Counter[str] = Counter()
        self.circuits_total = 0
        self.bytes_relayed = 0

    def attach(self, host: Any) -> None:
        if self.host is not host:
            self.host = host
            self.resource_manager.host = host
            self.resource_manager.peer_store = host.get_peerstore()

    async def handle_incoming_connection(self, stream: INetStream,
                                         remote_peer_id: bytes) -> None:
        """The stop side: a relay brings us a connection. py-libp2p's version names the
        connection `/p2p/<our own id>/p2p-circuit/...`; the relay is the peer on `stream`."""
        relay = stream.muxed_conn.peer_id
        peer = ID(remote_peer_id)
        ma = multiaddr.Multiaddr(f"/p2p/{relay.to_base58()}/p2p-circuit/p2p/{peer.to_base58()}")
        raw = RawConnection(stream=stream, initiator=False,
                            connection_type=ConnectionType.RELAYED, addresses=[ma])
        try:
            muxed = await self.host.upgrade_inbound_connection(raw, ma)
        except Exception as e:
            await _close(stream)
            raise ConnectionError(f"relayed connection from {peer} via {relay}: {e}") from e
        for conn in self.host.get_network().get_connections(peer):
            if getattr(conn, "muxed_conn", None) is muxed:
                conn.set_transport_info([ma], ConnectionType.RELAYED)  # type: ignore[attr-defined]

    async def _handle_stop_stream(self, stream: INetStream) -> None:
        """The stop side's request, read under its deadline. py-libp2p's handler caught
        every error and logged one ERROR line each (200 garbage streams: 211 lines), so
        the gate never scored the sender; here a refusal is answered, then raised for the
        gate to score and log (rate-limited per peer)."""
        try:
            with trio.fail_after(STREAM_READ_TIMEOUT):
                msg = await read_delimited_msg(stream, StopMessage)
        except trio.TooSlowError:
            await self._refuse_stop(stream, StatusCode.CONNECTION_FAILED, "read timeout")
            raise
        except Exception as e:
            await self._refuse_stop(stream, StatusCode.MALFORMED_MESSAGE, "unreadable")
            if isinstance(e, (IncompleteReadError, trio.BrokenResourceError)):
                raise  # the relay went away mid-message: churn (`broken`)
            raise Misbehaviour("invalid", f"relay stop: unreadable request: {e!r}") from None
        if msg.type != StopMessage.CONNECT:
            await self._refuse_stop(stream, StatusCode.UNEXPECTED_MESSAGE, "CONNECT expected")
            raise Misbehaviour("invalid", f"relay stop: message type {msg.type}, not CONNECT")
        await self._send_stop_status(stream, StatusCode.OK, "Connection established")
        await self.handle_incoming_connection(stream, msg.peer.id)

    async def _refuse_stop(self, stream: INetStream, code: StatusCode, why: str) -> None:
        with trio.move_on_after(1.0), contextlib.suppress(Exception):
            await self._send_stop_status(stream, code, why)
        await _close(stream)

    # -- refusals -------------------------------------------------------------------------

    def _refuse(self, what: str, peer: ID, reason: str, key: str) -> None:
        self.refused[key] += 1
        log.warning("relay: refused a %s from %s: %s", what, peer.to_base58(), reason,
                    extra={"peer": peer.to_base58(), "reason": key})

    async def _handle_hop_stream(self, stream: INetStream) -> None:
        """One request per stream (RESERVE or CONNECT), as go's and our clients send it.
        py-libp2p's loop read on after a refusal and logged the client's reset as errors."""
        peer = stream.muxed_conn.peer_id
        if not self.serving():
            self.refused["not public"] += 1
            await self._refuse_on(stream, StatusCode.PERMISSION_DENIED,
                                  "this node is not publicly reachable, so not a relay")
            return
        if _is_relayed_stream(stream):  # the spec: no reservation or circuit over a circuit
            self._refuse("hop request over a relayed connection", peer, "not allowed",
                         "relayed")
            await self._refuse_on(stream, StatusCode.PERMISSION_DENIED, "relayed connection")
            return
        try:
            with trio.fail_after(STREAM_READ_TIMEOUT):
                msg = await read_delimited_msg(stream, HopMessage)
        except Exception as e:
            self.refused["malformed"] += 1
            await self._refuse_on(stream, StatusCode.MALFORMED_MESSAGE, "unreadable request")
            if isinstance(e, (IncompleteReadError, trio.BrokenResourceError)):
                raise  # ended mid-message: churn (`broken`)
            # garbage: the gate scores it and logs it (rate-limited per peer)
            raise Misbehaviour("invalid", f"relay hop: unreadable request: {e!r}") from None
        if msg.type == HopMessage.RESERVE:
            await self._handle_reserve(stream, msg)
            await _close(stream)
        elif msg.type == HopMessage.CONNECT:
            await self._handle_connect(stream, msg)
        else:
            self.refused["malformed"] += 1
            await self._refuse_on(stream, StatusCode.UNEXPECTED_MESSAGE, "RESERVE or CONNECT")

    async def _refuse_on(self, stream: INetStream, code: StatusCode, why: str) -> None:
        """The status, then a close (not a reset: the client reads the status first)."""
        await self._send_status(stream, code, why)
        await _close(stream)

    def reservations(self) -> dict[str, float]:
        """Peers holding a slot, and when it expires (unix seconds)."""
        self.resource_manager._clean_expired()
        return {p.to_base58(): r.expires_at
                for p, r in self.resource_manager._reservations.items()}

    def _release_disconnected(self) -> None:
        """A slot whose peer is no longer connected is freed (as go-libp2p does): nobody
        can be relayed to it, and peers that restarted with a new identity (or left)
        would otherwise hold every slot until their reservations expired (an hour)."""
        network = self.host.get_network()
        for peer in list(self.resource_manager._reservations):
            if not network.get_connections(peer):
                del self.resource_manager._reservations[peer]
                log.info("relay: released the slot of %s: it disconnected", peer.to_base58())

    async def _handle_reserve(self, stream: INetStream, msg: HopMessage) -> None:
        peer = stream.muxed_conn.peer_id
        msg.ClearField("peer")  # a slot is for the peer on this connection, never another
        rm = self.resource_manager
        self._release_disconnected()
        ip = remote_ip(stream)
        same_ip = sum(1 for p in rm._reservations
                      if p != peer and ip is not None and ip in self._peer_ips(p))
        if not rm.has_reservation(peer) and same_ip >= self.bounds.reservations_per_ip:
            self._refuse("reservation", peer, f"{same_ip} reservations held from {ip} "
                         f"(limit reservations_per_ip={self.bounds.reservations_per_ip})",
                         "reservations_per_ip")
            await self._refuse_on(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED,
                                  "too many reservations from your address")
            return
        if not rm.has_reservation(peer) and not rm.can_accept_reservation(peer):
            n = len(self.reservations())
            self._refuse("reservation", peer, f"{n} of {self.bounds.reservations} "
                         f"reservations in use (limit reservations={self.bounds.reservations})",
                         "reservations")
        elif not rm.has_reservation(peer):
            log.info("relay: reserved a slot for %s (%d of %d in use)", peer.to_base58(),
                     len(self.reservations()) + 1, self.bounds.reservations)
        await super()._handle_reserve(stream, msg)

    def _peer_ips(self, peer: ID) -> set[str]:
        return {ip for c in self.host.get_network().get_connections(peer)
                if (ip := remote_ip(c)) is not None}

    async def _handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        src = stream.muxed_conn.peer_id
        try:
            dst = ID(msg.peer.id)
            dst_b58 = dst.to_base58()
        except Exception:
            self.refused["malformed"] += 1
            await self._refuse_on(stream, StatusCode.MALFORMED_MESSAGE, "bad peer id")
            return
        b = self.bounds
        res = self.resource_manager.get_reservation(dst)
        code, reason, key = None, "", ""
        if len(self.open) >= b.circuits:
            code, key = StatusCode.RESOURCE_LIMIT_EXCEEDED, "circuits"
            reason = f"{len(self.open)} of {b.circuits} circuits open (limit circuits={b.circuits})"
        elif res is None or res.is_expired():
            code, key = StatusCode.NO_RESERVATION, "no reservation"
            reason = f"{_short(dst)} holds no reservation here"
        elif res.active_connections >= b.circuits_per_peer:
            code, key = StatusCode.RESOURCE_LIMIT_EXCEEDED, "circuits_per_peer"
            reason = (f"{_short(dst)} has {res.active_connections} circuits open "
                      f"(limit circuits_per_peer={b.circuits_per_peer})")
        if code is not None:
            self._refuse(f"circuit to {_short(dst)}", src, reason, key)
            await self._refuse_on(stream, code, reason)
            return
        circuit = Circuit(src.to_base58(), dst_b58)
        self.open[id(stream)] = circuit
        self.circuits_total += 1
        try:
            with trio.move_on_after(b.duration_s) as scope:
                await super()._handle_connect(stream, msg)
            if scope.cancelled_caught:
                circuit.closed = f"duration limit {b.duration_s} s reached"
                self.closed["duration_s"] += 1
                await _reset(stream)
        finally:
            del self.open[id(stream)]
            for peer in (src, dst):
                entry = self._active_relays.get(peer)
                if entry is not None and entry[0] is stream:
                    del self._active_relays[peer]
            self.bytes_relayed += circuit.bytes
            if circuit.closed:
                log.warning("relay: closed the circuit %s -> %s after %.0f s and %d bytes: %s",
                            src.to_base58(), dst_b58, time.monotonic() - circuit.opened,
                            circuit.bytes, circuit.closed,
                            extra={"peer": src.to_base58(), "reason": circuit.closed})

    async def _relay_data(self, src_stream: INetStream, dst_stream: INetStream, peer_id: ID,
                          deadline: float | None = None,
                          circuit_data_limit: list[int] | None = None) -> None:
        """One direction of a circuit. Both directions count into one `Circuit`; when
        either ends (EOF, reset, the byte limit) both streams are reset, which ends the
        other direction too."""
        circuit = self.open.get(id(src_stream)) or self.open.get(id(dst_stream))
        limit = self.bounds.circuit_bytes
        try:
            with trio.CancelScope() as scope:
                if circuit is not None:  # the other direction cancels us when it ends:
                    circuit.scopes.append(scope)  # a reset does not wake a yamux read
                while True:
                    try:
                        data = await src_stream.read(MAX_READ_LEN)
                    except Exception:
                        break
                    if not data:
                        break
                    if circuit is not None:
                        if circuit.bytes + len(data) > limit:
                            if circuit.closed is None:
                                circuit.closed = f"byte limit {limit} reached (circuit_bytes)"
                                self.closed["circuit_bytes"] += 1
                            break
                        circuit.bytes += len(data)
                    with trio.move_on_after(self.write_timeout) as write:
                        try:
                            await dst_stream.write(data)
                        except Exception:
                            break
                    if write.cancelled_caught:
                        break
        finally:
            if circuit is not None:
                for other in circuit.scopes:
                    other.cancel()
            await _reset(src_stream)
            await _reset(dst_stream)

    def statistics(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "limits": self.bounds.as_dict(),
            "reservations": {p: round(t) for p, t in self.reservations().items()},
            "circuits": [{"src": c.src, "dst": c.dst, "bytes": c.bytes,
                          "age_s": round(now - c.opened, 1)} for c in self.open.values()],
            "circuits_total": self.circuits_total,
            "bytes_relayed": self.bytes_relayed + sum(c.bytes for c in self.open.values()),
            "refused": dict(self.refused),
            "closed_by_limit": dict(self.closed),
        }
