"""Wall time of one pairwise exchange of a fp32 model between two node processes.

    node bench exchange [--quick] [--hivemind-venv DIR]

Each side runs the node's own averaging adapter over libp2p and sends its full vector
while receiving the partner's (round 1 of NoLoCo). Reported per codec: wall time (median
and range), CPU time per side, bytes on the wire per side, and the relative L2 error of what
arrived. With `--hivemind-venv`, the same measurement for hivemind's DecentralizedAverager
(two peers averaging one tensor of the same size) runs from that venv, side by side.

Both ends share this machine's cores with whatever else runs on it, so wall times are
noisy: the runs are interleaved (every repeat runs every variant, so a change in load hits
them all alike), and the load average is reported with the results.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from testnet.bench.report import DOC, machine, md_table, write_section

WORKER = [sys.executable, "-m", "testnet.bench.exchange_worker"]
HIVEMIND_SCRIPT = Path(__file__).with_name("hivemind_averager.py")


def exchange_once(mb: float, codec: str, tmp: Path) -> dict:
    a_out, b_out = tmp / "a.json", tmp / "b.json"
    a = subprocess.Popen([*WORKER, "A", str(a_out), str(mb), codec], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert a.stdout is not None
        addr, peer = a.stdout.readline().split()
        subprocess.run([*WORKER, "B", str(b_out), str(mb), codec, addr, peer], check=True,
                       timeout=300)
        a.wait(timeout=120)
    finally:
        a.kill()
    ra, rb = json.loads(a_out.read_text()), json.loads(b_out.read_text())
    assert ra["ok"] and rb["ok"], (ra, rb)
    return {"seconds": max(ra["seconds"], rb["seconds"]), "sent": ra["sent"],
            "cpu": [ra["cpu"], rb["cpu"]], "rel_err": max(ra["rel_err"], rb["rel_err"])}


def hivemind_once(venv: Path, mb: float, tmp: Path) -> float | None:
    python = venv / "bin" / "python"
    out = tmp / "hivemind.json"
    r = subprocess.run([str(python), str(HIVEMIND_SCRIPT), str(mb), str(out)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-2000:])
        return None
    return json.loads(out.read_text())["seconds"]


CODECS = ("fp32", "bf16", "int8")


def _span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def main(quick: bool = False, hivemind_venv: Path | None = None, doc: Path | None = None) -> str:
    from rich.console import Console

    console = Console()
    mb, repeats = (20, 1) if quick else (100, 5)
    runs: dict[str, list[dict]] = {codec: [] for codec in CODECS}
    hm: list[float] = []
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):  # interleaved: every repeat runs every variant
            for codec in CODECS:
                runs[codec].append(exchange_once(mb, codec, Path(tmp)))
            if hivemind_venv is not None:
                secs = hivemind_once(hivemind_venv, mb, Path(tmp))
                hm += [] if secs is None else [secs]
            load.append(os.getloadavg()[0])
    rows = []
    for codec in CODECS:
        wall = [r["seconds"] for r in runs[codec]]
        cpu = [c for r in runs[codec] for c in r["cpu"]]
        rows.append([f"peertrain {codec}", f"{statistics.median(wall):.2f}", _span(wall),
                     f"{statistics.median(cpu):.2f} ({_span(cpu)})",
                     f"{runs[codec][0]['sent'] / 1e6:.1f}", f"{runs[codec][0]['rel_err']:.2e}"])
    if hm:
        ours = statistics.median(r["seconds"] for r in runs["fp32"])
        rows.append(["hivemind 1.1.12 DecentralizedAverager fp32",
                     f"{statistics.median(hm):.2f}", _span(hm), "-", f"~{mb:.1f}", "-"])
        rows.append(["ratio peertrain fp32 / hivemind", f"{ours / statistics.median(hm):.2f}x",
                     "", "", "", ""])
    table = md_table(["exchange", "wall s (median)", "wall s (range)",
                      "CPU s per side (median, range)", "MB sent per side", "rel. L2 error"],
                     rows)
    console.print(table)
    text = (f"## Training: pairwise exchange\n\n`node bench exchange{' --quick' if quick else ''}`"
            f" on {machine()}: two node processes on loopback each send a {mb:.0f} MB fp32 "
            f"vector and receive the other's ({repeats} interleaved runs of each; 1-minute load"
            f" average {min(load):.1f}-{max(load):.1f} during them).\n\n{table}\n\n"
            "Error is the relative L2 error of the received vector against what was sent. "
            "CPU is the time each node process spent in the exchange (all threads, user and "
            "system, the kernel's TCP work included). peertrain moves tensors on its bulk lane "
            "(raw TCP + AES-256-GCM, keyed over the libp2p stream): no crc32 there (GCM "
            "authenticates every record), and each fp32 record is opened straight into the "
            "receive vector. Target (issue 3): at most 0.5x hivemind's fp32 time. Both ends "
            "run on the same 2 cores, so the number is CPU-bound, and wall times move with "
            "the load that other work puts on the machine.")
    write_section("exchange", text, doc or DOC)
    return text
