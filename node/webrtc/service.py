"""The `webrtc` service: WebRTC data channels to peers reached only through a relay.

Circuit relays carry every peer (docs/nat.md) but at relay speed and on a public peer's
budget; two peers behind NATs that drop TCP punches may still find a UDP pair through ICE.
For each connected peer whose only path is a relay, the peer with the smaller id offers:

1. its STUN server: the first directly connected peer that answers a Binding Request at
   its libp2p address's IP and port over UDP (public peers answer, node/webrtc/stun.py);
2. SDP offer/answer over `/peertrain/webrtc-signal/1.0.0` (protocols/webrtc_signal.py),
   on the relayed libp2p connection;
3. ICE, DTLS, SCTP (aiortc, on the asyncio thread: node/webrtc/bridge.py), bounded by
   CONNECT_TIMEOUT_S; on failure the relay stays the path and the offer is retried after
   a backoff (RETRY_S, doubling up to MAX_RETRY_S).

While a session is up, `open_stream` gives the protocols that registered here (averaging,
checkpoint pulls) a data channel (node/webrtc/channel.py) instead of a relayed libp2p
stream, and `node status` shows the peer's path as `webrtc`. A direct path, when one
appears, wins again.
"""

from __future__ import annotations

import importlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from node.service import NodeContext
from node.transport.streams import close_quietly, next_event
from node.webrtc import PATH_WEBRTC, SessionError
from node.webrtc.bridge import AsyncioThread
from node.webrtc.channel import DataChannelStream
from node.webrtc.stun import StunResponder, find_stun
from p2p.gate import Misbehaviour
from p2p.host import Substrate
from protocols import webrtc_signal as sig
from protocols.errors import RemoteProtocolError
from protocols.wire import Envelope

if TYPE_CHECKING:
    from node.webrtc.session import RtcSession

log = logging.getLogger("node.webrtc")

PASS_S = 5.0
CONNECT_TIMEOUT_S = 20.0
RETRY_S, MAX_RETRY_S = 60.0, 600.0
MAX_SESSIONS = 16
MAX_STREAMS_PER_SESSION = 8
STUN_CACHE_S = 60.0
MAX_STUN_PROBES = 6

Handler = Callable[[Any], Awaitable[None]]


class WebRtcService:
    name = "webrtc"
    protocols = (sig.PROTOCOL_ID,)

    def __init__(self, verdict: Callable[[], str], *, offer: bool = True,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 answer_direct: bool = False) -> None:
        self.verdict = verdict
        self.offer = offer  # False: answer offers only (tests)
        # True: answer offers from directly connected peers too (tests of the SDP on
        # loopback); a node never does: a direct path needs no session
        self.answer_direct = answer_direct
        self.connect_timeout_s = connect_timeout_s
        self.stun = StunResponder(lambda: verdict() == "public")
        self.sessions: dict[str, RtcSession] = {}
        self.handlers: dict[str, Handler] = {}
        self.me = ""
        self.stun_server: tuple[str, int] | None = None
        self._stun_at = -1e9
        self._retry_at: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._pending: set[str] = set()
        self._open_streams: dict[str, int] = {}
        self.offers_made = self.answers_made = self.refused = self.failed = 0
        self.last_error: str | None = None
        self.bridge: AsyncioThread | None = None
        self._sub: Substrate | None = None
        self._nursery: trio.Nursery | None = None
        self._rtc: Any = None  # node.webrtc.session, imported at the first session
        self._loading = trio.Lock()

    def set_handler(self, protocol: str, handler: Handler) -> None:
        """Serve `protocol` on inbound data channels too (the averaging responder)."""
        self.handlers[protocol] = handler

    # -- the service ------------------------------------------------------------------

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.serve(ctx.substrate, task_status=task_status)

    async def serve(self, sub: Substrate, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._sub, self.me = sub, sub.peer_id.to_base58()
        ip = _listen_ip(sub)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                sub.set_handler(sig.PROTOCOL_ID, self._handle_signal)
                task_status.started()
                await sub.ready.wait()
                ports = sub.listen_ports()
                if ports:
                    await nursery.start(self.stun.serve, ip, ports[0])
                while True:
                    if self.offer:
                        try:
                            self._pass(sub, nursery)
                        except Exception as e:  # a peer vanishing under us: next pass
                            log.debug("webrtc: pass: %r", e)
                    await trio.sleep(PASS_S)
        finally:
            with trio.CancelScope(shield=True):
                for session in list(self.sessions.values()):
                    await session.close()
                if self.bridge is not None:
                    self.bridge.stop()

    async def _aiortc(self) -> Any:
        """node.webrtc.session and the asyncio thread, started at the first session: aiortc
        (and PyAV under it) takes ~1 s of CPU to import, which a node that never needs a
        session (most: direct paths) should not pay, least of all while it joins."""
        async with self._loading:
            if self._rtc is None:
                rtc = await trio.to_thread.run_sync(importlib.import_module,
                                                    "node.webrtc.session")
                ip = _listen_ip(self._sub) if self._sub is not None else "0.0.0.0"
                rtc.gather_only([ip] if ip != "0.0.0.0" else None)
                self.bridge = AsyncioThread()
                self._rtc = rtc
        return self._rtc

    def statistics(self) -> dict[str, Any]:
        return {"paths": self.paths(),
                "sessions": {p: describe(s) for p, s in sorted(self.sessions.items())},
                "stun_server": f"{self.stun_server[0]}:{self.stun_server[1]}"
                if self.stun_server else None,
                "stun": self.stun.statistics(),
                "offers": self.offers_made, "answers": self.answers_made,
                "failed": self.failed, "refused": self.refused, "error": self.last_error}

    def paths(self) -> dict[str, str]:
        """Peers whose streams go over a data channel: a session is up and no direct
        libp2p connection exists."""
        if self._sub is None:
            return {}
        libp2p = self._sub.peer_paths()
        return {p: PATH_WEBRTC for p, s in self.sessions.items()
                if s.up.is_set() and not s.down.is_set() and libp2p.get(p) != "direct"}

    # -- streams ----------------------------------------------------------------------

    async def open_stream(self, peer: ID, protocol: str, *,
                          lazy: bool = False) -> INetStream | DataChannelStream:
        """A data channel to `peer` if its path is webrtc, else a libp2p stream (`lazy`:
        see Substrate.open_stream)."""
        assert self._sub is not None
        key = peer.to_base58()
        session = self.sessions.get(key)
        if session is not None and key in self.paths():
            try:
                return await session.open_stream(protocol)
            except (SessionError, trio.TooSlowError) as e:
                log.info("webrtc: no data channel to %s (%s); the relayed stream", key, e)
        return await self._sub.open_stream(peer, protocol, lazy=lazy)

    def _on_channel(self, stream: DataChannelStream) -> None:
        """An inbound data channel (trio side): its protocol's handler, or closed."""
        handler = self.handlers.get(stream.protocol)
        open_now = self._open_streams.get(stream.peer, 0)
        if handler is None or open_now >= MAX_STREAMS_PER_SESSION or self._nursery is None:
            why = ("no handler for " + repr(stream.protocol[:60]) if handler is None
                   else f"{open_now} streams open")
            log.info("webrtc: closed a data channel from %s: %s", stream.peer, why)
            if self._nursery is not None:
                self._nursery.start_soon(stream.close)
            return
        self._nursery.start_soon(self._serve_stream, handler, stream)

    async def _serve_stream(self, handler: Handler, stream: DataChannelStream) -> None:
        self._open_streams[stream.peer] = self._open_streams.get(stream.peer, 0) + 1
        try:
            await handler(stream)
        except Exception as e:  # the handler's own business; this stream only
            log.info("webrtc: %s handler for %s: %r", stream.protocol, stream.peer, e)
        finally:
            self._open_streams[stream.peer] -= 1
            with trio.move_on_after(2):
                await stream.close()

    # -- offering ---------------------------------------------------------------------

    def _pass(self, sub: Substrate, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        store = sub.host.get_peerstore() if sub.host is not None else None
        for peer, path in sub.peer_paths().items():
            if not path.startswith("relayed") or not self.me < peer:
                continue  # direct already, or the other side offers
            if peer in self._pending or self._retry_at.get(peer, 0.0) > now:
                continue
            session = self.sessions.get(peer)
            if session is not None and not session.down.is_set():
                continue
            try:
                speaks = store is not None and \
                    sig.PROTOCOL_ID in store.get_protocols(ID.from_base58(peer))
            except Exception:
                speaks = False
            if not speaks:
                continue  # identify has not said yet, or an older peer
            if len(self.sessions) >= MAX_SESSIONS:
                return
            self._pending.add(peer)
            nursery.start_soon(self._connect, peer)

    async def connect(self, peer: str) -> RtcSession:
        """Offer a session to `peer` and wait until it is up (SessionError if not)."""
        assert self._sub is not None
        rtc = await self._aiortc()
        sub, pid = self._sub, ID.from_base58(peer)
        old = self.sessions.pop(peer, None)
        if old is not None:
            await old.close()
        stun_server = await self._find_stun(sub)
        session = rtc.RtcSession(self.bridge, pid, stun_server, self._on_channel)
        self.sessions[peer] = session
        try:
            offer = await session.offer()
            req_id = secrets.randbits(48)
            with trio.fail_after(sig.DEADLINE_S):
                stream = await sub.open_stream(pid, sig.PROTOCOL_ID)
                try:
                    await stream.write(sig.encode_offer(req_id, offer))
                    self.offers_made += 1
                    env = await next_event(stream, sig.LIMITS.decoder())
                finally:
                    await close_quietly(stream)
            if not isinstance(env, Envelope):
                raise RemoteProtocolError("expected an answer envelope")
            await session.accept(sig.parse_answer(env, req_id))
            await session.connected(self.connect_timeout_s)
        except BaseException:
            with trio.CancelScope(shield=True):
                await session.close()
            if self.sessions.get(peer) is session:
                del self.sessions[peer]
            raise
        return session

    async def _connect(self, peer: str) -> None:
        try:
            session = await self.connect(peer)
        except Exception as e:  # SessionError, a refusal, no answer, a lost relay
            backoff = min(MAX_RETRY_S, self._backoff.get(peer, RETRY_S / 2) * 2)
            self._backoff[peer] = backoff
            self._retry_at[peer] = trio.current_time() + backoff
            self.failed += 1
            self.last_error = f"{peer}: {_reason(e)}"
            log.info("webrtc: no session with %s: %s; the relay stays the path (retry in "
                     "%.0f s)", peer, _reason(e), backoff)
            return
        finally:
            self._pending.discard(peer)
        self._backoff.pop(peer, None)
        log.info("webrtc: session with %s up (%s)", peer, session.pair)
        await self._watch(peer, session)

    async def _watch(self, peer: str, session: RtcSession) -> None:
        await session.down.wait()
        log.info("webrtc: session with %s down: %s", peer, session.reason)
        if self.sessions.get(peer) is session:
            del self.sessions[peer]

    async def _find_stun(self, sub: Substrate) -> tuple[str, int] | None:
        """The run's STUN server for our next session (cached STUN_CACHE_S): a directly
        connected peer answering on UDP at its TCP address."""
        now = trio.current_time()
        if self.stun_server is not None and now - self._stun_at < STUN_CACHE_S:
            return self.stun_server
        candidates: list[tuple[str, int]] = []
        for peer, path in sub.peer_paths().items():
            if path != "direct":
                continue
            for addr in sub.direct_addrs(ID.from_base58(peer)):
                hostport = _ip_tcp(addr)
                if hostport and hostport not in candidates:
                    candidates.append(hostport)
        self.stun_server = await find_stun(candidates[:MAX_STUN_PROBES])
        self._stun_at = now
        if self.stun_server is None:
            log.info("webrtc: no STUN server among %d candidates; host candidates only",
                     len(candidates))
        return self.stun_server

    # -- answering --------------------------------------------------------------------

    async def _handle_signal(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        env: Any = None
        try:
            with trio.fail_after(sig.DEADLINE_S):
                env = await next_event(stream, sig.LIMITS.decoder())
                if not isinstance(env, Envelope):
                    raise RemoteProtocolError("expected an offer envelope")
                offer = sig.parse_offer(env)
            if not peer < self.me:
                await self._refuse(stream, env, "refused", "the peer with the smaller id offers")
                return
            if not self.answer_direct and self._sub is not None and \
                    self._sub.peer_paths().get(peer) == "direct":
                # An aiortc session costs ~3 MB and threads: 20 offers from directly
                # connected peers made 17. We only offer over relayed paths; an offer
                # over a direct one is refused and scored (a punch that just succeeded
                # makes an honest one now and then: 5 points, forgotten in minutes).
                await self._refuse(stream, env, "direct", "we are directly connected",
                                   quiet=True)
                self.refused += 1
                raise Misbehaviour("unwanted", "webrtc-signal: an offer over a direct "
                                   "connection (no session is needed)")
            if peer not in self.sessions and len(self.sessions) >= MAX_SESSIONS:
                await self._refuse(stream, env, "busy", f"{MAX_SESSIONS} sessions open")
                return
            old = self.sessions.pop(peer, None)
            if old is not None:  # the peer restarted, or gave up on the last one
                await old.close()
            rtc = await self._aiortc()
            assert self._sub is not None  # signals arrive once serve() has set it
            session = rtc.RtcSession(self.bridge, stream.muxed_conn.peer_id,
                                 await self._find_stun(self._sub), self._on_channel)
            try:
                answer = await session.answer(offer)
            except SessionError as e:
                await session.close()
                await self._refuse(stream, env, "bad-offer", str(e), quiet=True)
                raise RemoteProtocolError(f"webrtc-signal: {e}") from None
            self.sessions[peer] = session
            await stream.write(sig.encode_answer(env.id, answer))
            self.answers_made += 1
            assert self._nursery is not None
            self._nursery.start_soon(self._await_up, peer, session)
        except RemoteProtocolError as e:
            self.refused += 1
            self.last_error = f"{peer}: {e}"
            log.warning("webrtc: refused an offer from %s: %s", peer, e)
            raise
        finally:
            await close_quietly(stream)

    async def _refuse(self, stream: INetStream, env: Envelope, code: str, why: str,
                      quiet: bool = False) -> None:
        """Tell the offerer why not (`quiet`: the caller raises, which logs and counts)."""
        if not quiet:
            self.refused += 1
            log.info("webrtc: refused an offer from %s: %s", stream.muxed_conn.peer_id, why)
        with trio.move_on_after(2):
            await stream.write(sig.encode_error(env.id, code, why))

    async def _await_up(self, peer: str, session: RtcSession) -> None:
        try:
            await session.connected(self.connect_timeout_s)
        except SessionError as e:
            self.failed += 1
            self.last_error = f"{peer}: {e}"
            log.info("webrtc: no session with %s: %s", peer, e)
            await session.close()
            if self.sessions.get(peer) is session:
                del self.sessions[peer]
            return
        log.info("webrtc: session with %s up (%s)", peer, session.pair)
        await self._watch(peer, session)


def describe(session: RtcSession) -> dict[str, Any]:
    return {"state": session.state, "since_unix": round(session.since, 1),
            "setup_s": session.setup_s,
            "pair": session.pair, "reason": session.reason,
            "streams_opened": session.streams_opened,
            "streams_accepted": session.streams_accepted}


def _listen_ip(sub: Substrate) -> str:
    for addr in sub.listen:
        try:
            return addr.value_for_protocol("ip4")
        except Exception:
            continue
    return "0.0.0.0"


def _ip_tcp(addr: str) -> tuple[str, int] | None:
    try:
        ma = multiaddr.Multiaddr(addr)
        return ma.value_for_protocol("ip4"), int(ma.value_for_protocol("tcp"))
    except Exception:
        return None


def _reason(e: BaseException) -> str:
    if isinstance(e, trio.TooSlowError):
        return f"no answer within {sig.DEADLINE_S:g} s"
    return str(e) or type(e).__name__

