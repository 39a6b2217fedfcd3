"""The foreground testnet leaves no orphans: not after Ctrl-C, not after a launcher crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testnet import launcher
from tests.conftest import REPO, wait_until

pytestmark = pytest.mark.slow  # starts a testnet


def start_foreground(directory: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "testnet", "up", "-n", "2", "--no-train", "--dir",
         str(directory)], cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "COLUMNS": "200"})


def running(directory: Path) -> launcher.Testnet | None:
    net = launcher.Testnet.load(directory)
    if net and len(net.procs) == 3 and all(launcher._phase(p) == "running" for p in net.procs):
        return net
    return None


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "crash"])
def test_no_orphans_when_the_launcher_stops(tmp_path: Path, how: signal.Signals):
    directory = tmp_path / "tn"
    proc = start_foreground(directory)
    try:
        net = wait_until(lambda: running(directory), 180, "the testnet to come up")
        pids = [(p.pid, p.state_dir) for p in net.procs]
        os.kill(proc.pid, how)
        proc.wait(timeout=60)
        wait_until(lambda: not any(launcher.alive(pid, d) for pid, d in pids), 60,
                   "every node to exit with the launcher")
    finally:
        if proc.poll() is None:
            proc.kill()
        launcher.down(directory)
