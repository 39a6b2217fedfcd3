"""One RTCPeerConnection to one peer: offer/answer, ICE, DTLS, SCTP, its data channels.

Every aiortc call runs on the asyncio thread (node/webrtc/bridge.py); the trio side only
awaits `bridge.run(...)` and gets events back through the trio token. The offerer opens a
control channel before its offer (a description has no data section without one); the
session is up when that channel is open at both ends. Each stream is then a new data
channel labelled with its protocol id; the other end hands it to that protocol's handler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import aioice.ice
import trio
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)
from libp2p.peer.id import ID

from node.webrtc import SessionError
from node.webrtc.bridge import AsyncioThread, _soon
from node.webrtc.channel import DataChannelStream

log = logging.getLogger("node.webrtc")

CONTROL = "peertrain/control"
_host_addresses: list[str] | None = None
_plain_get_host_addresses = aioice.ice.get_host_addresses


def gather_only(addresses: list[str] | None) -> None:
    """ICE host candidates from these addresses only (None: every interface, aioice's
    default). aioice skips 127.0.0.1 on its own, and a node bound to one address should
    not offer the others; aioice reads the module function on each gathering."""
    global _host_addresses
    _host_addresses = list(addresses) if addresses else None


def _get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    if _host_addresses is not None:
        return [a for a in _host_addresses if (":" in a and use_ipv6) or
                (":" not in a and use_ipv4)]
    return _plain_get_host_addresses(use_ipv4, use_ipv6)


aioice.ice.get_host_addresses = _get_host_addresses


class RtcSession:
    def __init__(self, bridge: AsyncioThread, peer: ID, stun: tuple[str, int] | None,
                 on_channel: Callable[[DataChannelStream], None]) -> None:
        self.bridge = bridge
        self.peer = peer
        self.stun = stun
        self.on_channel = on_channel  # called on the trio side with each inbound stream
        self.up = trio.Event()
        self.down = trio.Event()
        self.state = "new"
        self.reason: str | None = None
        self.since = time.time()
        self.setup_s: float | None = None  # creation (before the offer) to the channel open
        self._created = time.monotonic()
        self.pair: str | None = None  # "srflx 198.18.3.2:4001 <-> host 198.19.2.2:5000"
        self.streams_opened = self.streams_accepted = 0
        self._token = trio.lowlevel.current_trio_token()
        self._pc: RTCPeerConnection | None = None  # asyncio thread only

    # -- trio side --------------------------------------------------------------------

    async def offer(self) -> str:
        return await self.bridge.run(self._offer)

    async def answer(self, offer_sdp: str) -> str:
        try:
            return await self.bridge.run(self._answer, offer_sdp)
        except Exception as e:
            raise SessionError(f"cannot answer the offer: {e}") from e

    async def accept(self, answer_sdp: str) -> None:
        try:
            await self.bridge.run(self._accept, answer_sdp)
        except Exception as e:
            raise SessionError(f"cannot use the answer: {e}") from e

    async def connected(self, timeout: float) -> None:
        """Wait until the control channel is open; SessionError if ICE fails or time runs
        out (aiortc's own ICE timeout is longer than a round deadline)."""
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                async def watch_down() -> None:
                    await self.down.wait()
                    nursery.cancel_scope.cancel()
                nursery.start_soon(watch_down)
                await self.up.wait()
                nursery.cancel_scope.cancel()
        if not self.up.is_set() or self.down.is_set():
            reason = self.reason or f"no ICE pair within {timeout:g} s"
            raise SessionError(reason)
        self.pair = await self.bridge.run(self._pair)

    async def open_stream(self, protocol: str, timeout: float = 10.0) -> DataChannelStream:
        if self.down.is_set() or not self.up.is_set():
            raise SessionError(self.reason or "the session is not up")
        with trio.fail_after(timeout):
            stream = await self.bridge.run(self._open_channel, protocol)
        self.streams_opened += 1
        return stream

    async def close(self) -> None:
        self._set_down("closed")
        with trio.move_on_after(5):
            await self.bridge.run(self._close)

    # -- trio side: events from asyncio ------------------------------------------------

    def _set_up(self) -> None:
        if not self.down.is_set():
            self.state = "connected"
            self.since = time.time()
            self.setup_s = round(time.monotonic() - self._created, 3)
            self.up.set()

    def _set_down(self, reason: str) -> None:
        if not self.down.is_set():
            self.state = "closed"
            self.reason = self.reason or reason
            self.down.set()

    def _inbound(self, stream: DataChannelStream) -> None:
        self.streams_accepted += 1
        self.on_channel(stream)

    # -- asyncio side -----------------------------------------------------------------

    def _make_pc(self) -> RTCPeerConnection:
        servers = [RTCIceServer(f"stun:{self.stun[0]}:{self.stun[1]}")] if self.stun else []
        pc = RTCPeerConnection(RTCConfiguration(iceServers=servers))  # never Google's STUN
        self._pc = pc

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState in ("failed", "closed"):
                _soon(self._token, self._set_down, f"connection {pc.connectionState}")

        @pc.on("datachannel")
        def _channel(ch: RTCDataChannel) -> None:
            if ch.label == CONTROL:
                _soon(self._token, self._set_up)
                return
            stream = DataChannelStream(self.bridge, ch, self.peer, self._token)
            _soon(self._token, self._inbound, stream)

        return pc

    async def _offer(self) -> str:
        pc = self._make_pc()
        control = pc.createDataChannel(CONTROL)
        control.on("open", lambda: _soon(self._token, self._set_up))
        await pc.setLocalDescription(await pc.createOffer())  # gathers every candidate
        return pc.localDescription.sdp

    async def _answer(self, offer_sdp: str) -> str:
        pc = self._make_pc()
        await pc.setRemoteDescription(RTCSessionDescription(offer_sdp, "offer"))
        await pc.setLocalDescription(await pc.createAnswer())
        return pc.localDescription.sdp

    async def _accept(self, answer_sdp: str) -> None:
        assert self._pc is not None
        await self._pc.setRemoteDescription(RTCSessionDescription(answer_sdp, "answer"))

    async def _open_channel(self, protocol: str) -> DataChannelStream:
        assert self._pc is not None
        ch = self._pc.createDataChannel(protocol, ordered=True)
        stream = DataChannelStream(self.bridge, ch, self.peer, self._token)
        if ch.readyState != "open":
            import asyncio

            opened = asyncio.Event()
            ch.on("open", opened.set)
            ch.on("close", opened.set)
            await opened.wait()
            if ch.readyState != "open":
                raise SessionError(f"the data channel for {protocol} closed before opening")
        return stream

    async def _pair(self) -> str | None:
        try:
            assert self._pc is not None
            sctp = self._pc.sctp
            ice = sctp.transport.transport if sctp else None  # DTLS -> ICE transport
            pair = ice._connection._nominated.get(1) if ice else None
            if pair is None:
                return None
            lc, rc = pair.local_candidate, pair.remote_candidate
            return f"{lc.type} {lc.host}:{lc.port} <-> {rc.type} {rc.host}:{rc.port}"
        except Exception:  # private aioice fields: only for status
            return None

    async def _close(self) -> None:
        if self._pc is not None:
            await self._pc.close()
