"""Wall time of one pairwise exchange of a fp32 model between two node processes.

    node bench exchange [--quick] [--hivemind-venv DIR]

Each side runs the node's own averaging adapter over libp2p and sends its full vector
while receiving the partner's (round 1 of NoLoCo). Reported per codec: wall time, bytes on
the wire per side, and the relative L2 error of what arrived. With `--hivemind-venv`, the
same measurement for hivemind's DecentralizedAverager (two peers averaging one tensor of
the same size) runs from that venv, side by side.
"""

from __future__ import annotations

import json
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
            "rel_err": max(ra["rel_err"], rb["rel_err"])}


def hivemind_once(venv: Path, mb: float, tmp: Path) -> float | None:
    python = venv / "bin" / "python"
    out = tmp / "hivemind.json"
    r = subprocess.run([str(python), str(HIVEMIND_SCRIPT), str(mb), str(out)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-2000:])
        return None
    return json.loads(out.read_text())["seconds"]


def main(quick: bool = False, hivemind_venv: Path | None = None, doc: Path | None = None) -> str:
    from rich.console import Console

    console = Console()
    mb, repeats = (20, 1) if quick else (100, 3)
    rows = []
    ours_fp32 = None
    with tempfile.TemporaryDirectory() as tmp:
        for codec in ("fp32", "bf16", "int8"):
            runs = [exchange_once(mb, codec, Path(tmp)) for _ in range(repeats)]
            secs = statistics.median(r["seconds"] for r in runs)
            ours_fp32 = secs if codec == "fp32" else ours_fp32
            rows.append([f"peertrain {codec}", f"{secs:.2f}",
                         f"{runs[0]['sent'] / 1e6:.1f}", f"{runs[0]['rel_err']:.2e}"])
        if hivemind_venv is not None:
            hm = [hivemind_once(hivemind_venv, mb, Path(tmp)) for _ in range(repeats)]
            hm_ok = [x for x in hm if x is not None]
            if hm_ok:
                secs = statistics.median(hm_ok)
                rows.append(["hivemind 1.1.12 DecentralizedAverager fp32", f"{secs:.2f}",
                             f"~{mb:.1f}", "-"])
                rows.append(["ratio peertrain fp32 / hivemind", f"{ours_fp32 / secs:.2f}x",
                             "", ""])
    table = md_table(["exchange", "wall s (median)", "MB sent per side", "rel. L2 error"],
                     rows)
    console.print(table)
    text = (f"## Training: pairwise exchange\n\n`node bench exchange{' --quick' if quick else ''}`"
            f" on {machine()}: two node processes on loopback each send a {mb:.0f} MB fp32 "
            f"vector and receive the other's ({repeats} runs).\n\n{table}\n\n"
            "Error is the relative L2 error of the received vector against what was sent. "
            "peertrain moves tensors on its bulk lane (raw TCP + AES-256-GCM, keyed over the "
            "libp2p stream). Target (issue 3): at most 0.5x hivemind's fp32 time. Both ends "
            "run on the same 2 cores, so the number is CPU-bound: every copy, crc and "
            "conversion on the path counts.")
    write_section("exchange", text, doc or DOC)
    return text
