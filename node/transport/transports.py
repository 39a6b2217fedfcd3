"""One door to every peer: how a stream is opened, which path it takes, whether a lane fits.

A node reaches a peer over one of several transports: a libp2p connection (direct, punched,
UPnP-mapped or through a circuit relay), or a WebRTC data channel to a peer reached only
through a relay (node/webrtc/). Before this door existed, four places answered "how is this
peer reached" on their own, and the pipeline's answer ignored WebRTC. Now the services ask
`NodeContext.transports`:

    open_stream(peer, protocol)  a data channel where the peer's path is webrtc, else a
                                 libp2p stream (Substrate.open_stream)
    path_of(peer)                "webrtc", or the libp2p path kind ("direct", "punched",
                                 "upnp", "relayed via X"): what budgets and codecs follow
    rtt_s(peer)                  the measured round trip, or None
    lane_dialable()              can a peer open a TCP connection to a fresh port of ours
                                 (a bulk lane)? Not behind a NAT, not through UPnP
    serve(protocol, handler)     a handler on every transport: libp2p streams (gated) and
                                 inbound data channels

The transports behind the door are attached by the daemon as it builds them (`attach`):
the door itself knows them only by the small protocols below, so node/transport/ stays
below the capabilities (reach, webrtc) that implement them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from libp2p.peer.id import ID

    from p2p.host import Substrate

Handler = Callable[[Any], Awaitable[None]]


class Channels(Protocol):
    """A transport beside libp2p (the WebRTC service): its own streams for some peers."""

    def paths(self) -> dict[str, str]: ...
    async def open_stream(self, peer: ID, protocol: str, *, lazy: bool = False) -> Any: ...
    def set_handler(self, protocol: str, handler: Handler) -> None: ...


class PathKinds(Protocol):
    """Who labels libp2p connections (the reach service's PathService) and times them."""

    rtt_ms: dict[str, float]

    def paths(self) -> dict[str, str]: ...


class Transports:
    def __init__(self, substrate: Substrate) -> None:
        self.substrate = substrate
        self.channels: Channels | None = None
        self.kinds: PathKinds | None = None
        self._lane_dialable: Callable[[], bool] = lambda: True
        self._served: dict[str, Handler] = {}

    def attach(self, *, channels: Channels | None = None, kinds: PathKinds | None = None,
               lane_dialable: Callable[[], bool] | None = None) -> None:
        """The daemon hands over each transport once it is built (before any service runs);
        a handler served earlier is registered on channels attached later."""
        if channels is not None:
            self.channels = channels
            for protocol, handler in self._served.items():
                channels.set_handler(protocol, handler)
        if kinds is not None:
            self.kinds = kinds
        if lane_dialable is not None:
            self._lane_dialable = lane_dialable

    async def open_stream(self, peer: ID, protocol: str, *, lazy: bool = False) -> Any:
        if self.channels is not None:
            return await self.channels.open_stream(peer, protocol, lazy=lazy)
        return await self.substrate.open_stream(peer, protocol, lazy=lazy)

    def path_of(self, peer: str) -> str:
        if self.channels is not None and (kind := self.channels.paths().get(peer)):
            return kind  # a data channel's path is webrtc, not the relay's: no relay budget
        if self.kinds is not None:
            return self.kinds.paths().get(peer, "direct")
        return self.substrate.peer_paths().get(peer, "direct")

    def rtt_s(self, peer: str) -> float | None:
        ms = self.kinds.rtt_ms.get(peer) if self.kinds is not None else None
        return ms / 1000 if ms else None

    def lane_dialable(self) -> bool:
        return self._lane_dialable()

    def serve(self, protocol: str, handler: Handler) -> None:
        """`handler` for `protocol` on libp2p streams and on inbound data channels."""
        self.substrate.set_handler(protocol, handler)
        self._served[protocol] = handler
        if self.channels is not None:
            self.channels.set_handler(protocol, handler)
