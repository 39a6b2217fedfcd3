"""Join to first step: a node joining a running testnet, phase by phase.

    node bench join [--quick] [--nodes 4] [--joins 3]

Starts a testnet of `--nodes` nodes training a byte-level GPT of 6.4M parameters (25.5 MB
of fp32 weights; its checkpoint, with AdamW and NoLoCo state, is 128 MB), waits until the
run document lists a checkpoint, then starts joiners one at a time. Each must find the
run, sync the run document, download the newest checkpoint from every provider at once,
load it and take a step. The phases come from the joiner's own clock (`phase_times` in
`node status`); start-up is process spawn to the node's start (Python and imports).
Each joiner is stopped before the next starts. --quick: a 0.1M-parameter model, 2 nodes,
1 joiner. Results go to docs/benchmarks.md (section `join`).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from node.checkpoints.store import CheckpointStore
from testnet import launcher
from testnet.bench.report import machine, md_table, write_section
from testnet.observe import ask, until

MANIFEST = """\
# written by testnet/bench/join.py
schema = 1

[run]
name = "bench-join"
description = "Join benchmark: a GPT big enough that the checkpoint download matters."

[model]
d_model = {d_model}
n_layers = {n_layers}
n_heads = 4
context = 64

[train]
batch_size = 4
eval_every = 100000         # no evaluation: it would only add noise to the step times

[outer]
inner_steps = 20

[checkpoint]
every_steps = {every}
keep = 2
"""
FULL = {"d_model": 256, "n_layers": 8, "every": 40}
QUICK = {"d_model": 64, "n_layers": 2, "every": 20}






def join_once(net: launcher.Testnet, name: str, timeout: float = 300.0) -> dict[str, Any]:
    """Start joiner `name`, wait for its first step, stop it; its phases in seconds."""
    spawned = time.time()
    proc = launcher.add_node(net, name)
    try:

        def first_step() -> dict | None:
            st = ask(proc.state_dir)
            error = (st.get("training") or {}).get("error")
            if error:
                raise RuntimeError(f"{name} failed to train: {error}")
            return st if "first step" in st.get("phase_times", {}) else None

        st = until(first_step, timeout, f"{name}'s first step")
    finally:
        launcher.kill_node(net, name)
    t = st["phase_times"]
    download = (st.get("checkpoints") or {}).get("download") or {}
    size = 0
    if download.get("cid"):
        size = CheckpointStore(Path(proc.state_dir)).manifest(download["cid"]).size
    dl_start = t.get("downloading checkpoint")
    ran = t.get("running", t["first step"])
    return {
        "startup": st["started_unix"] - spawned,
        "connect": t.get("discovering", 0.0),
        "discover": t.get("syncing state", ran) - t.get("discovering", 0.0),
        "sync": t.get("finding providers", ran) - t.get("syncing state", ran),
        "find": (dl_start if dl_start is not None else ran) - t.get("finding providers", ran),
        "download": ran - dl_start if dl_start is not None else 0.0,
        "first_step": t["first step"] - ran,
        "total": st["started_unix"] - spawned + t["first step"],
        "mb": size / 1e6,
        "providers": download.get("providers", 0),
        "served_by": download.get("served_by", 0),
        "step": download.get("step"),
        "params": (st.get("training") or {}).get("params", 0),
    }


def _findings(results: list[dict[str, Any]]) -> str:
    """What the numbers say, from the numbers (and why, from instrumented runs)."""
    if not results:
        return ""
    notes = []
    if all(r["served_by"] == 1 for r in results if r["providers"]):
        notes.append(
            f"Every checkpoint came from 1 of the {results[0]['providers']} providers asked: "
            "in a NoLoCo swarm each node checkpoints its own weights, so a checkpoint has one "
            "holder, its writer, until a joiner pulls it (a joiner provides what it holds, but "
            "this benchmark stops each joiner before the next starts). The parallel pull helps "
            "when several peers hold the same checkpoint (`node bench pull`)."
        )
    finds = [r["find"] for r in results]
    if len(finds) > 1 and finds[-1] > 2 * finds[0] + 1:
        notes.append(
            "find providers grows with each joiner ("
            + ", ".join(f"{f:.1f}" for f in finds)
            + " s): the joiners stopped before it are still in the DHT routing tables, and "
            "the lookup waits on them until it gives up (3 s for a join's lookup; the writer "
            "and connected peers are asked anyway)."
        )
    notes.append(
        "discover is mostly `import torch`, done once the node is visible (6.7 s of a "
        "7.5 s discover phase in an instrumented run); first step includes building the "
        "model, reading the training data and verifying and loading the checkpoint."
    )
    return "\n\n" + "\n\n".join(notes)


def main(quick: bool = False, nodes: int = 4, joins: int = 3, doc: Path | None = None) -> str:
    from rich.console import Console

    console = Console()
    sizes = QUICK if quick else FULL
    nodes, joins = (2, 1) if quick else (nodes, joins)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "join.toml"
        manifest.write_text(MANIFEST.format(**sizes))
        directory = Path(tmp) / "tn"
        with console.status(f"starting {nodes} nodes"):
            net = launcher.up(directory, nodes, manifest=manifest, detached=True, timeout=120)
        try:
            node1 = next(p for p in net.procs if p.name == "node1")
            with console.status("training until the run document lists a checkpoint"):
                until(
                    lambda: any("/ckpt/" in k for k in ask(node1.state_dir, "rundoc")),
                    600,
                    "a first checkpoint",
                )
            for i in range(1, joins + 1):
                with console.status(f"joiner {i} of {joins}"):
                    results.append(join_once(net, f"join{i}"))
                console.print(
                    json.dumps(
                        {
                            k: round(v, 2) if isinstance(v, float) else v
                            for k, v in results[-1].items()
                        }
                    )
                )
        finally:
            launcher.down(directory)
    keys = ("startup", "connect", "discover", "sync", "find", "download", "first_step", "total")
    rows = [
        [
            f"join{i}",
            *(f"{r[k]:.2f}" for k in keys[:5]),
            f"{r['download']:.2f} ({r['mb']:.0f} MB from {r['served_by']} of "
            f"{r['providers']} providers asked, "
            f"{r['mb'] / r['download'] if r['download'] else 0:.0f} MB/s)",
            *(f"{r[k]:.2f}" for k in keys[6:]),
        ]
        for i, r in enumerate(results, 1)
    ]
    if len(results) > 1:
        rows.append(["median", *(f"{statistics.median(r[k] for r in results):.2f}" for k in keys)])
    headers = ["joiner", "start-up", "connect", "discover", "sync state", "find providers"]
    headers.append("download checkpoint")
    table = md_table([*headers, "first step", "total s"], rows)
    console.print(table)
    params = results[0]["params"] if results else 0
    text = (
        f"## Joining mid-run: join to first step\n\n"
        f"`node bench join{' --quick' if quick else ''}` on {machine()}: {nodes} nodes train "
        f"a byte-level GPT (d_model {sizes['d_model']}, {sizes['n_layers']} layers, context "
        f"64, {params:,} parameters = {params * 4 / 1e6:.1f} MB of fp32 weights; batch 4, "
        f"NoLoCo every 20 steps, a checkpoint every {sizes['every']} steps) on this "
        f"machine's cores; then {joins} joiner{'s join' if joins > 1 else ' joins'}, one at a "
        f"time. Seconds, from the joiner's own clock:\n\n"
        f"- start-up: process spawn to node start (Python, libp2p imports);\n"
        f"- connect: bootstrap dialed, DHT self-lookup;\n"
        f"- discover: run providers found in the DHT, manifest fetched and verified, "
        f"announced (DHT provide, heartbeats), torch imported;\n"
        f"- sync state: the first anti-entropy round of the run document (bounded by 5 s);\n"
        f"- find providers: DHT lookup of the newest checkpoint's providers;\n"
        f"- download checkpoint: the newest checkpoint in the run document, from every "
        f"provider asked (its DHT providers, its writer, every connected peer) in parallel, "
        f"every chunk verified; only peers holding that exact checkpoint serve it;\n"
        f"- first step: model built, checkpoint verified again and loaded, one training "
        f"step, while {nodes} trainers share the same 2 cores.\n\n{table}{_findings(results)}"
    )
    write_section("join", text, doc) if doc else write_section("join", text)
    return text
