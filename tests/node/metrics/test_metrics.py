"""The metrics port without a node: the HTTP server against bad input (real sockets on
loopback), the collector's families as Prometheus's own parser reads them, the loss
history's bound, the progress line, and `--metrics` errors from the CLI."""

from __future__ import annotations

import contextlib
import socket

import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node.metrics.collector import StatusCollector
from node.metrics.history import History
from node.metrics.http import HttpServer, Response
from node.metrics.service import parse_address, progress_line
from p2p.timing import Timings
from tests.conftest import cli

RUN_ID = "QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG"


async def _server(nursery: trio.Nursery, **kwargs) -> tuple[HttpServer, int]:
    server = HttpServer({"/ok": lambda: Response(body=b"fine\n"),
                         "/boom": lambda: 1 / 0}, **kwargs)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    return server, listeners[0].socket.getsockname()[1]


async def _exchange(port: int, data: bytes) -> bytes:
    """Send raw bytes, read until the server closes (or 2 s of silence)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError):  # it may answer before all is sent
            await stream.send_all(data)
        reply = b""
        with trio.move_on_after(2):
            while chunk := await stream.receive_some(65536):
                reply += chunk
        return reply


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"200"),
    (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
    (b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", b"405"),
    (b"GET /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", b"413"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n", b"400"),
    (b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", b"431"),
    (b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n", b"500"),
])
async def test_http_answers_bad_input_with_its_status(request_bytes: bytes, status: bytes):
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server, port = await _server(nursery)
            reply = await _exchange(port, request_bytes)
            assert reply.split(b" ", 2)[1] == status, reply[:200]
            # The server lives on after any of them.
            ok = await _exchange(port, b"GET /ok HTTP/1.1\r\nHost: x\r\n"
                                       b"Connection: close\r\n\r\n")
            assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b"fine\n")
            assert server.stats.responses[status.decode()] >= 1
            nursery.cancel_scope.cancel()


async def test_http_keeps_a_connection_alive_for_several_requests():
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            _, port = await _server(nursery)
            two = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n" * 2
            reply = await _exchange(port, two + b"GET /ok HTTP/1.1\r\nHost: x\r\n"
                                                b"Connection: close\r\n\r\n")
            assert reply.count(b"HTTP/1.1 200") == 3
            nursery.cancel_scope.cancel()


async def test_http_refuses_connections_beyond_its_limit():
    """503 when every slot is serving a request (a slow page); idle ones make room."""
    release = trio.Event()

    async def slow() -> Response:
        await release.wait()
        return Response(body=b"late\n")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = HttpServer({"/slow": slow}, max_connections=2)
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(server.serve, listeners)
            port = listeners[0].socket.getsockname()[1]
            held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
            for s in held:
                await s.send_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            while server.stats.open_connections < 2 or server._waiting:  # both being served
                await trio.sleep(0.01)
            reply = await _exchange(port, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 503")
            release.set()
            for s in held:
                assert (await s.receive_some(4096)).startswith(b"HTTP/1.1 200")
                await s.aclose()
            nursery.cancel_scope.cancel()


async def test_slowloris_connections_cannot_starve_an_honest_client():
    """100 connections sending their head a byte at a time held every slot and the page
    answered 503 to everyone. The longest-waiting head is closed to make room (from the
    same IP first: here every client is 127.0.0.1), so an honest GET is answered."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server, port = await _server(nursery)
            loris = []
            for _ in range(100):
                s = await trio.open_tcp_stream("127.0.0.1", port)
                await s.send_all(b"GET /ok HTTP/1.1\r\nX-a: ")  # and never the rest
                loris.append(s)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(3):
                reply = await _exchange(port, b"GET /ok HTTP/1.1\r\nHost: x\r\n"
                                              b"Connection: close\r\n\r\n")
                assert reply.startswith(b"HTTP/1.1 200"), reply[:60]
            assert server.stats.open_connections <= server.max_per_ip
            assert server.stats.evicted >= 90 and "503" not in server.stats.responses
            for s in loris:
                await s.aclose()
            nursery.cancel_scope.cancel()


async def test_http_drops_a_client_that_never_finishes_its_request(autojump_clock):
    async with trio.open_nursery() as nursery:
        server, port = await _server(nursery, timeout_s=5)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /ok HTTP/1.1\r\n")  # and then nothing
        with trio.fail_after(30):
            assert await stream.receive_some(100) == b""  # closed by the server
        assert server.stats.open_connections == 0
        await stream.aclose()
        nursery.cancel_scope.cancel()


def _status() -> dict:
    timings = Timings()
    for s in (0.2, 0.4, 3.0):
        timings.observe(s)
    peer = "12D3KooWPeer"
    return {
        "peer_id": "12D3KooWMe", "role": "node", "phase": "running", "run": RUN_ID,
        "run_name": "demo", "device": "cpu", "uptime_s": 12.5,
        "phase_times": {"starting": 0.0, "connecting": 0.1, "running": 2.0, "first step": 3.1},
        "p2p": {"connections": 2, "dht_routing_table": 2, "handler_errors": 1,
                "host_restarts": 0, "gossip": {"published": 5, "dropped": 0, "failed": 0},
                "inbound": {"slots": 250, "in_use": 3, "per_peer": 8, "accepted": 9,
                            "refused": {"slots_full": 2}},
                "dht_operations": {"get": {**Timings().snapshot(), "failures": 1}}},
        "membership": {"peers": [{"peer_id": peer}], "members": [{"peer_id": peer}],
                       "heartbeats_sent": 9, "rejected_heartbeats": 2,
                       "heartbeat_interval_s": 20.0, "inbound_heartbeats_per_s": 49.5,
                       "throttled_heartbeats": 7},
        "training": {"step": 40, "round": 2, "loss": 2.5, "val_loss": 2.7, "lr": 1e-3,
                     "params": 1000, "compute_s": 9.0, "compute_fraction": 0.9,
                     "rounds_averaged": 2, "rounds_local": 1},
        "averaging": {"partners": {peer: {"mb_per_s": 5.0, "exchanges": 3, "failures": 1,
                                          "bytes_sent": {"lane": 100, "stream": 20},
                                          "bytes_received": {"lane": 90}}},
                      "exchange_seconds": timings.snapshot()},
        "guard": {"refused": {"stream_budget": 4}, "misbehaviour": {"malformed": 1},
                  "bans": {}, "bans_total": 0, "inbound_streams": 1,
                  "logs": {"suppressed": {"offer": 3}}},
        "run_document": {"rejected": 1},
        "checkpoints": {"saved": 1, "failed": 0, "download": None},
    }


def test_peers_by_path_kind_and_rtt_come_from_the_path_service():
    st = {**_status(), "peer_paths": {
        "peers": {"A": {"path": "punched", "rtt_ms": 50.0},
                  "B": {"path": "relayed via R", "rtt_ms": 120.0},
                  "C": {"path": "direct", "rtt_ms": None}},
        "by_kind": {"punched": 1, "upnp": 0, "webrtc": 0, "direct": 1, "relayed": 1}}}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: st, lambda: {
        "peers_by_path": {"direct": 2, "relayed": 1}}))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples}
    assert samples[("peertrain_peers", (("path", "punched"),))] == 1
    assert samples[("peertrain_peers", (("path", "direct"),))] == 1  # not the substrate's 2
    assert samples[("peertrain_peer_rtt_seconds", (("path", "relayed"), ("peer", "B")))] == 0.12
    assert not any(k[0] == "peertrain_peer_rtt_seconds" and ("peer", "C") in k[1]
                   for k in samples)


def test_collector_families_parse_with_prometheus_parser():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(_status, lambda: {
        "peers_by_path": {"direct": 1, "relayed": 0}, "checkpoint_bytes": 4096,
        "checkpoints_held": 1, "http_requests": {"200": 3}}))
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(registry).decode())}
    types = {name: f.type for name, f in families.items()}
    assert types["peertrain_training_step"] == "gauge"
    assert types["peertrain_training_rounds"] == "counter"  # exposed as ..._total
    assert types["peertrain_exchange_seconds"] == "histogram"
    assert types["peertrain_dht_operation_seconds"] == "histogram"
    assert types["peertrain_node_info"] == "gauge"  # the text format has no info type

    def value(name: str, sample: str | None = None, **labels: str) -> float:
        for s in families[name].samples:
            if s.name == (sample or name) and all(s.labels.get(k) == v
                                                  for k, v in labels.items()):
                return s.value
        raise AssertionError(f"no sample {sample or name} {labels}")

    assert value("peertrain_training_step") == 40
    assert value("peertrain_training_rounds", "peertrain_training_rounds_total",
                 outcome="local") == 1
    assert value("peertrain_exchange_seconds", "peertrain_exchange_seconds_count") == 3
    assert value("peertrain_exchange_seconds", "peertrain_exchange_seconds_bucket",
                 le="0.5") == 2
    assert value("peertrain_exchange_sent_bytes", "peertrain_exchange_sent_bytes_total",
                 peer="12D3KooWPeer", path="lane") == 100
    assert value("peertrain_messages_rejected", "peertrain_messages_rejected_total",
                 reason="stream_budget") == 4
    assert value("peertrain_messages_rejected", "peertrain_messages_rejected_total",
                 reason="heartbeat") == 2
    assert value("peertrain_dht_operation_failures",
                 "peertrain_dht_operation_failures_total", operation="get") == 1
    assert value("peertrain_node_phase", phase="running") == 1
    assert value("peertrain_node_phase_started_seconds", phase="first step") == 3.1
    assert value("peertrain_peers", path="direct") == 1
    assert value("peertrain_checkpoint_held_bytes") == 4096
    assert value("peertrain_inbound_slots_in_use") == 3
    assert value("peertrain_heartbeat_interval_seconds") == 20.0
    assert value("peertrain_heartbeats_inbound_per_second") == 49.5
    assert value("peertrain_heartbeats_throttled", "peertrain_heartbeats_throttled_total") == 7
    assert value("peertrain_inbound_connections_refused",
                 "peertrain_inbound_connections_refused_total", reason="slots_full") == 2


PIPELINE_STALLED = {"phase": "stalled: waiting for stage 2 since 40 s", "stage": 1,
                    "stall": {"stages": [2], "since_s": 40.2, "no_host": False},
                    "training": {"phase": "stalled: waiting for stage 2 since 40 s",
                                 "step": 251, "loss": 3.31, "loss_age_s": 480.0}}


def test_a_stalled_pipeline_is_a_phase_a_gauge_and_a_warning():
    def families(pipe: dict) -> dict:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector(lambda: {**_status(), "pipeline": pipe}))
        return {(s.name, s.labels.get("phase")): s.value
                for f in text_string_to_metric_families(generate_latest(registry).decode())
                for s in f.samples if s.name.startswith("peertrain_pipeline")}

    got = families(PIPELINE_STALLED)
    assert got[("peertrain_pipeline_phase", "stalled")] == 1
    assert got[("peertrain_pipeline_phase", "training")] == 0
    assert got[("peertrain_pipeline_stalled_seconds", None)] == 40.2
    assert got[("peertrain_pipeline_loss_age_seconds", None)] == 480
    assert len({k for k in got if k[0] == "peertrain_pipeline_phase"}) == 5  # few labels
    got = families({"phase": "training", "stall": None, "training": {"loss_age_s": None}})
    assert got[("peertrain_pipeline_phase", "training")] == 1
    assert got[("peertrain_pipeline_stalled_seconds", None)] == 0
    got = families({"phase": "recovering stage 2 since 14 s", "stall": None})
    assert got[("peertrain_pipeline_phase", "recovering")] == 1

    from node.metrics.service import warnings

    assert warnings({"pipeline": PIPELINE_STALLED}, 0.0) == [
        "pipeline stalled: waiting for stage 2 since 40 s"]
    assert warnings({"pipeline": {"phase": "training", "stall": None}}, 0.0) == []


def test_collector_handles_a_bootstrap_status():
    """A bootstrap has no training, averaging or run: those families are just absent."""
    st = {"peer_id": "12D3KooWMe", "role": "bootstrap", "phase": "running",
          "phase_times": {"starting": 0.0, "running": 0.5}, "p2p": {"connections": 0}}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: st))
    names = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert "peertrain_node_phase" in names and "peertrain_training_step" not in names


def test_history_stays_bounded_and_spans_the_run():
    h = History(capacity=100, min_interval_s=1.0)
    for step in range(1, 10_001):
        h.add(float(step), step, 1.0 / step, None)
    assert len(h.points) <= 100
    assert h.points[0].step == 1 and h.points[-1].step >= 9_900
    steps = [p.step for p in h.points]
    assert steps == sorted(steps)


def test_history_keeps_every_new_validation_loss():
    h = History(min_interval_s=60.0)
    assert h.add(0.0, 1, 3.0, None)
    assert not h.add(1.0, 2, 2.9, None)  # too soon, nothing new
    assert h.add(2.0, 3, 2.8, 2.95)  # a new validation loss is never dropped
    assert not h.add(3.0, 3, 2.8, 2.95)


def test_progress_line_says_step_losses_peers_and_last_exchange():
    st = _status()
    st["averaging"]["partners"]["12D3KooWPeer"].update(last_exchange_unix=1.0,
                                                       last_seconds=0.42)
    line = progress_line(st)
    assert line.startswith("step 40 · loss 2.500 · val 2.700 · 1 peer · last exchange ")
    assert "with 12D3KooWPeer (0.42 s)" in line and "rounds 2 averaged, 1 local" in line
    assert "no exchange yet" in progress_line({"training": {"step": 0}})


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:9470", ("127.0.0.1", 9470)), (":0", ("127.0.0.1", 0)),
    ("[::1]:9000", ("::1", 9000)), ("0.0.0.0:80", ("0.0.0.0", 80))])
def test_parse_address(text: str, expected: tuple[str, int]):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["9470", "localhost", "127.0.0.1:x", "127.0.0.1:70000"])
def test_parse_address_refuses(text: str):
    with pytest.raises(ValueError):
        parse_address(text)


BOOT = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGS6T1716viYBvUvYZED6oPcgCwAv4JewvfCZjLUajEPt"


def test_metrics_port_in_use_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = cli("join", RUN_ID, "--bootstrap", BOOT,
                    "--state-dir", str(tmp_path / "s"), "--metrics", f"127.0.0.1:{port}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"error: --metrics 127.0.0.1:{port}: cannot listen there: "
                                "Address already in use")
    assert not (tmp_path / "s").exists()  # refused before anything was written


@pytest.mark.parametrize(("args", "message"), [
    (["--metrics", "nonsense"], "--metrics nonsense: expected HOST:PORT"),
    (["--metrics", ":1", "--no-metrics"], "--metrics and --no-metrics: pass one of them"),
])
def test_metrics_flag_errors(tmp_path, args: list[str], message: str):
    r = cli("bootstrap", "--state-dir", str(tmp_path / "s"), *args)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {message}"), r.stderr


def test_dashboard_and_docs_name_only_metrics_the_node_exports():
    """docs/grafana-dashboard.json and docs/operator.md's table stay in step with the
    collector: every name they use is one the node exports."""
    import json
    import re
    from pathlib import Path

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(_status, lambda: {
        "peers_by_path": {"direct": 1}, "checkpoint_bytes": 1, "checkpoints_held": 1,
        "http_requests": {"200": 1}}))
    st = _status()
    st["checkpoints"]["download"] = {"done": 1, "total": 2}
    st["checkpoint_server"] = {"served": 1, "not_held": 0}
    st["peer_paths"] = {"peers": {"A": {"path": "punched", "rtt_ms": 5.0}}}
    st["pipeline"] = PIPELINE_STALLED
    registry.register(StatusCollector(lambda: {**st, "role": "x"}))
    exported = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        exported |= {s.name for s in family.samples}
    docs = Path(__file__).resolve().parents[3] / "docs"
    exprs = [t["expr"] for p in json.loads((docs / "grafana-dashboard.json").read_text())
             ["panels"] for t in p["targets"]]
    used = set(re.findall(r"peertrain_\w+", " ".join(exprs)))
    assert used and used <= exported, sorted(used - exported)
    section = (docs / "operator.md").read_text().split("### Metrics", 1)[1].split("###", 1)[0]
    first_cells = [line.split("|")[1] for line in section.splitlines()
                   if line.startswith("| `")]
    documented = {"peertrain_" + n for cell in first_cells for n in re.findall(r"`(\w+)", cell)}
    families = {re.sub(r"_(total|bucket|count|sum|info)$", "", n) for n in exported}
    assert {re.sub(r"_(total|info)$", "", n) for n in documented} <= families | {
        re.sub(r"_total$", "", n) for n in exported}
    assert families <= {re.sub(r"_(total|info)$", "", n) for n in documented} | {
        "peertrain_node"}, sorted(families - {re.sub(r"_(total|info)$", "", n)
                                              for n in documented})


def test_both_pages_load_the_shared_helpers_first_and_never_redeclare_them(tmp_path):
    """The status page and a testnet's swarm page draw with one static/common.js (and style
    with one common.css), served by both servers and loaded before the page's own. A page
    script that declared one of its names again would stop with a SyntaxError (classic
    scripts share one global scope) and leave its page blank: no name is declared twice."""
    import re
    from importlib import resources

    from node.metrics.service import MetricsService
    from testnet.swarm import SwarmPage

    def static(package: str, name: str) -> str:
        return resources.files(package).joinpath("static", name).read_text()

    def declared(script: str) -> set[str]:
        return set(re.findall(r"^(?:const|let|var|function|async function)\s+([\w$]+)",
                              script, re.MULTILINE))

    common = static("node.metrics", "common.js")
    shared = declared(common)
    assert {"el", "fmt", "lossText", "training", "ago", "lossFrame", "poll"} <= shared
    for routes, html, own in (
            (MetricsService(dict, None).server.routes, static("node.metrics", "index.html"),
             "/status.js"),
            (SwarmPage(tmp_path).server.routes, static("testnet", "swarm.html"), "/swarm.js")):
        assert routes["/common.js"]().body == common.encode()
        assert routes["/common.css"]().body == static("node.metrics", "common.css").encode()
        assert '<link rel="stylesheet" href="/common.css">\n<style>' in html
        scripts = re.findall(r'<script src="([^"]+)"></script>', html)
        assert scripts == ["/common.js", own], scripts
        body = routes[own]().body.decode()
        assert not declared(body) & shared, (own, declared(body) & shared)
