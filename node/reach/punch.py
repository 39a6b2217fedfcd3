"""HolePunchService: a peer reached only through a relay is upgraded to a direct
connection by DCUtR (`/libp2p/dcutr`, TCP simultaneous open from the listen port).

What ../shared/notes/nat.md measured with py-libp2p 0.8.1, and what this service does
about it:

* **One side drives.** py-libp2p's auto-drive runs on both ends on the same 2 s tick and
  the two sessions cost each other rounds. Here the driver is fixed: both ends private
  (our reachability verdict says so, and the peer advertises `/p2p-circuit` addresses),
  and the lower peer id drives. The other end only answers. Where one end is public the
  private end simply dials it (the relay service's direct dial): no punch is needed, and
  a hard-NAT initiator towards a reachable peer is exactly the case DCUtR fails.
* **No step 0.** py-libp2p first dials every peerstore address with a 10 s timeout;
  a private peer's listen addresses are LAN addresses nobody outside reaches. The driver
  goes straight to CONNECT/SYNC; the punch dials the addresses in the peer's CONNECT
  (its observed WAN IP with its listen port) with a `dial_timeout_s` bound per dial.
* **Failure keeps the relay.** A failed punch leaves the relayed connection as it is and
  is tried again after `Backoff` (bounded attempts, doubling waits); a peer that
  reconnects starts afresh. Symmetric NATs never punch: they end on the relay.
* **Hostile input.** CONNECT/SYNC messages are read with the spec's 4 KiB limit; a
  peer's addresses are filtered (TCP over IP, at most `MAX_ADDRS`) before we dial any.
  Garbage, a wrong message or a failing punch is one log line and a counter in
  `node status`; the host never sees the exception. The address policy (p2p/addrs.py)
  filters them too: never an unspecified address, never one of our own listen addresses,
  loopback only in a loopback testnet, a private one only on a network we are on. Our
  own CONNECT never lists 0.0.0.0: it is expanded to our interface addresses (a dialer
  once punched its own machine 31 times at a peer's `0.0.0.0:PORT`).

The punch itself (parallel dials bound to the listen port, 3 rounds, the security roles
of a merged simultaneous open) is py-libp2p's `DCUtRProtocol._perform_hole_punch`; only
its message exchange and its driving are ours. Connections a punch opened are labelled
`punched` (`label`, read by the path service).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol, read_dcutr_msg
from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
from libp2p.relay.circuit_v2.utils import write_delimited_msg

from node.service import NodeContext
from p2p import addrs as addr_policy
from p2p.host import Substrate, is_relayed

log = logging.getLogger("node.punch")

PROTOCOL_ID = "/libp2p/dcutr"
MAX_ADDRS = 8  # a peer's CONNECT may list more; we dial no more than this many


class PunchError(Exception):
    """One DCUtR session that failed; the message says why (status and log)."""


@dataclass(frozen=True)
class Backoff:
    """When to punch a relayed peer again: at once, then `first_s`, doubling up to
    `max_s`; after `attempts` failures we stop until the peer reconnects."""

    first_s: float = 30.0
    max_s: float = 600.0
    attempts: int = 4

    def wait(self, failures: int) -> float:
        return min(self.max_s, self.first_s * 2 ** max(0, failures - 1))


@dataclass
class PeerPunch:
    """One relayed peer, as the driver sees it."""

    attempts: int = 0
    failures: int = 0
    next_at: float = 0.0  # trio clock
    state: str = "waiting"  # waiting, punching, punched, retrying, gave up
    error: str | None = None
    took_s: float | None = None  # the successful session's duration


@dataclass
class Schedule:
    """Per-peer attempts under a Backoff; pure bookkeeping on the trio clock."""

    backoff: Backoff = field(default_factory=Backoff)
    peers: dict[str, PeerPunch] = field(default_factory=dict)

    def due(self, peer: str, now: float) -> bool:
        p = self.peers.setdefault(peer, PeerPunch(next_at=now))
        return p.state in ("waiting", "retrying") and now >= p.next_at

    def started(self, peer: str) -> None:
        p = self.peers[peer]
        p.attempts += 1
        p.state = "punching"

    def succeeded(self, peer: str, took_s: float) -> None:
        p = self.peers[peer]
        p.state, p.error, p.took_s = "punched", None, round(took_s, 3)

    def failed(self, peer: str, now: float, reason: str) -> float | None:
        """Record a failure; returns the wait before the next attempt, None if we gave up."""
        p = self.peers[peer]
        p.failures += 1
        p.error = reason
        if p.failures >= self.backoff.attempts:
            p.state = "gave up"
            return None
        wait = self.backoff.wait(p.failures)
        p.state, p.next_at = "retrying", now + wait
        return wait

    def forget(self, peer: str) -> None:
        """The peer disconnected: a new relayed connection starts with a fresh budget."""
        self.peers.pop(peer, None)


Punch = Callable[[str], Awaitable[None]]  # raises PunchError (or anything) on failure


class HolePunchService:
    name = "punch"
    protocols = (PROTOCOL_ID,)

    def __init__(self, reachability: Callable[[], str], *, backoff: Backoff | None = None,
                 tick_s: float = 1.0, dial_timeout_s: float = 3.0,
                 message_timeout_s: float = 10.0, close_relayed_after_s: float = 60.0) -> None:
        self.reachability = reachability  # the reach service's verdict
        self.schedule = Schedule(backoff or Backoff())
        self.tick_s = tick_s
        self.dial_timeout_s = dial_timeout_s
        self.message_timeout_s = message_timeout_s
        self.close_relayed_after_s = close_relayed_after_s
        self.punched_conns: weakref.WeakSet[Any] = weakref.WeakSet()
        self.counts = {"attempts": 0, "punched": 0, "failed": 0, "answered": 0,
                       "answered_punched": 0, "protocol_errors": 0}
        self.last_error: str | None = None
        self.roles: dict[str, str] = {}  # relayed peer -> "drives" / "answers" / why neither
        # peers with a punch under way -> their direct connections before it: a new one is
        # the punch's even before the punch returns (the path shows `punched` at once)
        self._under_way: dict[str, list[Any]] = {}
        self._dcutr: DCUtRProtocol | None = None
        self._host: Any = None
        self.changed = trio.Event()  # set after each session (tests wait on it)

    # -- running --------------------------------------------------------------------------

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sub = ctx.substrate
        sub.set_handler(PROTOCOL_ID, self._answer(sub))
        task_status.started()
        async with trio.open_nursery() as nursery:
            await self.drive(lambda: self._relayed(sub),
                             lambda peer: self._punch(sub, peer, nursery))

    async def drive(self, relayed: Callable[[], dict[str, bool]], punch: Punch) -> None:
        """Forever, every `tick_s`: start a punch to each relayed peer we drive (`relayed`
        gives peer -> whether we drive) whose attempt is due. `punch` raises on failure."""
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    peers = relayed()
                except Exception as e:  # a host restarting under us: next tick
                    log.debug("punch: cannot list relayed peers: %r", e)
                    peers = {}
                for peer in list(self.schedule.peers):
                    if peer not in peers and self.schedule.peers[peer].state != "punching":
                        self.schedule.forget(peer)
                now = trio.current_time()
                for peer, we_drive in peers.items():
                    if we_drive and self.schedule.due(peer, now):
                        self.schedule.started(peer)
                        nursery.start_soon(self._attempt, peer, punch)
                await trio.sleep(self.tick_s)

    async def _attempt(self, peer: str, punch: Punch) -> None:
        self.counts["attempts"] += 1
        start = trio.current_time()
        try:
            await punch(peer)
        except Exception as e:
            reason = str(e) if isinstance(e, PunchError) else f"{type(e).__name__}: {e}"
            self.counts["failed"] += 1
            self.last_error = f"{peer}: {reason}"
            wait = self.schedule.failed(peer, trio.current_time(), reason)
            then = (f"retry in {wait:.0f} s" if wait is not None else
                    f"gave up after {self.schedule.backoff.attempts} attempts")
            log.info("punch: no direct connection to %s: %s; keeping the relay, %s", peer,
                     reason, then)
        else:
            took = trio.current_time() - start
            self.counts["punched"] += 1
            self.schedule.succeeded(peer, took)
            log.info("punch: direct connection to %s after %.2f s (was relayed)", peer, took)
        self.changed.set()
        self.changed = trio.Event()

    # -- who drives ---------------------------------------------------------------------

    def _relayed(self, sub: Substrate) -> dict[str, bool]:
        """Peers we reach only through a relay -> whether we drive their punch."""
        if sub.host is None:
            return {}
        me = sub.peer_id.to_base58()
        out: dict[str, bool] = {}
        roles: dict[str, str] = {}
        for peer, path in sub.peer_paths().items():
            if not path.startswith("relayed"):
                continue
            if self.reachability() != "private":
                roles[peer] = f"answers (this node is {self.reachability()})"
            elif not self._advertises_relay(sub, peer):
                roles[peer] = "dials it (the peer is reachable)"
            elif me < peer:
                roles[peer] = "drives"
            else:
                roles[peer] = "answers"
            out[peer] = roles[peer] == "drives"
        self.roles = roles
        return out

    @staticmethod
    def _advertises_relay(sub: Substrate, peer: str) -> bool:
        """A peer that advertises `/p2p-circuit` addresses holds relay reservations: it
        is private as well (its own verdict)."""
        try:
            addrs = sub.host.get_peerstore().addrs(ID.from_base58(peer))  # type: ignore[union-attr]
        except Exception:
            return False
        return any("/p2p-circuit" in str(a) for a in addrs)

    # -- one session, either side ---------------------------------------------------------

    def _protocol(self, sub: Substrate) -> DCUtRProtocol:
        """py-libp2p's DCUtR object for the current host (a restart makes a new host); we
        use its punch, never its run() (its auto-drive and step-0 dials)."""
        if self._dcutr is None or self._host is not sub.host:
            self._host = sub.host
            self._dcutr = DCUtRProtocol(_ListenAddrs(sub.host),  # type: ignore[arg-type]
                                        dial_timeout=self.dial_timeout_s)  # type: ignore[arg-type]
        return self._dcutr

    async def _punch(self, sub: Substrate, peer: str, nursery: trio.Nursery) -> None:
        """The driver's side: CONNECT, the peer's CONNECT, SYNC, wait RTT/2, dial."""
        assert sub.host is not None
        pid = ID.from_base58(peer)
        dcutr = self._protocol(sub)
        before = self._direct_conns(sub, pid)
        try:
            stream = await sub.host.new_stream(pid, [TProtocol(PROTOCOL_ID)])
        except Exception as e:
            raise PunchError(f"cannot open a DCUtR stream ({e})") from e
        self._under_way[peer] = before
        try:
            ours = HolePunch(type=HolePunch.CONNECT)
            ours.ObsAddrs.extend(_advertisable(await dcutr._get_observed_addrs()))
            sent = time.monotonic()
            theirs = await self._exchange(stream, ours, HolePunch.CONNECT)
            rtt = time.monotonic() - sent
            addrs = _dialable(list(theirs.ObsAddrs), sub.network())
            if not addrs:
                raise PunchError("the peer sent no address we can dial")
            with trio.fail_after(self.message_timeout_s):
                await write_delimited_msg(stream, HolePunch(type=HolePunch.SYNC))
            await trio.sleep(min(rtt / 2, 2.0))
            ok = await dcutr._perform_hole_punch(pid, addrs, as_responder=True)
            ok = self._mark(sub, pid, before) or ok
        finally:
            self._under_way.pop(peer, None)
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.close()
        if not ok:
            raise PunchError(f"no dial to {', '.join(str(a) for a in addrs)} got through")
        nursery.start_soon(self._close_relayed_later, sub, pid)

    def _answer(self, sub: Substrate):
        """The other side: the peer's CONNECT, ours, its SYNC, then dial at once."""
        async def handle(stream) -> None:
            pid = stream.muxed_conn.peer_id
            peer = pid.to_base58()
            self.counts["answered"] += 1
            try:
                dcutr = self._protocol(sub)
                if self._direct_conns(sub, pid):
                    return  # already direct: nothing to punch
                before = self._direct_conns(sub, pid)
                with trio.fail_after(self.message_timeout_s):
                    theirs = await _read(stream, HolePunch.CONNECT)
                addrs = _dialable(list(theirs.ObsAddrs), sub.network())
                ours = HolePunch(type=HolePunch.CONNECT)
                ours.ObsAddrs.extend(_advertisable(await dcutr._get_observed_addrs()))
                await self._exchange(stream, ours, HolePunch.SYNC)
                if not addrs:
                    raise PunchError("the peer sent no address we can dial")
                self._under_way[peer] = before
                ok = await dcutr._perform_hole_punch(pid, addrs)
                if self._mark(sub, pid, before) or ok:  # its SYN or ours: a new connection
                    self.counts["answered_punched"] += 1
                    log.info("punch: direct connection to %s (it drove the punch)", peer)
                else:
                    log.info("punch: %s drove a punch; no dial got through", peer)
            except Exception as e:
                reason = str(e) if isinstance(e, PunchError) else f"{type(e).__name__}: {e}"
                if isinstance(e, trio.TooSlowError):
                    reason = f"no message within {self.message_timeout_s:g} s"
                self.counts["protocol_errors"] += 1
                self.last_error = f"{peer}: {reason}"
                log.warning("punch: a DCUtR session from %s failed: %s", peer, reason)
            finally:
                self._under_way.pop(peer, None)
                self.changed.set()
                self.changed = trio.Event()
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await stream.close()
        return handle

    async def _exchange(self, stream, msg: HolePunch, expect: int) -> HolePunch:
        with trio.fail_after(self.message_timeout_s):
            await write_delimited_msg(stream, msg)
            return await _read(stream, expect)

    # -- connections ------------------------------------------------------------------------

    @staticmethod
    def _direct_conns(sub: Substrate, pid: ID) -> list[Any]:
        assert sub.host is not None
        return [c for c in sub.host.get_network().get_connections(pid) if not is_relayed(c)]

    def _mark(self, sub: Substrate, pid: ID, before: list[Any]) -> bool:
        """Label the direct connections the punch opened (those not there before: ours,
        or the peer's dial that got in); True if there is one."""
        new = [c for c in self._direct_conns(sub, pid) if all(c is not b for b in before)]
        for c in new:
            self.punched_conns.add(c)
        return bool(new)

    def label(self, conn: Any) -> str | None:
        """`punched` for a connection a punch opened, or one that appeared during a punch
        to its peer (the path service asks)."""
        if conn in self.punched_conns:
            return "punched"
        try:
            before = self._under_way.get(conn.muxed_conn.peer_id.to_base58())
        except Exception:
            return None
        if before is not None and all(conn is not b for b in before) and not is_relayed(conn):
            return "punched"
        return None

    async def _close_relayed_later(self, sub: Substrate, pid: ID) -> None:
        """After a grace period (streams already on the circuit finish), close the relayed
        connection: the relay's slot is freed. Only while the direct one still stands."""
        await trio.sleep(self.close_relayed_after_s)
        if sub.host is None or not self._direct_conns(sub, pid):
            return
        for c in list(sub.host.get_network().get_connections(pid)):
            if is_relayed(c):
                try:
                    await c.close()
                except Exception as e:
                    log.debug("punch: closing the relayed connection to %s: %r", pid, e)

    def statistics(self) -> dict[str, Any]:
        try:
            now = trio.current_time()
        except RuntimeError:  # outside trio (a test reading it afterwards)
            now = 0.0
        return {
            **self.counts,
            "error": self.last_error,
            "peers": {peer: {"role": self.roles.get(peer, "drives"), "state": p.state,
                             "attempts": p.attempts, "took_s": p.took_s, "error": p.error,
                             "retry_in_s": (round(max(0.0, p.next_at - now), 1)
                                            if p.state == "retrying" else None)}
                      for peer, p in self.schedule.peers.items()},
            "answering": sorted(p for p, r in self.roles.items() if r == "answers"),
        }


class _ListenAddrs:
    """The host as DCUtR sees it: `get_addrs` gives only our bound listen addresses.
    py-libp2p binds its punch dials to the first TCP address of `get_addrs`, which also
    lists announced ones (a UPnP mapping comes first): an address this machine does not
    have. Everything else is the host itself."""

    def __init__(self, host: Any) -> None:
        self._host = host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)

    def get_addrs(self) -> list[multiaddr.Multiaddr]:
        return list(self._host.get_transport_addrs())


async def _read(stream, expect: int) -> HolePunch:
    try:
        msg = await read_dcutr_msg(stream, HolePunch)
    except Exception as e:  # too large, truncated, not protobuf
        raise PunchError(f"bad DCUtR message ({type(e).__name__}: {e})") from None
    if msg.type != expect:
        raise PunchError(f"expected {HolePunch.Type.Name(expect)}, "  # type: ignore[arg-type]
                         f"got type {msg.type}")
    return msg


def _advertisable(raw: list[bytes]) -> list[bytes]:
    """Our CONNECT's addresses as the address policy advertises them: 0.0.0.0 expanded to
    this machine's interface addresses, never sent as it is."""
    out = []
    for b in raw:
        try:
            out.append(str(multiaddr.Multiaddr(b)))
        except Exception:
            continue
    return [multiaddr.Multiaddr(a).to_bytes() for a in addr_policy.expand(out)][:MAX_ADDRS]


def _dialable(raw: list[bytes], net: addr_policy.Network) -> list[multiaddr.Multiaddr]:
    """The peer's addresses we will dial: TCP over IPv4/IPv6, no relay, at most MAX_ADDRS,
    and only those the address policy allows (`net`: never unspecified, never our own
    listen addresses, loopback and private ranges only where we share that network): a
    CONNECT is someone else's list of places for us to send SYNs to."""
    out: list[multiaddr.Multiaddr] = []
    for b in raw[:64]:
        try:  # multiaddr parses lazily: garbage shows only when its parts are read
            a = multiaddr.Multiaddr(b)
            protos = [p.name for p in a.protocols()]
            str(a)
        except Exception:
            continue
        tcp = protos[:1] in (["ip4"], ["ip6"]) and protos[1:] == ["tcp"]
        if tcp and net.refuse(str(a)) is None and all(str(a) != str(x) for x in out):
            out.append(a)
        if len(out) >= MAX_ADDRS:
            break
    return out
