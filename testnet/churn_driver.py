"""The churn driver: `python -m testnet.churn_driver DIR` runs the schedule in DIR/churn.json
against the testnet in DIR (what it does, and why, is testnet/churn.py's docstring).
`launcher.start_churn` starts it and `launcher.stop_churn` (SIGTERM) stops it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from testnet import launcher
from testnet.churn import RESTART_TIMEOUT_S, STATE_FILE, ChurnConfig, Kill, load_state

TICK_S = 0.2


class Driver:
    """Runs one churn's schedule against the testnet in `directory` (see the module doc)."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        state = load_state(self.dir)
        if state is None:
            raise SystemExit(f"no {STATE_FILE} in {self.dir}")
        self.state = state
        self.config = ChurnConfig(**state["config"])
        self.schedule = [Kill(**k) for k in state["schedule"]]
        self.stop = False

    def save(self) -> None:
        from node.files import atomic_write

        atomic_write(self.dir / STATE_FILE, json.dumps(self.state, indent=1).encode())

    def _net(self):
        net = launcher.Testnet.load(self.dir)
        if net is None:
            raise SystemExit("the testnet is gone")
        return net

    def run(self) -> None:
        start = time.monotonic()
        self.state.update(started_unix=time.time(), pid=os.getpid())
        self.save()
        events: list[dict[str, Any]] = self.state["events"]
        limit = self.state["max_down"]
        nxt = 0
        while not self.stop:
            launcher._reap()  # restarted nodes are our children: collect the killed ones
            now = time.monotonic() - start
            changed = False
            for e in events:  # restarts due, restarted nodes back (or dead, or stuck)
                if e.get("stuck") or e.get("back_s") is not None:
                    continue
                if e.get("restarted_s") is None:
                    net = self._net()
                    p = next(q for q in net.procs if q.name == e["victim"])
                    if now >= e["killed_s"] + self.config.downtime_s and not launcher.alive(
                        p.pid, p.state_dir
                    ):
                        new = launcher.restart_node(net, e["victim"])
                        e.update(restarted_s=round(now, 3), pid=new.pid)
                        changed = True
                elif now - e["restarted_s"] > RESTART_TIMEOUT_S:
                    e["stuck"] = "not running after restart"
                    changed = True
                else:
                    net = self._net()
                    p = next(q for q in net.procs if q.name == e["victim"])
                    if not launcher.alive(p.pid, p.state_dir):
                        e["stuck"] = "exited after restart: " + launcher.tail(
                            Path(p.state_dir) / "stdout.log", 3
                        )
                        changed = True
                    elif launcher._phase(p) == "running":
                        e["back_s"] = round(time.monotonic() - start, 3)
                        changed = True
            if nxt < len(self.schedule) and now >= self.config.duration_s:
                self.state["skipped"] = len(self.schedule) - nxt  # could not happen in time
                nxt = len(self.schedule)
                changed = True
            elif nxt < len(self.schedule) and now >= self.schedule[nxt].at_s:
                down = {e["victim"] for e in events if e.get("back_s") is None}
                kill = self.schedule[nxt]
                if len(down) < limit and kill.victim not in down:
                    events.append(self._kill(kill, start))
                    nxt += 1
                    changed = True
            if changed:
                self.save()
            if nxt >= len(self.schedule) and all(
                e.get("back_s") is not None or e.get("stuck") for e in events
            ):
                self.state["done"] = True
                self.state["done_s"] = round(time.monotonic() - start, 3)
                break
            time.sleep(TICK_S)
        if self.stop:
            self.state["stopped"] = True
        self.save()

    def _kill(self, kill: Kill, start: float) -> dict[str, Any]:
        """SIGKILL the victim's process group; note what it held just before.

        `killed_s` is read after the kill, on the same clock as `back_s`: a time taken at the
        top of the tick could precede a `back_s` noted later in that same tick.
        """
        from node.checkpoints.store import CheckpointStore
        from node.status.control import query_control

        net = self._net()
        p = next(q for q in net.procs if q.name == kill.victim)
        event: dict[str, Any] = {"victim": kill.victim, "due_s": kill.at_s, "old_pid": p.pid}
        with contextlib.suppress(Exception):
            st = query_control(Path(p.state_dir), timeout=1.0)
            t = st.get("training") or {}
            event.update(
                peer_id=st.get("peer_id"),
                step=t.get("step"),
                rounds_averaged=t.get("rounds_averaged"),
                rounds_local=t.get("rounds_local"),
            )
        with contextlib.suppress(Exception):
            held = CheckpointStore(Path(p.state_dir)).list(net.run_id)
            event["ckpt_step"] = held[-1][1].step if held else None
        with contextlib.suppress(ProcessLookupError):
            launcher.kill_node(net, kill.victim, signal.SIGKILL)
        event["killed_s"] = round(time.monotonic() - start, 3)
        return event


def main(argv: list[str]) -> int:
    directory = Path(argv[0])
    driver = Driver(directory)

    def stop(signum, frame) -> None:  # obeyed between two actions: never half a restart
        driver.stop = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if sys.stdin.readline().strip() != "go":  # the launcher recorded our pid first
        return 1
    driver.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
