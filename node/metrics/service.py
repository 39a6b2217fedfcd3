"""MetricsService: what a person or Prometheus sees of a node.

* `/metrics`: Prometheus text exposition of the node's status (collector.py);
* `/`: the status page (static/index.html + static/status.js, with static/common.js and
  common.css, what a testnet's swarm page shares and serves too; shipped in the package:
  no CDN, the machine may be offline), drawn from `/api/status`: the status plus the loss
  history and the checkpoints held;
* a progress line on the terminal every `progress_s` (step, losses, peers, the last
  exchange), and a `progress` JSON record in node.log at every history point (loss curves
  can be drawn from the log alone: docs/operator.md).

It reads the other services only through the daemon's `status()` (passed in, like the
control service's handlers) and the shared NodeContext: no service imports
prometheus_client, and the metrics never disagree with `node status`.

The HTTP port is optional (`--no-metrics`); the history and the progress lines are not.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from node.errors import MetricsPortError
from node.files import atomic_write
from node.metrics.collector import StatusCollector
from node.metrics.history import History
from node.metrics.http import Handler, HttpServer, Response
from node.status.logs import RECENT

if TYPE_CHECKING:
    from node.service import NodeContext

log = logging.getLogger("node.metrics")
progress_log = logging.getLogger("node.progress")

METRICS_FILE = "metrics.json"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 9470
SAMPLE_S = 1.0  # how often progress is read (a point is kept per History's rules)
CHECKPOINT_SCAN_S = 30.0


class MetricsService:
    name = "metrics"
    protocols = ()  # an HTTP port, not a libp2p protocol

    def __init__(self, status: Callable[[], dict[str, Any]], address: tuple[str, int] | None,
                 *, fallback: bool = False, progress_s: float = 30.0,
                 history: History | None = None) -> None:
        """address: where to serve HTTP (None: nowhere). fallback: the address is the
        default, not asked for: if its port is taken (a second node on this machine), take
        any free port and say so instead of failing."""
        self.status = status
        self.address = address
        self.fallback = fallback
        self.progress_s = progress_s
        self.history = history or History()
        self.url: str | None = None
        self.checkpoints: list[dict[str, Any]] = []
        self.server = HttpServer({"/": self._page, "/index.html": self._page,
                                  "/status.js": self._script, "/metrics": self._metrics,
                                  "/api/status": self._api_status, **common_routes()})
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(self.status, self._extra))
        # process_* (CPU seconds, RSS, open fds, start time): Prometheus's standard names
        ProcessCollector(registry=self.registry)
        self._ctx: NodeContext | None = None

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._ctx = ctx
        async with trio.open_nursery() as nursery:
            if self.address is not None:
                listeners = await self._listen(*self.address)
                host, port = listeners[0].socket.getsockname()[:2]
                self.url = f"http://{_url_host(host)}:{port}/"
                atomic_write(ctx.config.state_dir / METRICS_FILE, json.dumps(
                    {"url": self.url, "host": host, "port": port, "pid": os.getpid()}).encode(),
                    durable=False)
                await nursery.start(self.server.serve, listeners)
                log.info("status page %s, Prometheus metrics %smetrics", self.url, self.url)
            nursery.start_soon(self._sample, ctx)
            nursery.start_soon(self._scan_checkpoints, ctx)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                if self.url is not None:
                    (ctx.config.state_dir / METRICS_FILE).unlink(missing_ok=True)

    def statistics(self) -> dict[str, Any]:
        return {"url": self.url, "history_points": len(self.history.points),
                "http": {"responses": dict(self.server.stats.responses),
                         "open_connections": self.server.stats.open_connections}}

    async def _listen(self, host: str, port: int) -> list[trio.SocketListener]:
        try:
            return await trio.open_tcp_listeners(port, host=host)
        except OSError as e:
            if self.fallback:
                log.warning("metrics port %s:%d: %s; serving on a free port instead (pass "
                            "--metrics HOST:PORT to choose one)", host, port, e.strerror or e)
                return await trio.open_tcp_listeners(0, host=host)
            raise MetricsPortError(f"--metrics {host}:{port}: cannot listen there: "
                                   f"{e.strerror or e}") from e

    # -- the pages ------------------------------------------------------------------------

    def _page(self) -> Response:
        return Response(body=_static("index.html"), content_type="text/html; charset=utf-8")

    def _script(self) -> Response:
        return Response(body=_static("status.js"),
                        content_type="text/javascript; charset=utf-8")

    def _metrics(self) -> Response:
        return Response(body=generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)

    def api_status(self) -> dict[str, Any]:
        """The page's document: the status plus the loss history and the checkpoints held.
        Also the control socket's `api_status` command: a testnet's swarm page reads every
        node through it, which works where the HTTP port cannot be reached (a node in a
        network namespace, or one run with --no-metrics)."""
        st = self.status()
        now = time.time()
        return {**st, **self._extra(), "history": self.history.to_json(),
                "checkpoints": self.checkpoints, "now_unix": round(now, 3),
                "warnings": warnings(st, now), "recent_problems": RECENT.recent()}

    def _api_status(self) -> Response:
        return Response(body=json.dumps(self.api_status(), default=str).encode(),
                        content_type="application/json")

    def _extra(self) -> dict[str, Any]:
        """What this service measures itself, for /metrics and /api/status."""
        extra: dict[str, Any] = {"http_requests": dict(self.server.stats.responses)}
        if self._ctx is not None:
            paths = self._ctx.substrate.connection_paths()
            extra["paths"] = paths
            extra["peers_by_path"] = {p: list(paths.values()).count(p)
                                      for p in ("direct", "relayed")}
        if self._ctx is not None and self._ctx.run is not None:
            extra["checkpoint_bytes"] = sum(c["bytes"] for c in self.checkpoints)
            extra["checkpoints_held"] = len(self.checkpoints)
        return extra

    # -- progress: history, node.log, the terminal ------------------------------------------

    async def _sample(self, ctx: NodeContext) -> None:
        last_line = trio.current_time()
        while True:
            await trio.sleep(SAMPLE_S)
            run = ctx.run
            if run is None or run.progress.compute_s == 0:
                continue  # nothing trained yet (or a bootstrap / --no-train node)
            p = run.progress
            if self.history.add(time.time(), p.step, p.loss, p.val_loss):
                progress_log.info("progress", extra={
                    "event": "progress", "step": p.step, "loss": p.loss,
                    "val_loss": p.val_loss, "round": p.round, "console": False})
            if trio.current_time() - last_line >= self.progress_s:
                last_line = trio.current_time()
                progress_log.info("%s", progress_line(self.status()))

    async def _scan_checkpoints(self, ctx: NodeContext) -> None:
        while True:
            if ctx.run is not None:
                self.checkpoints = await trio.to_thread.run_sync(
                    _held_checkpoints, ctx, ctx.run.run_id)
            await trio.sleep(CHECKPOINT_SCAN_S if ctx.run is not None else SAMPLE_S)


def progress_line(st: dict[str, Any]) -> str:
    """`step 1200 · loss 2.310 · val 2.402 · 3 peers · last exchange 4 s ago with
    12D3…xYz (0.42 s) · rounds 20 averaged, 3 local`: what a person watching
    `node join` wants every half minute."""
    t = st.get("training") or {}
    parts = [f"step {t.get('step', 0)}"]
    if t.get("loss") is not None:
        parts.append(f"loss {t['loss']:.3f}")
    if t.get("val_loss") is not None:
        parts.append(f"val {t['val_loss']:.3f}")
    peers = len((st.get("membership") or {}).get("peers", []))
    parts.append(f"{peers} peer{'s' if peers != 1 else ''}")
    partners = (st.get("averaging") or {}).get("partners") or {}
    done = [(p["last_exchange_unix"], peer, p.get("last_seconds"))
            for peer, p in partners.items() if p.get("last_exchange_unix")]
    if done:
        when, peer, seconds = max(done)
        ago = max(0, round(time.time() - when))
        parts.append(f"last exchange {ago} s ago with {short_id(peer)}"
                     + (f" ({seconds:.2f} s)" if seconds is not None else ""))
    else:
        parts.append("no exchange yet")
    parts.append(f"rounds {t.get('rounds_averaged', 0)} averaged, "
                 f"{t.get('rounds_local', 0)} local")
    return " · ".join(parts)


STALL_ROUNDS = 3  # rounds without an exchange before the page says averaging stalled


def warnings(st: dict[str, Any], now: float) -> list[str]:
    """What a person at the status page must not miss, one sentence each: averaging that
    stalled (the last exchange older than STALL_ROUNDS rounds, a round's length measured
    as the node's wall time over its rounds), training that stopped with an error. Before,
    a stall was "last exchange 29 min ago" in a table cell."""
    out = []
    t = st.get("training") or {}
    if t.get("error"):
        out.append(f"training stopped: {t['error']}")
    pipe = st.get("pipeline") or {}
    if pipe.get("stall"):  # node/pipe/stall.py: the phase names the stage and how long
        out.append(f"pipeline {pipe['phase']}")
    rounds = t.get("round") or 0
    if rounds < 1 or not t.get("wall_s"):
        return out
    round_s = t["wall_s"] / rounds
    partners = (st.get("averaging") or {}).get("partners") or {}
    last = max((p["last_exchange_unix"] for p in partners.values()
                if p.get("last_exchange_unix")), default=None)
    peers = len((st.get("membership") or {}).get("peers", []))
    if last is None:
        if peers and rounds >= STALL_ROUNDS:
            out.append(f"averaging has not started: no exchange in {rounds} rounds though "
                       f"{peers} peer{'s are' if peers != 1 else ' is'} live")
    elif (now - last) / round_s >= STALL_ROUNDS:
        out.append(f"averaging stalled: the last exchange was {round(now - last)} s ago, "
                   f"{(now - last) / round_s:.0f} rounds of {round_s:.0f} s; every round since "
                   f"was local ({peers} peer{'s' if peers != 1 else ''} live)")
    return out


def short_id(peer: str) -> str:
    return peer if len(peer) <= 12 else f"{peer[:6]}…{peer[-4:]}"


def _held_checkpoints(ctx: NodeContext, run_id: str) -> list[dict[str, Any]]:
    """This run's checkpoints on disk (a thread: it reads their manifests)."""
    return [{"cid": cid, "step": m.step, "bytes": m.size, "created_ms": m.created_ms}
            for cid, m in ctx.checkpoints.list(run_id)]


def common_routes() -> dict[str, Handler]:
    """`/common.js` and `/common.css` (static/): what the status page and a testnet's swarm
    page share, served by both servers (testnet/swarm.py) at these paths, so the two pages
    draw alike from one copy."""
    return {
        "/common.js": lambda: Response(body=_static("common.js"),
                                       content_type="text/javascript; charset=utf-8"),
        "/common.css": lambda: Response(body=_static("common.css"),
                                        content_type="text/css; charset=utf-8"),
    }


def _static(name: str) -> bytes:
    return resources.files("node.metrics").joinpath("static", name).read_bytes()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `:PORT` (localhost) or `[V6]:PORT`; ValueError with the reason."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:9470 (port 0: any free port)")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port {port} is out of range (0-65535)")
    host = host.strip("[]") or DEFAULT_HOST
    return host, int(port)
