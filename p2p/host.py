"""The libp2p host a node runs on: TCP + Noise + Yamux, a DHT, gossipsub, guarded handlers.

`Substrate` owns one py-libp2p host and the services stacked on it. Two traps of
py-libp2p 0.8.1 are handled here once, so nothing above has to know about them:

* every dial waited a fixed 250 ms happy-eyeballs delay even after it had succeeded
  (notes/libp2p.md, pitfall 1): the delay is set to 0, we dial one transport anyway;
* an exception escaping a stream handler took the whole host down (pitfall 2):
  every handler registered through `set_handler` is guarded, and `serve()` restarts the
  host (same key, same listen addresses) if it dies anyway.

The guard is the host's `Gate` (p2p/gate.py): it also sits in front of the handlers
py-libp2p registers itself (the DHT's, gossipsub's, identify, ping), so every inbound
stream is budgeted, scored and, where it has one, held to its deadline.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

import libp2p.network.swarm as _swarm
import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID as GOSSIP_10
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as GOSSIP_11
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12 as GOSSIP_12
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from p2p import addrs as addr_policy
from p2p import circuit, lazy_select, muxer, peer_state
from p2p.circuit import is_relayed
from p2p.dht import DHT, STREAM_DEADLINE_S
from p2p.gate import Gate
from p2p.gossipsub import GossipSub
from p2p.slots import InboundSlots

log = logging.getLogger(__name__)

# Pitfall 1: a fixed 250 ms head start per dial, paid even on success. We offer one
# transport (TCP), so there is nothing to race.
_swarm._HAPPY_EYEBALLS_DELAY = 0.0
# py-libp2p's Yamux returns receive credit on every read (a WINDOW_UPDATE frame: Noise-
# encrypted, one send), and gossipsub reads each message's length prefix a byte at a
# time: several frames back for every message received. go-yamux's rule instead (its
# hysteresis: credit back once half the window is used). A user's own setting wins.
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")

Handler = Callable[[INetStream], Awaitable[None]]


class DialError(Exception):
    """A peer could not be reached; `addr` says which address and the message why."""

    def __init__(self, addr: str, reason: str) -> None:
        super().__init__(f"cannot reach {addr}: {reason}")
        self.addr = addr
        self.reason = reason


@dataclass(frozen=True)
class GossipSettings:
    """Gossipsub settings; py-libp2p's defaults suit demos, not a daemon (notes/libp2p.md §5)."""

    degree: int = 6
    degree_low: int = 4
    degree_high: int = 12
    # The default heartbeat is 120 s: meshes would take minutes to repair after churn.
    heartbeat_s: int = 1
    # The default spam limit (10 msg/s per peer and topic) silently dropped bursts of our own
    # messages; peertrain publishes a few per second, so 100/s only stops real floods.
    max_messages_per_topic_per_second: float = 100.0
    # Eclipse protection wants peers from >= 3 distinct IPs; on loopback or a LAN testnet
    # every peer shares one IP and the mesh would never fill.
    eclipse_protection: bool = False


@dataclass
class SubstrateStats:
    started: int = 0
    restarts: int = 0
    dials_refused: int = 0  # py-libp2p's own dials the dial policy refused


# Set while `Substrate.connect` dials an address it checked itself (_police_dials).
_CHECKED: ContextVar[bool] = ContextVar("peertrain_dial_checked", default=False)


def parse_peer_addr(addr: str) -> PeerInfo:
    """Turn `/ip4/1.2.3.4/tcp/4001/p2p/12D3...` into a PeerInfo, with a readable error."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as e:
        raise DialError(addr, f"not a peer multiaddr ({e}); expected "
                              "/ip4/<ip>/tcp/<port>/p2p/<peer-id>") from e


class Substrate:
    """One libp2p host plus DHT and gossipsub, restarted with the same identity if it dies.

    Users register protocol handlers with `set_handler` (before or after start): they
    survive a restart.
    """

    def __init__(
        self,
        key_pair: KeyPair,
        listen: Sequence[str],
        *,
        dht_protocol_validators: dict | None = None,
        gossip: GossipSettings | None = None,
        max_restarts: int = 5,
        gate: Gate | None = None,
        announce: Sequence[str] = (),
    ) -> None:
        self.key_pair = key_pair
        self.listen = [multiaddr.Multiaddr(a) for a in listen]
        # --announce: advertised first (identify, heartbeats, tickets), then the listen
        # addresses: a node behind a port forward is dialed there from outside, on its LAN
        # address inside.
        self._configured = [multiaddr.Multiaddr(a) for a in announce]
        self.gossip_settings = gossip or GossipSettings()
        self.max_restarts = max_restarts
        self._validators = dict(dht_protocol_validators or {})
        self._handlers: dict[str, Handler] = {}
        self.stats = SubstrateStats()
        self.gate = gate or Gate()
        self.slots = InboundSlots()  # py-libp2p's inbound cap, fixed (p2p/slots.py)
        self.host: IHost | None = None
        self.dht: DHT | None = None
        self.pubsub: Pubsub | None = None
        self.ready = trio.Event()
        self.peer_id = ID.from_pubkey(key_pair.public_key)
        # Addresses we advertise beside our listen addresses (a UPnP mapping): identify,
        # peer records and addrs() include them (py-libp2p's addrs_factory).
        self._announced: list[multiaddr.Multiaddr] = []
        self._relayed: list[str] = []  # `<relay addr>/p2p-circuit`: through a relay
        self.dht_server = True  # False: the DHT runs in client mode (an unreachable node)

    # -- handlers -----------------------------------------------------------------

    def set_handler(self, protocol: str, handler: Handler) -> None:
        """Register a handler for `protocol`; an exception in it ends that stream only."""
        self._handlers[protocol] = handler
        if self.host is not None:
            self.host.set_stream_handler(TProtocol(protocol), self.gate.guard(protocol, handler))

    @property
    def handler_errors(self) -> int:
        return sum(self.gate.handler_errors.values())

    # -- lifecycle ----------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the host until cancelled; restart it (bounded) if it crashes."""
        restarts = 0
        while True:
            try:
                await self._run_once(task_status)
                return
            except Exception as e:
                restarts += 1
                self.stats.restarts = restarts
                self.ready = trio.Event()
                if restarts > self.max_restarts:
                    log.error("host died %d times; giving up", restarts)
                    raise
                log.error("host died (%r); restarting (%d/%d)", e, restarts, self.max_restarts)
                task_status = trio.TASK_STATUS_IGNORED
                await trio.sleep(min(2.0 ** restarts * 0.1, 5.0))  # back off, bounded

    async def _run_once(self, task_status: trio.TaskStatus[None]) -> None:
        muxer.install()  # Yamux frames written whole: a cancelled write broke Noise (p2p/muxer.py)
        host = new_host(
            key_pair=self.key_pair,
            sec_opt={NOISE_ID: NoiseTransport(self.key_pair,
                                             noise_privkey=create_x25519_key_pair().private_key)},
            muxer_opt={TProtocol(YAMUX_ID): Yamux},
            listen_addrs=self.listen,
            addrs_factory=self._advertised,
        )
        self._with_relayed(host)
        self.slots.install(host.get_network())
        self._police_dials(host.get_network())
        peer_state.install(host)  # py-libp2p's per-peer maps that grow without end, bounded
        g = self.gossip_settings
        router = GossipSub(
            protocols=[GOSSIP_12, GOSSIP_11, GOSSIP_10],
            degree=g.degree,
            degree_low=g.degree_low,
            degree_high=g.degree_high,
            heartbeat_interval=g.heartbeat_s,
            max_messages_per_topic_per_second=g.max_messages_per_topic_per_second,
            eclipse_protection_enabled=g.eclipse_protection,
        )
        pubsub = Pubsub(host, router)
        # The DHT must exist before the first connection: identify then sees our kad
        # handler and peers add us to their routing tables (notes/libp2p.md §4).
        dht = DHT(host, validators=self._validators)
        # py-libp2p's own handlers (DHT, gossipsub, identify, ping) are guarded too; only
        # the DHT's stream gets a whole-stream deadline: gossipsub's streams live as long
        # as the connection, and ping and identify bound themselves.
        for proto, handler in list(host.get_mux().handlers.items()):
            if proto is not None and handler is not None:
                deadline = STREAM_DEADLINE_S if proto == dht.protocol else None
                host.set_stream_handler(proto, self.gate.guard(proto, handler, deadline))
        for protocol, handler in self._handlers.items():
            host.set_stream_handler(TProtocol(protocol), self.gate.guard(protocol, handler))
        self.gate.attach(host)
        if not self.dht_server:  # a restart keeps the mode reachability decided
            await dht.kad.switch_mode(DHTMode.CLIENT)
        async with (host.run(listen_addrs=self.listen), background_trio_service(pubsub),
                    background_trio_service(router), dht.running(),
                    trio.open_nursery() as nursery):
            try:
                await nursery.start(self.gate.run)
                await pubsub.wait_until_ready()
                self.host, self.dht, self.pubsub = host, dht, pubsub
                self.stats.started += 1
                self.ready.set()
                task_status.started()
                await trio.sleep(math.inf)  # cancelled by the node's shutdown
            finally:  # while the services still hold them: their exits forget them
                await _close_connections(host)

    # -- conveniences ---------------------------------------------------------------

    def addrs(self) -> list[str]:
        """Our listen addresses with /p2p/<id>, as strings others can dial."""
        if self.host is None:
            return []
        return [str(a) for a in self.host.get_addrs()]

    def _advertised(self, candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        """--announce addresses, those announced at run time (a UPnP mapping, the public
        side of a full-cone NAT), then our listen addresses: a dialer tries them in order,
        and behind a NAT the listen address is a LAN one that a silent NAT lets time out.
        An unspecified listen address (0.0.0.0) becomes this machine's interface addresses
        (p2p/addrs.py): it was advertised as it was, and peers dialed their own machine."""
        out: list[multiaddr.Multiaddr] = []
        own = addr_policy.expand(str(a) for a in candidates)
        for a in [*map(str, self._configured), *map(str, self._announced), *own]:
            ip = addr_policy.ip_of(a)
            if (ip is None or not ip.is_unspecified) and all(a != str(b) for b in out):
                out.append(multiaddr.Multiaddr(a))
        return out

    def _police_dials(self, swarm: Any) -> None:
        """Hold py-libp2p's own dials to the dial policy (p2p/addrs.py). Its `dial_peer`
        (host.connect and new_stream to a peer with no connection: gossipsub, the DHT,
        identify's push) and its replacement of unhealthy connections dial every address
        the peerstore holds, which identify, peer records and the DHT fill from what peers
        say: an unspecified or loopback address a peer advertised was a dial of our own
        machine. Every such dial goes through `_dial_with_retry`; a refused address fails
        like an unreachable one, and dial_peer tries the next. Dials this module checked
        itself (`connect`: an address the operator gave may be loopback when we listen on
        this machine) pass."""
        if getattr(swarm, "_peertrain_policed", False):
            return
        swarm._peertrain_policed = True
        dial = swarm._dial_with_retry

        async def policed(addr: Any, peer_id: ID, *args: Any, **kwargs: Any) -> Any:
            if not _CHECKED.get():
                reason = self.network().refuse(str(addr))
                if reason is not None:
                    self.stats.dials_refused += 1
                    raise SwarmException(f"not dialed {addr}: {reason}")
            return await dial(addr, peer_id, *args, **kwargs)

        swarm._dial_with_retry = policed

    def network(self) -> addr_policy.Network:
        """Where this node sits for the dial policy: our interface IPs and bound listen
        addresses (p2p/addrs.py)."""
        bound = [] if self.host is None else [str(a) for a in self.host.get_transport_addrs()]
        return addr_policy.Network.of(bound or [str(a) for a in self.listen])

    def peer_ips(self, peer: ID) -> list[str]:
        """The remote IPs of our direct connections to `peer` (relayed ones left out)."""
        if self.host is None:
            return []
        ips = []
        for conn in self.host.get_network().get_connections(peer):
            if is_relayed(conn):
                continue
            try:
                remote = conn.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
            except Exception:
                continue
            if remote:
                ips.append(str(remote[0]))
        return sorted(set(ips))

    def announce(self, addr: str) -> None:
        """Advertise `addr` (no /p2p/<us> suffix) as well as our listen addresses; a
        relayed one (`<relay>/p2p/<relay id>/p2p-circuit`) goes last."""
        if "/p2p-circuit" in addr:
            if addr not in self._relayed:
                self._relayed.append(addr)
        elif all(str(a) != addr for a in self._announced):
            self._announced.append(multiaddr.Multiaddr(addr))

    def withdraw(self, addr: str) -> None:
        self._announced = [a for a in self._announced if str(a) != addr]
        self._relayed = [a for a in self._relayed if a != addr]

    def _with_relayed(self, host: IHost) -> None:
        """py-libp2p's get_addrs strips an address from its first /p2p/ on to append ours,
        which turns `<relay>/p2p/<relay id>/p2p-circuit` into the relay's own address with
        our id. Relayed addresses are appended after that step instead (identify and peer
        records call get_addrs, so they carry them)."""
        plain = host.get_addrs

        def get_addrs() -> list[multiaddr.Multiaddr]:
            own = f"/p2p/{self.peer_id.to_base58()}"
            return [*plain(), *(multiaddr.Multiaddr(a + own) for a in self._relayed)]

        host.get_addrs = get_addrs  # type: ignore[method-assign]

    def listen_ports(self) -> list[int]:
        """The TCP ports we listen on (bound: port 0 resolved)."""
        if self.host is None:
            return []
        ports = []
        for a in self.host.get_transport_addrs():
            try:
                ports.append(int(a.value_for_protocol("tcp")))
            except Exception:
                continue
        return sorted(set(ports))

    def observed_ips(self) -> list[str]:
        """IPv4 addresses peers saw us connect from (identify's observed addresses, one
        observer is enough): behind a NAT, the NAT's public side."""
        manager = getattr(self.host, "_observed_addr_manager", None)
        if manager is None:
            return []
        ips = []
        for a in manager.addrs(min_observers=1):
            try:
                ips.append(a.value_for_protocol("ip4"))
            except Exception:
                continue
        return sorted(set(ips))

    async def set_dht_server(self, server: bool) -> None:
        """Serve the DHT (a reachable node) or only query it (client mode: we do not
        offer the DHT protocol, so peers do not keep us in their routing tables)."""
        self.dht_server = server
        if self.dht is None:
            return
        kad = self.dht.kad
        if server and kad.mode != DHTMode.SERVER:
            await kad.switch_mode(DHTMode.SERVER)
            # switch_mode registers KadDHT's bare handler: put it behind the gate again
            protocol = self.dht.protocol
            assert self.host is not None
            self.host.set_stream_handler(protocol, self.gate.guard(
                protocol, kad.handle_stream, STREAM_DEADLINE_S))
        elif not server and kad.mode != DHTMode.CLIENT:
            await kad.switch_mode(DHTMode.CLIENT)

    async def probe(self, peer: ID, addr: str, timeout: float) -> None:
        """Dial `addr` on a new connection, never one the swarm already has, and check
        that `peer` answers there (the Noise handshake proves its key); then close it.
        Raises DialError. Reachability checks need this: py-libp2p's connect() reuses an
        open connection and so 'reaches' any peer already connected to us."""
        assert self.host is not None
        swarm = self.host.get_network()
        maddr = multiaddr.Multiaddr(addr)
        transport = swarm.transport_manager.transport_for_dialing(maddr)  # type: ignore[attr-defined]
        if transport is None:
            raise DialError(addr, "no transport for this address")
        raw = None
        try:
            with trio.fail_after(timeout):
                raw = await transport.dial(maddr)
                secured = await swarm.upgrader.upgrade_security(raw, True, peer)  # type: ignore[attr-defined]
                await secured.close()
        except trio.TooSlowError:
            raise DialError(addr, f"no answer within {timeout:g} s") from None
        except Exception as e:
            raise DialError(addr, _dial_reason(e)) from e
        finally:
            if raw is not None:
                with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await raw.close()

    def connected_peers(self) -> list[ID]:
        return [] if self.host is None else self.host.get_connected_peers()

    def connection_paths(self) -> dict[str, str]:
        """Each connected peer's path: "relayed" when its best connection goes through a
        circuit relay (py-libp2p says so, or the address has /p2p-circuit), else "direct".
        For `node status`, the status page and the `peertrain_peers` metric."""
        if self.host is None:
            return {}
        paths = {}
        for peer, conns in self.host.get_network().get_connections_map().items():
            relayed = [is_relayed(c) for c in conns]
            if relayed:
                paths[peer.to_base58()] = "direct" if not all(relayed) else "relayed"
        return paths

    def peer_paths(self) -> dict[str, str]:
        """Each connected peer's path for `node status`: "direct", or "relayed via <relay
        peer id>" when every connection to it goes through a circuit relay."""
        if self.host is None:
            return {}
        paths = {}
        for peer, conns in self.host.get_network().get_connections_map().items():
            if not conns:
                continue
            relays = [relay_of(c) for c in conns]
            if any(r is None for r in relays):
                paths[peer.to_base58()] = "direct"
            else:
                paths[peer.to_base58()] = "relayed via " + (relays[0] or "?")
        return paths

    async def disconnect(self, peer: ID) -> None:
        """Close every connection to `peer` (the redialer trims past its connection bound)."""
        if self.host is not None:
            await self.host.disconnect(peer)

    async def connect(self, addr: str, timeout: float = 10.0) -> ID:
        """Dial a peer multiaddr; raise DialError with the reason on failure."""
        if "/p2p-circuit" in addr:
            return await self._connect_relayed(addr, timeout)
        info = parse_peer_addr(addr)
        if info.peer_id == self.peer_id:
            raise DialError(addr, "that is this node's own address")
        if (ban := self.gate.banned(info.peer_id.to_base58())) is not None:
            raise DialError(addr, f"peer is banned ({ban.reason})")
        assert self.host is not None
        network = self.host.get_network()
        try:
            with trio.fail_after(timeout):
                if network.get_connections(info.peer_id) or not info.addrs:
                    await self.host.connect(info)  # reuses it (waits until it is ready)
                else:
                    self._check_dialable(addr)
                    # This address, not py-libp2p's pick: its dial_peer dials only the
                    # first TCP address in the peerstore, so a peer whose first address is
                    # a LAN one (behind a full-cone or UPnP NAT) was never dialed at the
                    # public address it also advertises.
                    self.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 120)
                    checked = _CHECKED.set(True)
                    try:
                        conn = await network.dial_addr(info.addrs[0], info.peer_id)
                    finally:
                        _CHECKED.reset(checked)
                    started = getattr(conn, "event_started", None)
                    if started is not None:
                        await started.wait()
        except trio.TooSlowError:
            raise DialError(addr, f"no answer within {timeout:g} s") from None
        except DialError:
            raise
        except Exception as e:
            raise DialError(addr, _dial_reason(e)) from e
        if self.dht is not None:
            await self.dht.add_peer(info.peer_id)
        return info.peer_id

    def _check_dialable(self, addr: str) -> None:
        """Raise DialError for an address the dial policy (p2p/addrs.py) refuses. Here an
        address someone gave us to join by: loopback is fine whenever we listen on this
        machine's loopback (127.0.0.1 or 0.0.0.0): the operator's local bootstrap."""
        net = self.network()
        local = any((ip := addr_policy.ip_of(a)) is not None and
                    (ip.is_loopback or ip.is_unspecified) for a in net.listen)
        reason = net.refuse(addr, peer_local=local)
        if reason is not None:
            raise DialError(addr, f"not dialed: {reason}")

    def direct_addrs(self, peer: ID) -> list[str]:
        """The addresses the peerstore (identify, peer records) has for `peer`, relayed
        ones left out."""
        assert self.host is not None
        try:
            addrs = self.host.get_peerstore().addrs(peer)
        except Exception:  # py-libp2p's PeerStoreError: nothing known
            return []
        return [str(a) for a in addrs if "/p2p-circuit" not in str(a)]

    async def connect_direct(self, peer: ID, timeout: float = 3.0) -> str | None:
        """Open a direct connection to a peer we reach only through a relay, at its
        `direct_addrs` (outbound works through any NAT, so a private node reaches a
        public peer that reached it through a relay). A new connection even though one
        exists (py-libp2p's connect would reuse the relayed one); new streams prefer it.
        Returns the address that answered, or None."""
        assert self.host is not None
        swarm = self.host.get_network()
        for a in self.network().dialable(self.direct_addrs(peer)):
            try:
                with trio.fail_after(timeout):
                    await swarm.dial_addr(multiaddr.Multiaddr(a), peer)
                return a
            except Exception as e:  # unreachable from here: the next address
                log.debug("direct dial %s at %s: %s", peer, a, e)
        return None

    async def _connect_relayed(self, addr: str, timeout: float) -> ID:
        """Dial through the relay named in `addr` (p2p/circuit.py); py-libp2p's swarm
        skips /p2p-circuit addresses."""
        assert self.host is not None
        try:
            _, peer = circuit.split(addr)
        except circuit.CircuitError as e:
            raise DialError(addr, str(e)) from None
        if peer == self.peer_id:
            raise DialError(addr, "that is this node's own address")
        if (ban := self.gate.banned(peer.to_base58())) is not None:
            raise DialError(addr, f"peer is banned ({ban.reason})")
        try:
            await circuit.dial(self.host, addr, timeout)
        except trio.TooSlowError:
            raise DialError(addr, f"no answer through the relay within {timeout:g} s") from None
        except circuit.CircuitError as e:
            raise DialError(addr, str(e)) from None
        except Exception as e:
            raise DialError(addr, _dial_reason(e)) from e
        # Remember where it answered: the hole-punch service tells a private peer (one
        # with relayed addresses) by them, before identify has told us.
        with contextlib.suppress(Exception):
            self.host.get_peerstore().add_addrs(
                peer, [multiaddr.Multiaddr(addr.rsplit("/p2p/", 1)[0])], 600)
        return peer

    def require_host(self) -> IHost:
        """The running host: services use it only while the substrate serves."""
        if self.host is None:
            raise RuntimeError("the substrate is not serving")
        return self.host

    def protocols_of(self, peer: ID) -> list[str]:
        """The protocols `peer`'s identify listed; empty while we have none from it."""
        try:
            return list(self.host.get_peerstore().get_protocols(peer)) if self.host else []
        except Exception:  # a peer the peerstore does not know
            return []

    async def open_stream(self, peer: ID, protocol: str, *, lazy: bool = False) -> INetStream:
        """A new stream to `peer`, on its open connection or a new one; a peer that can
        only be reached through a relay is dialed at the relayed addresses the peerstore
        has for it (its peer record), since py-libp2p's dialer skips them.

        `lazy`: the caller writes a request, then reads the answer. To a connected peer
        whose identify lists `protocol`, the protocol is then proposed without waiting for
        its confirmation (p2p/lazy_select.py: two round trips fewer)."""
        assert self.host is not None
        if lazy and self.host.get_network().get_connections(peer) and \
                protocol in self.protocols_of(peer):
            # a proxy of the stream (every attribute but `read` is the stream's own)
            return cast(INetStream, await lazy_select.open_lazily(self.host, peer, protocol))
        try:
            return await self.host.new_stream(peer, [TProtocol(protocol)])
        except Exception as e:
            relayed = [str(a) for a in self.host.get_peerstore().addrs(peer)
                       if "/p2p-circuit" in str(a)]
            if not relayed or self.host.get_network().get_connections(peer):
                raise
            for addr in relayed:
                if not addr.endswith(f"/p2p/{peer.to_base58()}"):
                    addr = f"{addr}/p2p/{peer.to_base58()}"
                try:
                    await self._connect_relayed(addr, 10.0)
                    break
                except DialError as d:
                    log.debug("relayed dial %s: %s", addr, d)
            else:
                raise e
            return await self.host.new_stream(peer, [TProtocol(protocol)])


def _dial_reason(e: BaseException) -> str:
    """Dig the root cause out of py-libp2p's wrapped dial errors."""
    seen = e
    for _ in range(16):  # causes, ExceptionGroups and py-libp2p's MultiError, first of each
        inner = getattr(seen, "exceptions", None) or getattr(seen, "errors", None)
        if seen.__cause__ is not None:
            seen = seen.__cause__
        elif inner and isinstance(inner[0], BaseException):
            seen = inner[0]
        else:
            break
    text = str(seen) or type(seen).__name__
    if "refused" in text.lower() or isinstance(seen, ConnectionRefusedError):
        return "connection refused (is a node listening there?)"
    return text


def relay_of(conn: Any) -> str | None:
    """The relay's peer id if `conn` goes through a circuit relay ("" if unknown), else
    None."""
    if not is_relayed(conn):
        return None
    try:
        for a in conn.get_transport_addresses():
            head = str(a).split("/p2p-circuit")[0]
            if "/p2p/" in head:
                return head.rsplit("/p2p/", 1)[1]
    except Exception:
        pass
    return ""




CLOSE_S = 2.0  # a stopping (or restarting) host closes its connections within this


async def _close_connections(host: Any) -> None:
    """Close every connection of a host that stops, shielded and bounded. py-libp2p's
    `host.run()` leaves its connections open when cancelled: a process that restarts its
    host (or a benchmark agent that takes a fresh identity) kept every old connection, and
    each peer kept counting it against our IP until its per-IP limit refused us (measured:
    the reach benchmark's relays after ~100 fresh identities from one address). Its own
    `Swarm.close()` is not enough either: a connection whose close the cancellation
    interrupted counts as closed there, socket open, so each one's secure channel (and
    with it the socket) is closed here as well."""
    with trio.move_on_after(CLOSE_S) as scope:
        scope.shield = True
        network = host.get_network()
        conns = [c for cs in list(network.connections.values()) for c in cs]
        try:
            await network.close()
        except Exception as e:  # best effort: the process may be going down anyway
            log.debug("closing the host's connections: %r", e)
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.muxed_conn.secured_conn.close()
