"""The swarm page: one web page for a whole testnet (`node testnet page`, and `node testnet
up` in the foreground).

Why the launcher serves it and the page does not fetch each node's own /api/status: a page
reading other ports needs CORS on every node (any web site the operator visits could then
read them too), and a node in a network namespace (`--scenario partition|nat`) listens on
that namespace's loopback, out of the browser's reach. The launcher reads every node
through its control socket instead (`api_status`: the document of the node's own page,
node/metrics/service.py), which enters namespaces and needs the state directory's token.

Routes: `/` (static/swarm.html), `/swarm.js`, `/common.js` and `/common.css` (what it shares
with a node's status page: node/metrics/static/), `/api/swarm` (JSON: every process of the
testnet, up or down, with its last answer). Served by the nodes' own bounded HTTP server
(node/metrics/http.py); everything from the package, nothing from a CDN.

A node that is down (exited, killed by a churn, not answering) stays on the page, marked
down, with the last document it answered: its loss curve does not vanish with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import trio

from node.errors import NodeError
from node.files import atomic_write
from node.metrics.http import HttpServer, Response
from node.metrics.service import common_routes
from node.status.control import ControlUnavailable, query_control
from testnet import launcher

log = logging.getLogger("testnet.swarm")

PAGE_FILE = "page.json"  # in the testnet directory while a page is served: url, pid
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 9480
QUERY_TIMEOUT_S = 3.0  # one node's answer; a loaded node (torch importing) is slow
CACHE_S = 1.0  # answers are shared by the requests of one second (several tabs)
MAX_QUERIES = 8  # control queries at once (each is a thread)


class PagePortError(NodeError):
    """The page's HOST:PORT cannot be listened on: a usage error, like a taken --metrics."""

    exit_code = 2


class SwarmPage:
    """What the page shows, gathered from the testnet in `directory` at request time."""

    def __init__(self, directory: Path,
                 query: Callable[[Path, str, float], Any] = query_control) -> None:
        self.directory = Path(directory)
        self.query = query
        self.last: dict[str, dict[str, Any]] = {}  # name -> last answer and when
        self.server = HttpServer({"/": self._page, "/index.html": self._page,
                                  "/swarm.js": self._script, "/api/swarm": self._api,
                                  **common_routes()})
        self._lock = trio.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._limiter = trio.CapacityLimiter(MAX_QUERIES)

    async def collect(self) -> dict[str, Any]:
        """Every process of the testnet: name, up or down, its state, its last answer."""
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < CACHE_S:
                return self._cached[1]
            doc = await self._collect()
            self._cached = (time.monotonic(), doc)
            return doc

    async def _collect(self) -> dict[str, Any]:
        net = launcher.Testnet.load(self.directory)  # again each time: a churn changes pids
        if net is None:
            return {"run": None, "dir": str(self.directory), "now_unix": time.time(),
                    "error": f"no testnet in {self.directory}", "nodes": []}
        rows: list[dict[str, Any]] = [{} for _ in net.procs]

        async def one(i: int, p: launcher.Proc) -> None:
            rows[i] = await trio.to_thread.run_sync(self._node, p, limiter=self._limiter)

        async with trio.open_nursery() as nursery:
            for i, p in enumerate(net.procs):
                nursery.start_soon(one, i, p)
        return {"run": net.run_id, "dir": net.dir, "now_unix": round(time.time(), 3),
                "partition": (net.netns or {}).get("cut"), "nodes": rows}

    def _node(self, p: launcher.Proc) -> dict[str, Any]:
        """One process, read through its control socket (a thread: the query blocks)."""
        row: dict[str, Any] = {"name": p.name, "pid": p.pid, "up": False}
        if not launcher.alive(p.pid, p.state_dir):
            row["state"] = "exited"
        else:
            try:
                st = self.query(Path(p.state_dir), "api_status", QUERY_TIMEOUT_S)
                self.last[p.name] = {"status": st, "seen_unix": round(time.time(), 3)}
                row.update(up=True, state="running")
            except ControlUnavailable as e:
                row["state"] = "starting" if "no node" in str(e) else "not answering"
            except ValueError:  # a reply cut short (the node stopped mid-answer)
                row["state"] = "not answering"
        last = self.last.get(p.name)
        row["status"] = last["status"] if last else None
        row["seen_unix"] = last["seen_unix"] if last else None
        return row

    # -- routes ---------------------------------------------------------------------------

    def _page(self) -> Response:
        return Response(body=_static("swarm.html"), content_type="text/html; charset=utf-8")

    def _script(self) -> Response:
        return Response(body=_static("swarm.js"), content_type="text/javascript; charset=utf-8")

    async def _api(self) -> Response:
        doc = await self.collect()
        return Response(body=json.dumps(doc, default=str).encode(),
                        content_type="application/json")

    # -- serving --------------------------------------------------------------------------

    async def serve(self, host: str, port: int, *, fallback: bool = False,
                    on_url: Callable[[str], None] = lambda url: None) -> None:
        """Serve until cancelled; `on_url(url)` once listening. fallback: the port is the
        default, not asked for: when taken, take a free one (as a node's metrics port)."""
        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as e:
            if not fallback:
                raise PagePortError(f"swarm page {host}:{port}: cannot listen there: "
                                    f"{e.strerror or e}") from e
            listeners = await trio.open_tcp_listeners(0, host=host)
        bound_host, bound_port = listeners[0].socket.getsockname()[:2]
        url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}/"
        page_file = self.directory / PAGE_FILE
        atomic_write(page_file, json.dumps({"url": url, "pid": os.getpid()}).encode())
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.server.serve, listeners)
                on_url(url)
                await trio.sleep_forever()
        finally:
            page_file.unlink(missing_ok=True)


class PageThread:
    """The page served from a thread of its own (its own trio loop), for a caller that is
    not a trio program: the foreground `node testnet up`, whose main thread draws the
    table. `stop()` cancels the loop and waits for it."""

    def __init__(self, directory: Path, host: str, port: int, *, fallback: bool) -> None:
        self.page = SwarmPage(directory)
        self.url: str | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=self._main, args=(host, port, fallback),
                                        name="swarm-page", daemon=True)

    def start(self, timeout: float = 10.0) -> str:
        """Start serving; the URL, or the error that stopped it (PagePortError)."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise PagePortError("the swarm page did not start")
        if self.error is not None:
            raise self.error
        assert self.url is not None
        return self.url

    def _main(self, host: str, port: int, fallback: bool) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as self._scope:
                await self.page.serve(host, port, fallback=fallback, on_url=self._started)

        try:
            trio.run(main)
        except BaseException as e:  # handed to the caller of start()
            self.error = e
        finally:
            self._ready.set()

    def _started(self, url: str) -> None:
        self.url = url
        self._ready.set()

    def stop(self, timeout: float = 5.0) -> None:
        if self._token is not None and self._scope is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(timeout)


def served_url(directory: Path) -> str | None:
    """The URL of the page served for this testnet now, if one is (page.json, live pid)."""
    try:
        doc = json.loads((Path(directory) / PAGE_FILE).read_text())
        return str(doc["url"]) if launcher.alive(int(doc["pid"])) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _static(name: str) -> bytes:
    return resources.files("testnet").joinpath("static", name).read_bytes()
