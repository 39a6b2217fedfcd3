"""Churn: SIGKILL random nodes of a running testnet and restart them, on a seeded schedule.

    node testnet up --scenario churn --nodes N --kill-rate R [--duration S] [--seed K]
                    [--poisson]

The schedule is a pure function of (nodes, rate, duration, seed, poisson): `kill_schedule`.
Kills are due every 60/R seconds (fixed interval, the default) or at the arrivals of a
Poisson process of R kills per minute (`--poisson`: exponential gaps), from seeded RNGs, for
`duration` seconds from the start of the churn; each victim is drawn at random from the
nodes, never one of the last `max_down` victims (so the schedule does not ask to kill a node
that is likely still coming back). The bootstrap is never killed: it is every node's way in
(its address is the only one a restarted node is given).

A driver process (testnet/churn_driver.py, started by `launcher.start_churn`) runs the
schedule: at each kill it SIGKILLs the victim's process group, waits `downtime_s` and starts
the node again with the same arguments and state directory (so the same identity key, the
same peer id, its own checkpoints and run-document replica). A node counts as down from its
kill until it reports phase `running` again. At most `max_down(N)` = max(1, N // 4) nodes
are down at once: a kill that falls due while that many are down waits until one is back,
and a kill that cannot happen before the churn's duration ends is skipped (counted). When
the duration is over the driver waits for every restarted node to be running again (at most
RESTART_TIMEOUT_S each, else the node is reported `stuck`), writes `done` and exits; the
testnet keeps running, so that convergence after churn can be watched and measured.

Everything the driver did is in `DIR/churn.json` (rewritten atomically at each change):
the schedule, and one event per kill (due and actual second, the victim's step, newest
checkpoint step and peer id just before the kill, restart and back seconds, the new pid).
`node testnet status` and the live table show its counts. `node testnet down` (and Ctrl-C of
a foreground testnet) stops the driver first (SIGTERM, which it obeys between two actions),
then the nodes, so nothing restarts a node behind `down`'s back.
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "churn.json"
MAX_DOWN_FRACTION = 4  # at most N // 4 nodes down at once (at least 1)
DEFAULT_DURATION_S = 600.0
DOWNTIME_S = 2.0  # between a kill and the restart
RESTART_TIMEOUT_S = 300.0  # a restarted node not running again by then is `stuck`


@dataclass(frozen=True)
class ChurnConfig:
    rate: float  # kills per minute
    duration_s: float = DEFAULT_DURATION_S
    seed: int = 0
    poisson: bool = False
    downtime_s: float = DOWNTIME_S


@dataclass(frozen=True)
class Kill:
    at_s: float  # seconds after the churn starts
    victim: str


def max_down(n_nodes: int) -> int:
    """How many nodes may be down at once: a quarter of them, at least one."""
    return max(1, n_nodes // MAX_DOWN_FRACTION)


def kill_schedule(
    nodes: list[str], rate: float, duration_s: float, seed: int = 0, poisson: bool = False
) -> list[Kill]:
    """The kills of a churn, in order: pure and seeded (the same inputs, the same kills).

    Fixed interval: due at 60/rate, 2*60/rate, ... below `duration_s`. Poisson: gaps drawn
    from an exponential distribution of mean 60/rate. Victims are drawn uniformly from
    `nodes` minus the last `max_down(len(nodes))` victims (all of `nodes` if that leaves
    none)."""
    if rate <= 0 or not nodes:
        return []
    rng = random.Random(seed)
    recent: deque[str] = deque(maxlen=max_down(len(nodes)))
    kills: list[Kill] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate / 60.0) if poisson else 60.0 / rate
        if t >= duration_s:
            return kills
        candidates = [n for n in nodes if n not in recent] or list(nodes)
        victim = rng.choice(candidates)
        recent.append(victim)
        kills.append(Kill(round(t, 3), victim))


# -- the state file -------------------------------------------------------------------------


def load_state(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(directory) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def summary(state: dict[str, Any] | None, now: float | None = None) -> dict[str, Any] | None:
    """Counts for `node testnet status` and the live table."""
    if not state:
        return None
    now = time.time() if now is None else now
    events = state.get("events", [])
    started = state.get("started_unix") or now
    elapsed = max(0.0, now - started)
    per_node: dict[str, int] = {}
    for e in events:
        per_node[e["victim"]] = per_node.get(e["victim"], 0) + 1
    pending = [k for k in state.get("schedule", [])[len(events) + state.get("skipped", 0) :]]
    return {
        "kills": len(events),
        "restarts": sum(1 for e in events if e.get("restarted_s") is not None),
        "back": sum(1 for e in events if e.get("back_s") is not None),
        "down": sorted(
            {e["victim"] for e in events if e.get("back_s") is None and not e.get("stuck")}
        ),
        "stuck": sorted({e["victim"] for e in events if e.get("stuck")}),
        "skipped": state.get("skipped", 0),
        "scheduled": len(state.get("schedule", [])),
        "per_node": per_node,
        "elapsed_s": round(elapsed, 1),
        "duration_s": state["config"]["duration_s"],
        "next_kill_s": round(pending[0]["at_s"] - elapsed, 1) if pending else None,
        "done": bool(state.get("done")),
        "stopped": bool(state.get("stopped")),
    }


def describe(s: dict[str, Any] | None) -> str:
    """One line: `churn: 3 kills, 3 restarts, 1 down (node2), next kill in 12 s`."""
    if not s:
        return ""
    parts = [f"churn: {s['kills']} kills, {s['restarts']} restarts"]
    if s["down"]:
        parts.append(f"{len(s['down'])} down ({', '.join(s['down'])})")
    if s["stuck"]:
        parts.append(f"stuck: {', '.join(s['stuck'])}")
    if s["skipped"]:
        parts.append(f"{s['skipped']} skipped")
    if s["done"]:
        parts.append("done")
    elif s["stopped"]:
        parts.append("stopped")
    else:
        if s["next_kill_s"] is not None:
            parts.append(f"next kill in {max(0.0, s['next_kill_s']):.0f} s")
        parts.append(f"ends in {max(0.0, s['duration_s'] - s['elapsed_s']):.0f} s")
    return ", ".join(parts)


def new_state(config: ChurnConfig, schedule: list[Kill], n_nodes: int) -> dict[str, Any]:
    return {
        "config": asdict(config),
        "max_down": max_down(n_nodes),
        "schedule": [asdict(k) for k in schedule],
        "events": [],
        "skipped": 0,
        "started_unix": None,
        "done": False,
        "stopped": False,
    }
