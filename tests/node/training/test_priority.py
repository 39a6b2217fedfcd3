"""A training node's CPU priority (node/process/priority.py): its session yields to the machine's
other sessions only when the session is the node's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.process.priority import (
    SESSION_NICE_ENV,
    TRAINER_NICE,
    session_nice,
    session_nice_wanted,
    set_session_nice,
)

needs_autogroup = pytest.mark.skipif(
    session_nice() is None, reason="no /proc/self/autogroup (Linux autogroup scheduling)")

# Lowers its session, then prints what it returned and the session's nice after.
PROBE = ("from node.process.priority import lower_session_priority as lower, session_nice;"
         "print(lower(), lower(), session_nice())")


def probe(own_session: bool, wanted: str | None = None) -> list[str]:
    """PROBE in a fresh process; `wanted`: its PEERTRAIN_SESSION_NICE (the suite sets 0
    for every node it starts: tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k != SESSION_NICE_ENV}
    if wanted is not None:
        env[SESSION_NICE_ENV] = wanted
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60, start_new_session=own_session, env=env)
    return out.stdout.split()


@needs_autogroup
def test_a_node_in_a_session_of_its_own_lowers_it_once():
    assert probe(own_session=True) == ["True", "False", str(TRAINER_NICE)]
    assert probe(own_session=True, wanted="4") == ["True", "False", "4"]
    assert probe(own_session=True, wanted="0") == ["False", "False", "0"]


def test_the_wanted_nice_comes_from_the_environment(monkeypatch):
    for raw, wanted in [("", TRAINER_NICE), ("0", 0), ("19", 19), ("20", TRAINER_NICE),
                        ("-5", TRAINER_NICE), ("ten", TRAINER_NICE)]:
        monkeypatch.setenv(SESSION_NICE_ENV, raw)
        assert session_nice_wanted() == wanted, raw


@needs_autogroup
def test_a_node_in_someone_elses_session_leaves_it_alone():
    before = session_nice()
    assert probe(own_session=False) == ["False", "False", str(before)]
    assert session_nice() == before


def test_session_nice_reads_the_autogroup_line_or_says_none(tmp_path: Path):
    line = tmp_path / "autogroup"
    line.write_text("/autogroup-42 nice -3\n")
    assert session_nice(line) == -3
    line.write_text("garbage\n")
    assert session_nice(line) is None
    assert session_nice(tmp_path / "absent") is None


class BusyAutogroup:
    """An autogroup file that refuses `busy` writes with EAGAIN, as Linux does to an
    unprivileged writer within 0.1 s of another change, then takes the value."""

    def __init__(self, busy: int) -> None:
        self.busy, self.value = busy, None

    def write_text(self, text: str) -> None:
        if self.busy:
            self.busy -= 1
            raise BlockingIOError(11, "Resource temporarily unavailable")
        self.value = text


def test_a_busy_autogroup_is_written_again_and_a_refusal_gives_up():
    busy = BusyAutogroup(busy=2)
    assert set_session_nice(busy, TRAINER_NICE)  # type: ignore[arg-type]
    assert busy.value == str(TRAINER_NICE)
    always = BusyAutogroup(busy=100)
    assert not set_session_nice(always, TRAINER_NICE, tries=3)  # type: ignore[arg-type]
    assert always.value is None
