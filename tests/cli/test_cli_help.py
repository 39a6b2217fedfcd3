"""What an operator meets first: --version, -h, help that names values as a person reads
them, shell completion, `node logs [-f]` and `node status --watch` (real processes, real
files; no node needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer.main

from cli.common import humane_help
from cli.main import app
from tests.conftest import REPO, cli

# typer's own spellings that a person should never see in our help
TYPER_SPELLINGS = ("<bool>", "<list[", "<str>", "<path>", "<float>", "<int>", "{")


def commands(cmd, path=()):
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from commands(sub, (*path, name))


def test_every_help_names_values_as_a_person_reads_them(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    root = humane_help(typer.main.get_command(app))
    seen = 0
    for path, _ in commands(root):
        root.main([*path, "-h"], prog_name="node", standalone_mode=False)
        text = capsys.readouterr().out
        assert "Usage:" in text, path
        bad = [s for s in TYPER_SPELLINGS if s in text]
        assert not bad, f"`node {' '.join(path)} -h` shows {bad}:\n{text}"
        seen += 1
    assert seen > 25  # every command and group, not just the top


def test_version_and_short_help():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("peertrain "), r
    r = cli("join", "-h")
    assert r.returncode == 0 and "Usage: node join [OPTIONS] RUN_ID" in r.stdout


def test_shell_completion_completes_commands():
    env = {**os.environ, "COMP_WORDS": "node testnet u", "COMP_CWORD": "2",
           "_NODE_COMPLETE": "complete_bash"}
    r = subprocess.run([sys.executable, "-m", "cli"], env=env, capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.stdout.split() == ["up"], r


def record(msg: str, **extra) -> str:
    return json.dumps({"ts": 1_700_000_000.0, "level": "info", "logger": "node", "msg": msg,
                       **extra})


def test_logs_render_records_extras_and_other_lines(tmp_path: Path):
    (tmp_path / "node.log").write_text("\n".join([
        record("first"), record("refused offer", peer="12D3x", reason="offer"),
        "not json at all", record("last")]) + "\n")
    r = cli("logs", "--state-dir", str(tmp_path), "-n", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and "first" not in r.stdout
    assert lines[0].endswith("info    node: refused offer  [peer=12D3x reason=offer]")
    assert lines[1] == "not json at all"
    r = cli("logs", "--state-dir", str(tmp_path), "-n", "1", "--json")
    assert json.loads(r.stdout)["msg"] == "last"


def test_logs_of_a_state_dir_without_a_log_is_one_line(tmp_path: Path):
    r = cli("logs", "--state-dir", str(tmp_path))
    assert r.returncode == 1
    assert r.stderr == f"error: no log at {tmp_path}/node.log: no node has run with that " \
                       "state directory\n"


def _read_until(proc: subprocess.Popen, needle: str, timeout: float = 30.0) -> list[str]:
    """Lines from proc's stdout up to the one holding `needle` (a deadline, not a sleep)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} in {lines}")


@pytest.mark.slow  # a follower process, polled
def test_logs_follow_prints_appended_lines_across_a_rotation(tmp_path: Path):
    log = tmp_path / "node.log"
    log.write_text(record("before") + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "cli", "logs", "-f", "--state-dir",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    try:
        _read_until(proc, "before")
        with log.open("a") as f:
            f.write(record("appended") + "\n")
        _read_until(proc, "appended")
        log.rename(tmp_path / "node.log.1")  # what RotatingFileHandler does
        log.write_text(record("after rotation") + "\n")
        _read_until(proc, "after rotation")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # a watcher process
def test_status_watch_keeps_watching_while_no_node_answers(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-m", "cli", "status", "--watch", "--json",
                             "--interval", "0.2", "--state-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        lines = _read_until(proc, "error")
        lines += _read_until(proc, "error")  # a second document: it went on watching
        assert [json.loads(x) for x in lines[-2:]] == [{"error": "no node answering"}] * 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
        proc.wait()


def test_status_watch_refuses_a_bad_interval(tmp_path: Path):
    r = cli("status", "--watch", "--interval", "0", "--state-dir", str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("error: --interval 0"), r
