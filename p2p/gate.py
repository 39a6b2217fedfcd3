"""The gate every inbound connection and stream passes: budget, deadlines, scores, bans.

Why here, under every handler: py-libp2p 0.8.1 runs a handler for each stream a peer opens,
without limit or deadline (its DHT handler read a half-sent message forever), and nothing
remembered a peer that sent garbage. `Gate` puts three checks in front of the host:

* connection: a banned peer, or one more connection than its IP (or range) may have, is
  closed as soon as it is up (`Notifee`); a relayed connection is not counted on an IP
  (its remote address is the relay's);
* stream, before protocol negotiation (`admit`): a banned peer's stream, or one over the
  budget (p2p/budget.py), is reset before anything else is allocated for it;
* stream, once its protocol is known (`guard`): the per-protocol budget, then the handler
  under its deadline; an exception in it ends that stream only, is classified (invalid,
  broken, deadline, ...) and lowers the peer's score (p2p/scores.py). A peer whose score
  falls below the threshold is banned: disconnected, its addresses dropped from the
  peerstore (so nothing redials it), its new connections and streams refused until the
  ban expires. A handler that can name the misbehaviour raises `Misbehaviour(kind, ...)`;
  code inside a library handler that swallows its errors calls `p2p.blame.blame`
  (p2p/dht.py, p2p/screens.py).

Log lines about a peer carry `extra={"peer", "reason"}` so the node's log filter
(node/status/logs.py) can rate-limit them per peer and reason; `statistics()` has totals.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from google.protobuf.message import DecodeError
from libp2p.abc import INetConn, INetStream, INotifee
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IOException, MessageTooLarge
from libp2p.peer.id import ID
from libp2p.stream_muxer.exceptions import MuxedConnError, MuxedStreamError

from p2p import screens
from p2p.blame import serving
from p2p.budget import Budget, BudgetLimits
from p2p.circuit import is_relayed
from p2p.scores import Ban, PeerScores, ScoreSettings

log = logging.getLogger(__name__)

Handler = Callable[[INetStream], Awaitable[None]]
Classify = Callable[[BaseException], str | None]

# Stream failures churn causes too: a peer that vanished mid-stream is not a liar.
_BROKEN = (IOException, MuxedStreamError, MuxedConnError, ConnectionError,
           trio.BrokenResourceError, trio.ClosedResourceError, EOFError)


# What py-libp2p's own handlers raise on bytes that break their protocol (gossipsub's
# handler lets these escape: unguarded, they took the whole host down).
_INVALID = (DecodeError, MessageTooLarge, ParseError)

# Refusals a peer brought on itself (the others say the node as a whole is full).
_PEERS_OWN = frozenset({"streams_per_peer", "bytes_per_peer"})


class Misbehaviour(Exception):
    """Raised by a handler that refused a peer's stream for a reason it can name: the gate
    scores `kind` (a key of p2p/scores.py's penalties) and logs the message once per the
    log filter's window, instead of the handler logging each one itself."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def default_classify(e: BaseException) -> str:
    if isinstance(e, Misbehaviour):
        return e.kind
    if isinstance(e, trio.TooSlowError):
        return "deadline"
    if isinstance(e, _INVALID):
        return "invalid"
    if isinstance(e, _BROKEN):
        return "broken"
    return "error"


class Gate:
    """Admission, deadlines and scoring for one host; `run` closes what it must close."""

    def __init__(self, limits: BudgetLimits | None = None,
                 scoring: ScoreSettings | None = None, *,
                 classify: Classify | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = Budget(limits)
        self.scores = PeerScores(scoring)
        self.classify = classify  # node/ knows its protocols' errors; None: p2p's own
        self.clock = clock
        self.misbehaviour: Counter[str] = Counter()  # kind -> times seen
        self.deadline_misses: Counter[str] = Counter()  # protocol -> streams cut
        self.handler_errors: Counter[str] = Counter()  # protocol -> handler failures
        self.last_handler_error = ""
        self._host: Any = None
        self._closing_send, self._closing_receive = trio.open_memory_channel[Any](256)
        self._conn_ips: dict[int, str] = {}  # id(connection) -> the IP it was counted on

    # -- the host ------------------------------------------------------------------------

    def attach(self, host: Any) -> None:
        """Put the gate in front of `host`'s inbound streams and connections."""
        screens.install()  # py-libp2p handlers that swallow garbage: blamed all the same
        self._host = host
        network = host.get_network()
        network.set_stream_handler(self.admit(host._swarm_stream_handler))
        network.register_notifee(_Notifee(self))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Close the connections the gate refused (outside py-libp2p's notifee calls)."""
        task_status.started()
        async for target in self._closing_receive:
            with trio.move_on_after(5), contextlib.suppress(Exception):
                if isinstance(target, ID):
                    if self._host is not None:
                        await self._host.disconnect(target)
                else:
                    await target.close()

    def _close_later(self, target: ID | INetConn) -> None:
        with contextlib.suppress(trio.WouldBlock):  # full: the next refusal asks again
            self._closing_send.send_nowait(target)

    # -- scores and bans -----------------------------------------------------------------

    def penalize(self, peer: str, kind: str) -> Ban | None:
        """Count a misbehaviour of `peer`; ban (and disconnect) it below the threshold."""
        self.misbehaviour[kind] += 1
        ban = self.scores.penalize(peer, kind, self.clock())
        if ban is not None:
            log.warning("banned peer %s for %.0f s (%s; ban #%d)", peer,
                        ban.until - self.clock(), kind, ban.count,
                        extra={"peer": peer, "reason": "banned"})
            self._drop(peer)
        return ban

    def banned(self, peer: str) -> Ban | None:
        return self.scores.banned(peer, self.clock())

    def _drop(self, peer: str) -> None:
        try:
            peer_id = ID.from_base58(peer)
        except Exception:
            return
        if self._host is not None:
            with contextlib.suppress(Exception):
                self._host.get_peerstore().clear_addrs(peer_id)
        self._close_later(peer_id)

    # -- streams -------------------------------------------------------------------------

    def admit(self, inner: Handler) -> Handler:
        """Wrap the host's stream entry point: bans and the budget, before negotiation."""

        async def admitted(stream: INetStream) -> None:
            peer = remote_peer(stream)
            reason = "banned" if self.banned(peer) else None
            if reason is None:
                peer_bytes, total_bytes = self._buffered(stream)
                reason = self.budget.admit_stream(peer, peer_bytes, total_bytes)
                if reason in _PEERS_OWN:  # a full node is not this peer's fault alone
                    self.penalize(peer, "over_budget")
            else:
                self.budget.refused["banned"] += 1
            if reason is not None:
                log.info("refused a stream from %s: %s", peer, reason,
                         extra={"peer": peer, "reason": reason})
                await _reset(stream)
                if reason == "banned":
                    self._close_later(stream.muxed_conn.peer_id)
                return
            try:
                await inner(stream)
            finally:
                self.budget.release_stream(peer)

        return admitted

    def guard(self, protocol: str, handler: Handler, deadline_s: float | None = None) -> Handler:
        """Wrap one protocol's handler: its per-protocol budget, its deadline (whole
        stream; None where the handler bounds each step itself), its errors scored."""

        async def guarded(stream: INetStream) -> None:
            peer = remote_peer(stream)
            reason = self.budget.admit_protocol(peer, protocol)
            if reason is not None:  # refused, not scored: honest peers get here too (one
                # protocol's rounds outpacing its exchanges); the per-peer budget scores
                log.info("refused a %s stream from %s: %s", protocol, peer, reason,
                         extra={"peer": peer, "reason": reason})
                await _reset(stream)
                return
            try:
                with serving(self.penalize, peer), \
                        trio.move_on_after(deadline_s if deadline_s else float("inf")) as scope:
                    await handler(stream)
                if scope.cancelled_caught:
                    raise trio.TooSlowError(f"stream outlived its {deadline_s:g} s deadline")
            except Exception as e:  # one bad stream must never take down the host
                kind = ((self.classify(e) if self.classify and not isinstance(e, Misbehaviour)
                         else None) or default_classify(e))
                self.penalize(peer, kind)
                if kind == "deadline":
                    self.deadline_misses[protocol] += 1
                self.handler_errors[protocol] += 1
                self.last_handler_error = f"{protocol} from {peer}: {e!r}"
                log.warning("handler %s failed for peer %s (%s): %r", protocol, peer, kind, e,
                            extra={"peer": peer, "reason": f"{protocol} {kind}"})
                await _reset(stream)
            finally:
                self.budget.release_protocol(peer, protocol)

        return guarded

    def _buffered(self, stream: INetStream) -> tuple[int, int]:
        """Unread bytes Yamux holds for this stream's peer, and for everyone (0 where
        the muxer does not say)."""
        network = self._host.get_network() if self._host is not None else None
        if network is None:
            return 0, 0
        peer_id = stream.muxed_conn.peer_id
        peer_bytes = total = 0
        for pid, conns in list(network.connections.items()):
            held = sum(_held(c) for c in conns)
            total += held
            if pid == peer_id:
                peer_bytes = held
        return peer_bytes, total

    # -- connections ---------------------------------------------------------------------

    def connected(self, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        if self.banned(peer.to_base58()):
            self.budget.refused["banned_connection"] += 1
            self._close_later(conn)
            return
        ip = remote_ip(conn)
        if ip is None or is_relayed(conn):
            # a relayed connection's remote IP is the relay's: counted there, every peer
            # the relay brings us took a share of the relay's own budget, and past it the
            # relay's circuits were closed. The relay's circuit limits (circuits_per_peer)
            # and our per-peer cap bound them instead.
            return
        reason = self.budget.admit_connection(ip)
        if reason is None:
            self._conn_ips[id(conn)] = ip
        elif _inbound(conn):  # our own dials are ours to make
            log.info("refused a connection from %s (%s): %s", peer, ip, reason,
                     extra={"peer": ip, "reason": reason})
            self._close_later(conn)

    def disconnected(self, conn: INetConn) -> None:
        ip = self._conn_ips.pop(id(conn), None)
        if ip is not None:
            self.budget.release_connection(ip)

    # -- status --------------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        now, wall = self.clock(), time.time()
        scores = self.scores.statistics(now)
        for ban in scores["bans"].values():
            ban["until_unix"] = round(wall + ban["seconds_left"], 1)
        return {
            **self.budget.statistics(),
            **scores,
            "misbehaviour": dict(self.misbehaviour),
            "deadline_misses": dict(self.deadline_misses),
            "handler_errors": dict(self.handler_errors),
        }


class _Notifee(INotifee):
    """Connections as they come and go (py-libp2p calls these inline: no awaiting here)."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def connected(self, network: Any, conn: INetConn) -> None:
        self.gate.connected(conn)

    async def disconnected(self, network: Any, conn: INetConn) -> None:
        self.gate.disconnected(conn)

    async def opened_stream(self, network: Any, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: Any, stream: INetStream) -> None:
        return None

    async def listen(self, network: Any, multiaddr: Any) -> None:
        return None

    async def listen_close(self, network: Any, multiaddr: Any) -> None:
        return None


def remote_peer(stream: INetStream) -> str:
    try:
        return stream.muxed_conn.peer_id.to_base58()
    except Exception:
        return "?"


async def _reset(stream: INetStream) -> None:
    with trio.move_on_after(1), contextlib.suppress(Exception):
        await stream.reset()
    discard_unread(stream)


def discard_unread(stream: Any) -> int:
    """Drop the bytes the muxer buffered for `stream` that nobody will read (a refused,
    reset or finished stream); how many. py-libp2p's Yamux keeps a closed or reset stream's
    unread bytes for 60 s, and they count in the sender's `bytes_per_peer`: our own
    refusals kept a peer over its budget, each new stream of it was refused in turn (its
    bytes kept too) and the peer was banned (the SybilWall swarm test: an honest node's
    history gossip to a sybil that does not read it). Call it only once the stream is done."""
    muxed = getattr(stream, "muxed_stream", None)
    buffers = getattr(getattr(stream, "muxed_conn", None), "stream_buffers", None)
    sid = getattr(muxed, "stream_id", None)
    if not isinstance(buffers, dict) or sid is None:
        return 0
    buf = buffers.get(sid)
    if not isinstance(buf, bytearray):
        return 0
    n = len(buf)
    buf.clear()  # the entry itself is Yamux's to drop, on its next sweep
    return n


def _held(conn: INetConn) -> int:
    buffers = getattr(getattr(conn, "muxed_conn", None), "stream_buffers", None)
    if not isinstance(buffers, dict):
        return 0
    return sum(len(b) for b in list(buffers.values()))


def remote_ip(conn: Any) -> str | None:
    """The remote IP of a connection or stream (None where the transport has none)."""
    try:
        remote = conn.muxed_conn.get_remote_address()
    except Exception:
        return None
    return str(remote[0]) if remote else None


def _inbound(conn: INetConn) -> bool:
    return "inbound" in str(getattr(conn, "direction", "")).lower()
