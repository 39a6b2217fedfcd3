"""Watching a testnet from outside, as its tests and benchmarks do: ask a node over its
control socket, poll until a condition holds, compare run-document replicas."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.status.control import query_control


def ask(where: Any, cmd: str = "status", timeout: float = 3.0) -> Any:
    """A node's answer to `cmd` ({} while it cannot answer: starting, busy, exiting).
    `where` is a launcher.Proc or its state directory."""
    state_dir = getattr(where, "state_dir", where)
    try:
        return query_control(Path(state_dir), cmd, timeout=timeout) or {}
    except Exception:
        return {}


def until(predicate: Callable[[], Any], timeout: float, what: str,
          interval: float = 0.1) -> Any:
    """Poll until `predicate()` returns something true and return it; TimeoutError
    naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def holds(replica: dict[str, list], snapshot: dict[str, list]) -> bool:
    """True if `replica` (the control command `rundoc`: key -> stamp) has every entry of
    `snapshot`, at that version or a newer one."""
    return all(k in replica and replica[k] >= v for k, v in snapshot.items())


def union(replicas: list[dict[str, list]]) -> dict[str, list]:
    """The newest stamp of every key any replica holds."""
    out: dict[str, list] = {}
    for r in replicas:
        for k, v in r.items():
            out[k] = max(out.get(k, v), v)
    return out
