"""Trainer utilization: the fraction of wall time each trainer spends computing.

    node bench utilization [--nodes 4] [--quick]

Starts a testnet on the demo manifest, lets it train for a fixed time, and reads each
node's `compute_fraction` (compute seconds / wall seconds since training began, from
`node status`) together with how many rounds were averaged or fell back to local steps.
Target (issue 3): >= 95%: the exchange must hide behind compute.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from node.status.control import query_control
from testnet import launcher
from testnet.bench.report import machine, md_table, write_section


def main(quick: bool = False, nodes: int = 4, doc: Path | None = None) -> str:
    from rich.console import Console

    console = Console()
    seconds = 30 if quick else 90
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "tn"
        net = launcher.up(directory, nodes, detached=True)
        try:
            with console.status(f"training {nodes} nodes for {seconds} s"):
                time.sleep(seconds)  # a fixed measurement window, not a synchronization
            for p in net.procs:
                if p.name == "bootstrap":
                    continue
                t = query_control(Path(p.state_dir))["training"]
                rows.append([p.name, str(t["step"]), f"{t['compute_fraction']:.1%}",
                             str(t["rounds_averaged"]), str(t["rounds_local"]),
                             f"{t['bytes_sent'] / 1e6:.1f}", f"{t['val_loss']:.3f}"])
        finally:
            launcher.down(directory)
    headers = ["node", "steps", "compute share", "rounds averaged", "rounds local",
               "MB sent", "val loss"]
    table = md_table(headers, rows)
    console.print(table)
    text = (f"## Training: utilization\n\n`node bench utilization{' --quick' if quick else ''}`"
            f" on {machine()}: {nodes} nodes of the demo run (byte-level GPT, 0.44M "
            f"parameters, NoLoCo every 20 steps, bf16 exchange) for {seconds} s, all on this "
            f"machine's cores.\n\n{table}\n\nTarget: >= 95% of wall time computing.")
    write_section("utilization", text, doc) if doc else write_section("utilization", text)
    return text
