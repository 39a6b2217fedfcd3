"""The swarm page of a real testnet (`node testnet page`), rendered by a real headless
Chromium (Debian's `chromium`; the test skips, saying so, where it is absent): one loss
curve per node, every process in the node table, a killed node marked down.

Set PEERTRAIN_SCREENSHOT=docs/swarm-page.png to refresh the screenshot in the docs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from testnet import launcher, swarm
from tests.conftest import REPO, answer, nodes, wait_until

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=20) as r:
        return json.loads(r.read())


def _chromium(tmp_path: Path, *args: str) -> str:
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1440,1000",
             "--virtual-time-budget=8000", *args]
    return subprocess.run(flags, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, check=True).stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get "
                    "install chromium; .ci/run installs it)")
def test_swarm_page_shows_every_node_and_marks_the_down_ones(testnet_factory, tmp_path):
    net = testnet_factory(3)
    procs = nodes(net)
    for p in procs:
        answer(p)
    page = subprocess.Popen(
        [sys.executable, "-m", "cli", "testnet", "page", "--dir", net.dir,
         "--listen", "127.0.0.1:0"], cwd=REPO, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert page.stdout is not None
        url = page.stdout.readline().strip()  # the URL, once listening
        assert url.startswith("http://127.0.0.1:"), (url, page.stderr and page.stderr.read())
        assert swarm.served_url(Path(net.dir)) == url
        api = url + "api/swarm"
        # What the page must draw exists first: three loss points on every node.
        wait_until(lambda: all(len((n["status"] or {}).get("history") or []) >= 3
                               for n in _get(api)["nodes"] if n["name"] != "bootstrap"),
                   180, "three loss points on every node")
        dom = _chromium(tmp_path, "--dump-dom", url)
        assert 'data-loaded="1"' in dom, dom[:2000]
        for p in procs:  # one train curve per node, a line through its points
            curve = re.search(rf'<path id="train-{p.name}"[^>]* d="([^"]+)"[^>]*'
                              r'data-points="(\d+)"', dom)
            assert curve and int(curve.group(2)) >= 3, (p.name, dom[:3000])
            assert curve.group(1).count("L") >= 2
        for p in net.procs:  # every process in the node table, up
            assert re.search(rf'<tr data-node="{p.name}" data-up="1"', dom), (p.name, dom)
        # A node killed is marked down, and its curve stays (faded) on the page.
        victim = procs[-1]
        launcher.kill_node(net, victim.name)
        wait_until(lambda: not next(n for n in _get(api)["nodes"]
                                    if n["name"] == victim.name)["up"],
                   30, f"{victim.name} down on the swarm page")
        dom = _chromium(tmp_path, "--dump-dom", url)
        assert re.search(rf'<tr data-node="{victim.name}" data-up="0" class="down"', dom), dom
        assert f'id="train-{victim.name}"' in dom
        shot = Path(os.environ.get("PEERTRAIN_SCREENSHOT") or tmp_path / "swarm.png").resolve()
        _chromium(tmp_path, f"--screenshot={shot}", url)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        page.send_signal(signal.SIGINT)
        assert page.wait(30) == 130  # Ctrl-C: the documented quiet exit
    assert swarm.served_url(Path(net.dir)) is None  # page.json removed on exit
