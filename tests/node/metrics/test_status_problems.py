"""The status page says when averaging stalled and shows the node's last problems.

Seen: "last exchange 29 min ago" in a table cell was the only sign that a node had
averaged with nobody for half an hour, and the page had no errors at all."""

from __future__ import annotations

import logging
import time

from node.metrics.service import MetricsService
from node.status.logs import FLOOD, RecentProblems
from tests.node.metrics.test_metrics import _status

NOW = time.time()  # the page document reads the clock too


def _training(last_exchange_ago: float | None, peers: int = 3, rounds: int = 40) -> dict:
    st = _status()
    st["training"] = {**st["training"], "round": rounds, "wall_s": rounds * 60.0}  # 60 s rounds
    st["membership"]["peers"] = [{"peer_id": f"12D3KooW{i}"} for i in range(peers)]
    last = None if last_exchange_ago is None else NOW - last_exchange_ago
    st["averaging"]["partners"] = {"12D3KooW0": {"exchanges": 5, "last_exchange_unix": last}}
    return st


def _warnings(st: dict) -> list[str]:
    from node.metrics.service import warnings

    return warnings(st, NOW)


def test_a_stall_of_several_rounds_is_a_warning():
    found = _warnings(_training(29 * 60))
    assert any(w.startswith("averaging stalled: the last exchange was 1740 s ago, 29 rounds")
               for w in found), found


def test_a_recent_exchange_is_no_warning():
    assert _warnings(_training(90)) == []  # 1.5 rounds: a round or two is normal


def test_no_exchange_at_all_with_live_peers_is_a_warning():
    assert any("has not started" in w for w in _warnings(_training(None)))
    assert _warnings(_training(None, peers=0)) == []  # alone: nothing to average with


def test_the_page_lists_the_last_warnings_and_errors():
    recent = RecentProblems(capacity=3)
    recent.addFilter(FLOOD)
    log = logging.getLogger("node.test_problems")
    log.addHandler(recent)
    log.propagate = False
    try:
        log.info("fine")
        for i in range(5):
            log.error("checkpoint save %d failed: disk full", i)
    finally:
        log.removeHandler(recent)
        log.propagate = True
    assert [r["msg"] for r in recent.recent()] == [
        f"checkpoint save {i} failed: disk full" for i in (2, 3, 4)]
    doc = MetricsService(_training(29 * 60).copy, None).api_status()  # what the page reads
    assert doc["warnings"] and isinstance(doc["recent_problems"], list)
