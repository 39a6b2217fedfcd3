"""Where the simulator and a real-process testnet overlap: heartbeats on loopback.

`python -m testnet.sim.realcheck DIR [SECONDS [TARGET]] > real.json` reads every node of
the testnet in DIR (`node testnet up -n N --no-train --dir DIR`, or nodes started with
`--heartbeat-target TARGET`, default 50 a second) twice, SECONDS apart, through
`node status --json`: the heartbeat interval each node uses, the heartbeats it received
per second (its 10 s meter), the heartbeats it sent in between, and its live view. Next
to them it puts the simulator's prediction for the same N and settings
(testnet/sim/scenarios/node.toml: `policies.heartbeat`, each node receives every other
node's heartbeats once after gossipsub's de-duplication, (N - 1) / interval per second).
The bootstrap only listens (no heartbeats), so N counts the joined nodes. `node bench
sim --real real.json` puts both into the sim section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from protocols.heartbeat import TARGET_INBOUND_PER_S, heartbeat_interval_s
from testnet.sim import policies
from testnet.sim.sizes import measure as measure_sizes


def _status(state_dir: str) -> dict[str, Any] | None:
    exe = Path(sys.executable).with_name("peertrain")
    try:
        out = subprocess.run([str(exe), "status", "--state-dir", state_dir, "--json"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return json.loads(out)
    except (subprocess.SubprocessError, json.JSONDecodeError):
        return None


def measure(directory: Path, seconds: float = 30.0,
            target: float = TARGET_INBOUND_PER_S) -> dict[str, Any]:
    state = json.loads((directory / "testnet.json").read_text())
    nodes = [p["state_dir"] for p in state["procs"] if p["name"] != "bootstrap"]
    first = {d: _status(d) for d in nodes}
    t0 = time.monotonic()
    time.sleep(seconds)  # a measurement window, not a synchronization
    second = {d: _status(d) for d in nodes}
    dt = time.monotonic() - t0
    rows = []
    for d in nodes:
        a, b = first[d], second[d]
        if not a or not b:
            continue
        ma, mb = a["membership"], b["membership"]
        rows.append({
            "node": Path(d).name, "interval_s": mb["heartbeat_interval_s"],
            "inbound_per_s": mb["inbound_heartbeats_per_s"],
            "sent_per_s": (mb["heartbeats_sent"] - ma["heartbeats_sent"]) / dt,
            "live": len(mb["peers"]),
            "announce_s": b["run_document"].get("announce_interval_s"),
            "entries": b["run_document"].get("entries")})
    n = len(nodes)
    sent = sum(r["sent_per_s"] for r in rows) / max(1, len(rows))
    return {"n": n, "answered": len(rows), "window_s": dt, "rows": rows, "target": target,
            "load": os.getloadavg(), "cpus": os.cpu_count(),
            "sim": predict(n, sent, target)}


def predict(n: int, sent_per_s: float,
            target: float = TARGET_INBOUND_PER_S) -> dict[str, float]:
    """The simulator's figures for n joined nodes (node.toml's policies, the nodes'
    heartbeat target)."""
    interval = heartbeat_interval_s(n, 1.0, target)
    return {"interval_s": interval, "inbound_per_s": (n - 1) / interval,
            "announce_s": policies.announce(n, 2.0),
            "entries": n * measure_sizes().entries_per_peer,
            # the same formula at the rate the nodes really sent (a loaded machine
            # stretches trio's sleeps): what the simulator says at that rate
            "inbound_at_measured_send_rate": (n - 1) * sent_per_s}



if __name__ == "__main__":
    print(json.dumps(measure(Path(sys.argv[1]),
                             float(sys.argv[2]) if len(sys.argv) > 2 else 30.0,
                             float(sys.argv[3]) if len(sys.argv) > 3 else TARGET_INBOUND_PER_S),
                     indent=1))
