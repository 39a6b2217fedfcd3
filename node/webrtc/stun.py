"""The run's own STUN: public peers answer Binding Requests; NATed peers find one to ask.

A publicly reachable node answers on UDP at the port number of its libp2p TCP listener
(the two never collide: TCP and UDP ports are separate), so its STUN address is known to
anyone who knows its libp2p address; nothing new is advertised. A private or unknown node
answers nothing (the run's STUN servers are its public peers). Answers are capped at
MAX_ANSWERS_PER_S (an answer is ~2x a request: a small amplifier, kept small).

A node about to set up a WebRTC session asks its directly connected peers' addresses in
turn (`find_stun`) and uses the first that answers as aiortc's STUN server.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

import trio

from protocols import stun
from protocols.errors import RemoteProtocolError

log = logging.getLogger("node.webrtc")

MAX_ANSWERS_PER_S = 200
PROBE_TIMEOUT_S = 1.0


class StunResponder:
    def __init__(self, public: Callable[[], bool]) -> None:
        self.public = public
        self.address: tuple[str, int] | None = None
        self.answered = self.ignored = self.malformed = self.over_rate = 0
        self.error: str | None = None
        self._window, self._in_window = 0, 0

    async def serve(self, ip: str, port: int, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
        try:
            await sock.bind((ip, port))
        except OSError as e:
            self.error = f"cannot bind UDP {ip}:{port}: {e.strerror or e}"
            log.warning("webrtc: no STUN responder: %s", self.error)
            sock.close()
            task_status.started()
            return
        self.address = sock.getsockname()[:2]
        task_status.started()
        with sock:
            while True:
                data, src = await sock.recvfrom(stun.MAX_MESSAGE + 1)
                reply = self.answer(data, src)
                if reply is not None:
                    with contextlib.suppress(OSError):  # an unreachable requester
                        await sock.sendto(reply, src)

    def answer(self, data: bytes, src: Any) -> bytes | None:
        """The reply to one datagram, or None (counted by why)."""
        if not self.public():
            self.ignored += 1
            return None
        try:
            req = stun.parse_request(data)
        except RemoteProtocolError:
            self.malformed += 1
            return None
        second = int(time.monotonic())
        if second != self._window:
            self._window, self._in_window = second, 0
        if self._in_window >= MAX_ANSWERS_PER_S:
            self.over_rate += 1
            return None
        self._in_window += 1
        self.answered += 1
        return stun.encode_success(req.txid, src[0], src[1])

    def statistics(self) -> dict[str, Any]:
        return {"address": f"{self.address[0]}:{self.address[1]}" if self.address else None,
                "answered": self.answered, "ignored_not_public": self.ignored,
                "malformed": self.malformed, "over_rate": self.over_rate, "error": self.error}


async def probe(server: tuple[str, int],
                timeout: float = PROBE_TIMEOUT_S) -> tuple[str, int] | None:
    """Our address as `server` sees it, or None if it does not answer in time."""
    txid = secrets.token_bytes(12)
    with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as sock:
        with trio.move_on_after(timeout):
            try:
                await sock.sendto(stun.encode_request(txid), server)
                while True:
                    data, src = await sock.recvfrom(stun.MAX_MESSAGE + 1)
                    if src[:2] != server:
                        continue
                    try:
                        return stun.parse_success(data, txid)
                    except RemoteProtocolError:
                        continue
            except OSError:
                return None
    return None


async def find_stun(candidates: Iterable[tuple[str, int]]) -> tuple[str, int] | None:
    """The first of `candidates` (in order) that answers a Binding Request."""
    for server in candidates:
        if await probe(server) is not None:
            return server
    return None
