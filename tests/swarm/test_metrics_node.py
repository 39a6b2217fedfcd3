"""The metrics port of real node processes: /metrics scraped and parsed with
prometheus_client's parser while the node trains, and the status page rendered by a real
headless Chromium (Debian's `chromium`; the test skips, saying so, where it is absent).

Set PEERTRAIN_SCREENSHOT=docs/status-page.png to refresh the screenshot in the docs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import answer, nodes, shared_testnet, wait_until

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FAMILIES = {
    "peertrain_node_info", "peertrain_node_phase", "peertrain_node_phase_started_seconds",
    "peertrain_training_step", "peertrain_training_loss", "peertrain_training_rounds",
    "peertrain_exchange_seconds", "peertrain_exchange_sent_bytes", "peertrain_exchanges",
    "peertrain_dht_operation_seconds", "peertrain_peers", "peertrain_messages_rejected",
    "peertrain_run_peers_live", "peertrain_connected_peers",
}


def _url(state_dir: str) -> str:
    path = Path(state_dir) / "metrics.json"
    wait_until(path.exists, 60, f"{path} to be written")
    return json.loads(path.read_text())["url"]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _scrape(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(_get(url + "metrics"))}


def _value(families: dict, name: str, sample: str | None = None) -> float:
    return next(s.value for s in families[name].samples if s.name == (sample or name))


#: One 2-node testnet for both tests: the page test reads what the scrape test waited for.
net = shared_testnet(2)


def test_metrics_of_a_training_node_parse_and_step_advances(net):
    node1, node2 = nodes(net)
    url = _url(node1.state_dir)
    # The first exchange fills the averaging families (a histogram needs one to exist).
    wait_until(lambda: (answer(node1).get("training") or {}).get("rounds_averaged", 0) >= 1,
               120, "node1 to average a round")
    first = _scrape(url)
    assert set(first) >= FAMILIES, sorted(FAMILIES - set(first))
    assert first["peertrain_exchange_seconds"].type == "histogram"
    assert first["peertrain_training_rounds"].type == "counter"
    step = _value(first, "peertrain_training_step")
    later = wait_until(lambda: (f := _scrape(url))
                       and _value(f, "peertrain_training_step") > step and f,
                       60, "the scraped step to advance")
    assert _value(later, "peertrain_exchange_seconds", "peertrain_exchange_seconds_count") >= 1
    peers = {s.labels["peer"] for s in later["peertrain_exchanges"].samples}
    assert answer(node2)["peer_id"] in peers
    # The bootstrap serves its own port (a node without a run: no training families).
    boot = _scrape(_url(net.procs[0].state_dir))
    assert "peertrain_node_phase" in boot and "peertrain_training_step" not in boot


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get "
                    "install chromium; .ci/run installs it)")
def test_status_page_in_headless_chromium(net, tmp_path):
    node1, node2 = nodes(net)
    url = _url(node1.state_dir)
    other = answer(node2)["peer_id"]
    # What the page must show exists first: a few loss points and node2 heard live.
    wait_until(lambda: len((st := json.loads(_get(url + "api/status")))["history"]) >= 3
               and any(p["peer_id"] == other for p in st["membership"]["peers"]),
               120, "three loss points and node2 live on node1")
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1280,1100",
             "--virtual-time-budget=5000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL).stdout
    assert 'data-loaded="1"' in dom, dom[:2000]
    curve = re.search(r'<path id="train-curve" d="([^"]+)"[^>]*data-points="(\d+)"', dom)
    assert curve and int(curve.group(2)) >= 3, dom[:3000]
    assert curve.group(1).count("L") >= 2  # a line through the points, not one dot
    assert f'data-peer="{other}"' in dom  # the peer table lists node2
    shot = Path(os.environ.get("PEERTRAIN_SCREENSHOT") or tmp_path / "status.png").resolve()
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True,
                   timeout=120, stdin=subprocess.DEVNULL, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
