"""The trainer built in the background once torch is in and no checkpoint downloads
(node/training/build.py, `Prebuild`)."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from node.process import preload
from node.training.build import Prebuild


def test_the_build_runs_in_a_thread_of_its_own_and_its_error_reaches_the_asker():
    names: list[str] = []

    def build():
        names.append(threading.current_thread().name)
        return "trainer", "outer", 5

    assert Prebuild(build).result() == ("trainer", "outer", 5)
    assert names[0].startswith("peertrain-prebuild")

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        Prebuild(broken).result()


def test_a_node_stopped_while_torch_loads_builds_nothing(monkeypatch):
    asked = threading.Event()

    def still_loading(timeout=None):
        asked.set()
        return False

    monkeypatch.setattr(preload, "wait", still_loading)
    built: list[int] = []
    prebuild = Prebuild(lambda: built.append(1))  # type: ignore[arg-type, return-value]
    assert asked.wait(10)
    prebuild.cancel()
    with pytest.raises(CancelledError):
        prebuild.result()
    assert built == []


def test_the_build_waits_while_a_checkpoint_downloads():
    """Torch is in, but a checkpoint is downloading: the build starts once it is not (beside
    the download it slowed the download more than it saved)."""
    downloading = threading.Event()
    downloading.set()
    asked = threading.Event()

    def hold() -> bool:
        asked.set()
        return downloading.is_set()

    built: list[int] = []
    prebuild = Prebuild(lambda: (built.append(1), ("trainer", "outer", 5))[1], hold=hold)
    assert asked.wait(30)  # torch is loaded; the download holds the build back
    assert built == []
    downloading.clear()
    assert prebuild.result() == ("trainer", "outer", 5) and built == [1]


def test_a_node_stopped_while_its_checkpoint_downloads_builds_nothing():
    asked = threading.Event()

    def hold() -> bool:
        asked.set()
        return True

    built: list[int] = []
    prebuild = Prebuild(lambda: built.append(1), hold=hold)  # type: ignore[arg-type, return-value]
    assert asked.wait(30)
    prebuild.cancel()
    with pytest.raises(CancelledError):
        prebuild.result()
    assert built == []
