"""A small HTTP/1.1 server for the metrics port: h11 parses, trio moves the bytes.

Why not prometheus_client's own server: it runs in threads, and the status page needs
the daemon's state, which lives on the trio thread. Why not an ASGI server (hypercorn):
three GET routes do not need one. h11 is the sans-IO HTTP parser the project's style
follows (STYLE.md); this module is its thin trio pump, like h11's own trio example.

Bounds, each a constructor argument: a request head of at most `max_head` bytes (h11
refuses more: 431), no request body (a GET has none: 413), `max_connections` served at
once and `max_per_ip` from one address, `head_timeout_s` to send a request head,
`timeout_s` per request, at most `max_requests` per connection. Bad requests get 400,
unknown paths 404, other methods 405; a handler that raises gets 500 and the server lives
on.

Held connections cannot starve others: 100 slowloris connections (a head sent a byte at a
time, or nothing) held all 32 slots and the page answered 503 to everyone. A connection
that is only waiting for its request head (new, or idle between keep-alive requests) is
the one to give up: when the server or the client's IP is full, the longest-waiting such
connection (of that IP, when the IP is the full one) is closed to make room, and a new
connection is answered 503 only when every slot is busy with a request it is serving.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

log = logging.getLogger("node.metrics")


@dataclass(frozen=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[], Awaitable[Response] | Response]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Content Too Large", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class HttpStats:
    responses: Counter[str] = field(default_factory=Counter)  # status code -> count
    open_connections: int = 0
    evicted: int = 0  # connections closed while waiting for a head, to make room


@dataclass(eq=False)
class _Conn:
    ip: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    since: float = 0.0  # when it began waiting for its next request head
    counted: bool = True  # still counted in open_connections and by IP


class HttpServer:
    """GET routes (exact paths; a query string is ignored) served on trio listeners."""

    def __init__(self, routes: dict[str, Handler], *, max_head: int = 8192,
                 max_connections: int = 32, max_per_ip: int = 8, timeout_s: float = 10.0,
                 head_timeout_s: float = 5.0, max_requests: int = 100) -> None:
        self.routes = routes
        self.max_head = max_head
        self.max_connections = max_connections
        self.max_per_ip = max_per_ip
        self.timeout_s = timeout_s
        self.head_timeout_s = head_timeout_s
        self.max_requests = max_requests
        self.stats = HttpStats()
        self._by_ip: Counter[str] = Counter()
        self._waiting: set[_Conn] = set()  # connections waiting for a request head

    async def serve(self, listeners: list[trio.SocketListener], *,
                    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.serve_listeners(self.handle, listeners, task_status=task_status)

    async def handle(self, stream: trio.abc.Stream) -> None:
        async with stream:
            conn = _Conn(_peer_ip(stream))
            if not self._make_room(conn.ip):
                await self._refuse(stream)
                return
            self.stats.open_connections += 1
            self._by_ip[conn.ip] += 1
            try:
                with conn.scope:
                    await self._serve_connection(stream, conn)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
                pass  # the client went away or was too slow: nothing to answer
            finally:
                self._waiting.discard(conn)
                self._uncount(conn)

    def _make_room(self, ip: str) -> bool:
        """Room for one more connection from `ip`: there is, or the longest-waiting idle
        connection (of `ip` if that IP is what is full) is closed for it."""
        ip_full = self._by_ip[ip] >= self.max_per_ip
        if not ip_full and self.stats.open_connections < self.max_connections:
            return True
        idle = [c for c in self._waiting if not ip_full or c.ip == ip]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.since)
        self._waiting.discard(victim)
        self._uncount(victim)  # now: its task may not run before the next arrival
        victim.scope.cancel()
        self.stats.evicted += 1
        return True

    def _uncount(self, conn: _Conn) -> None:
        if conn.counted:
            conn.counted = False
            self.stats.open_connections -= 1
            self._by_ip[conn.ip] -= 1
            if self._by_ip[conn.ip] <= 0:
                del self._by_ip[conn.ip]

    async def _refuse(self, stream: trio.abc.Stream) -> None:
        """Answer 503 without reading the request (h11 answers only what it has read)."""
        self.stats.responses["503"] += 1
        body = b"too many connections\n"
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError), \
                trio.move_on_after(1):
            await stream.send_all(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await self._linger(stream)

    async def _serve_connection(self, stream: trio.abc.Stream, me: _Conn) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head)
        for _ in range(self.max_requests):
            with trio.fail_after(self.timeout_s):
                try:
                    me.since = trio.current_time()
                    self._waiting.add(me)
                    with trio.fail_after(self.head_timeout_s):
                        request = await self._next_request(stream, conn)
                    self._waiting.discard(me)
                except h11.RemoteProtocolError as e:
                    self._waiting.discard(me)
                    code = e.error_status_hint
                    if code == 400 and "exceeds limit" in str(e):
                        code = 431
                    await self._send(stream, conn, Response(code, f"{e}\n".encode()),
                                     close=True)
                    await self._linger(stream)
                    return
                if request is None:
                    return  # the client closed between requests
                response = await self._respond(request)
                await self._send(stream, conn, response, head_only=request.method == b"HEAD",
                                 close=response.status >= 400)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _linger(self, stream: trio.abc.Stream) -> None:
        """Closing with unread bytes in the socket makes the kernel send a reset, which can
        destroy the error response before the client reads it: say we are done, then read
        and drop what the client still sends, bounded in bytes and time."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError,
                                 AttributeError), trio.move_on_after(1):
            await stream.send_eof()  # type: ignore[attr-defined]
            drained = 0
            while drained < 16 * self.max_head:
                chunk = await stream.receive_some(self.max_head)
                if not chunk:
                    break
                drained += len(chunk)

    async def _next_request(self, stream: trio.abc.Stream,
                            conn: h11.Connection) -> h11.Request | None:
        request = None
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(self.max_head)
                conn.receive_data(bytes(data))
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.Request):
                request = event
                continue
            if isinstance(event, h11.Data):
                # A body on a GET: refuse rather than buffer it (we never read bodies).
                raise h11.RemoteProtocolError("a request body is not accepted here",
                                              error_status_hint=413)
            if isinstance(event, h11.EndOfMessage):
                return request
            return None

    async def _respond(self, request: h11.Request) -> Response:
        target = request.target.decode("ascii", "replace")
        path = target.split("?", 1)[0]
        if request.method not in (b"GET", b"HEAD"):
            return Response(405, b"only GET and HEAD\n", headers=(("Allow", "GET, HEAD"),))
        handler = self.routes.get(path)
        if handler is None:
            return Response(404, f"no such page: {path}\n".encode())
        try:
            result = handler()
            if not isinstance(result, Response):
                result = await result
            return result
        except Exception as e:  # a bug in one page must not take the port down
            log.warning("metrics port: %s failed: %r", path, e)
            return Response(500, b"internal error\n")

    async def _send(self, stream: trio.abc.Stream, conn: h11.Connection, response: Response,
                    *, head_only: bool = False, close: bool = False) -> None:
        self.stats.responses[str(response.status)] += 1
        headers = [("Content-Type", response.content_type),
                   ("Content-Length", str(len(response.body))),
                   ("Cache-Control", "no-store"),
                   ("X-Content-Type-Options", "nosniff"), *response.headers]
        if close:
            headers.append(("Connection", "close"))
        data = conn.send(h11.Response(status_code=response.status, headers=headers,
                                      reason=_REASONS.get(response.status, "").encode()))
        if not head_only:
            data += conn.send(h11.Data(data=response.body))
        data += conn.send(h11.EndOfMessage())
        await stream.send_all(data)


def _peer_ip(stream: trio.abc.Stream) -> str:
    try:
        return str(stream.socket.getpeername()[0])  # type: ignore[attr-defined]
    except Exception:
        return "?"
