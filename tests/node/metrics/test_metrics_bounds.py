"""Metrics that stay true and bounded over a long life: no series for a peer that left,
no throughput that was never measured, the process's own metrics and the build's version."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node.metrics.collector import StatusCollector
from node.metrics.service import MetricsService
from tests.node.metrics.test_metrics import _status

HERE, GONE, NEW = "12D3KooWPeer", "12D3KooWGone", "12D3KooWNew"


def _samples(registry: CollectorRegistry) -> list:
    return [s for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples]


def _partner(exchanges: int, mb_per_s: float) -> dict:
    return {"mb_per_s": mb_per_s, "exchanges": exchanges, "failures": 0,
            "bytes_sent": {"lane": 1}, "bytes_received": {"lane": 1},
            "last_exchange_unix": 1000.0 + exchanges if exchanges else None}


def test_per_peer_series_name_only_peers_that_are_here():
    st = _status()  # HERE is a live member; GONE left the run an hour ago
    st["averaging"]["partners"] = {HERE: _partner(3, 5.0), GONE: _partner(7, 9.0)}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: st))
    peers = {s.labels.get("peer") for s in _samples(registry) if "peer" in s.labels}
    assert peers == {HERE}


def test_throughput_is_exported_only_where_measured():
    st = _status()
    st["membership"]["peers"].append({"peer_id": NEW})
    st["averaging"]["partners"] = {HERE: _partner(3, 5.0), NEW: _partner(0, 50.0)}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: st))
    rates = {s.labels["peer"]: s.value for s in _samples(registry)
             if s.name == "peertrain_exchange_throughput_bytes_per_second"}
    assert rates == {HERE: 5e6}  # NEW's 50 MB/s is the prior, not a measurement


def test_per_peer_series_are_capped_when_nothing_says_who_is_here():
    from node.metrics.collector import MAX_PEER_LABELS

    st = {"averaging": {"partners": {f"12D3KooW{i:04}": _partner(i + 1, 1.0)
                                     for i in range(200)}}}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: st))
    peers = {s.labels["peer"] for s in _samples(registry)
             if s.name == "peertrain_exchanges_total"}
    assert len(peers) == MAX_PEER_LABELS and "12D3KooW0199" in peers  # the newest kept


def test_process_metrics_and_build_info():
    service = MetricsService(_status, None)
    names = {s.name: s for s in _samples(service.registry)}
    assert "process_resident_memory_bytes" in names and "process_open_fds" in names
    info = names["peertrain_build_info"]
    assert info.value == 1 and info.labels["version"] and info.labels["python"]
