"""The one door to every peer (node/transport/transports.py): which transport answers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import trio

from node.transport.transports import Transports


class Channels:
    """A transport beside libp2p with a data channel to `webrtc_peers` (the WebRTC shape)."""

    def __init__(self, webrtc_peers: set[str]) -> None:
        self.peers = webrtc_peers
        self.handlers: dict[str, Any] = {}
        self.opened: list[tuple[Any, str]] = []

    def paths(self) -> dict[str, str]:
        return {p: "webrtc" for p in self.peers}

    async def open_stream(self, peer: Any, protocol: str, *, lazy: bool = False) -> Any:
        self.opened.append((peer, protocol))
        return "channel"

    def set_handler(self, protocol: str, handler: Any) -> None:
        self.handlers[protocol] = handler


def substrate() -> Any:
    handlers: dict[str, Any] = {}

    async def open_stream(peer: Any, protocol: str, *, lazy: bool = False) -> str:
        return "libp2p"

    return SimpleNamespace(handlers=handlers, set_handler=handlers.__setitem__,
                           open_stream=open_stream,
                           peer_paths=lambda: {"r": "relayed via R"})


def test_path_of_asks_the_channels_then_the_labeller_then_the_substrate():
    door = Transports(substrate())
    assert door.path_of("r") == "relayed via R" and door.path_of("x") == "direct"
    door.attach(kinds=SimpleNamespace(paths=lambda: {"r": "relayed via R", "p": "punched"},
                                      rtt_ms={"p": 40.0}))
    assert door.path_of("p") == "punched" and door.rtt_s("p") == 0.04
    assert door.rtt_s("r") is None
    door.attach(channels=Channels({"r"}))
    assert door.path_of("r") == "webrtc" and door.path_of("p") == "punched"


def test_a_handler_is_served_on_every_transport_whenever_it_is_attached():
    sub = substrate()
    door = Transports(sub)

    async def handler(stream: Any) -> None: ...

    door.serve("/a/1", handler)  # before the channels exist (services start first)
    rtc = Channels(set())
    door.attach(channels=rtc)
    door.serve("/b/1", handler)
    assert set(sub.handlers) == set(rtc.handlers) == {"/a/1", "/b/1"}


def test_streams_and_lanes_come_from_what_was_attached():
    door = Transports(substrate())
    assert trio.run(door.open_stream, "peer", "/a/1") == "libp2p"
    assert door.lane_dialable()
    rtc = Channels({"peer"})
    door.attach(channels=rtc, lane_dialable=lambda: False)
    assert trio.run(door.open_stream, "peer", "/a/1") == "channel"
    assert rtc.opened == [("peer", "/a/1")] and not door.lane_dialable()
