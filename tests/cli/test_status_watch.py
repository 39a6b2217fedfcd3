"""`node status --watch` into a pipe prints frame after frame (rich's Live printed nothing
until it ended, so `node status --watch | tee` showed nothing at all)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.conftest import REPO, wait_until


def test_watch_into_a_pipe_prints_frames(tmp_path: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "status", "--watch", "--interval", "0.2",
         "--state-dir", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
        env={**os.environ, "COLUMNS": "120"})
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: sum(line.startswith("--- ") for line in lines) >= 3, 60,
                   "three frames on the pipe")
        assert sum("no node is running" in line for line in lines) >= 3  # each frame's view
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
