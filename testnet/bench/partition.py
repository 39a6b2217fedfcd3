"""Run-document convergence after a partition heals.

    node bench partition [--quick]        (root: nodes run in network namespaces)

Starts a 4-node testnet of the partition scenario (testnet/partition_manifest.toml, each
process in its own network namespace, testnet/netns.py), lets it train, then splits it in
two halves (bootstrap + node1 + node2 | node3 + node4) for a while and heals it, several
times with growing splits. For each heal it measures, polling every node's control
endpoint:
* peers all live again: every node lists every other node from heartbeats;
* run documents converged: every replica holds every entry any replica held at the
  moment of the heal, at that version or a newer one (`rundoc` control command).
Both halves train during the split; the steps each half made are in the table too.
Results go to docs/benchmarks.md (section `partition`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from testnet import launcher, netns
from testnet.bench.report import machine, md_table, write_section
from testnet.observe import ask, holds


class BenchUnavailable(Exception):
    """This benchmark cannot run on this machine; the message says why."""




def _seconds_until(predicate, timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll until `predicate()` holds; returns the seconds it took (bounded)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start




def _view(p, key: str) -> list:
    """The membership service's `peers` (heard live) or `members` (run document)."""
    return (ask(p).get("membership") or {}).get(key, [])


def _step(p: launcher.Proc) -> int:
    return (ask(p).get("training") or {}).get("step", 0)


def cycle(net: launcher.Testnet, split_s: float) -> dict[str, Any]:
    """One split of `split_s` seconds and its heal."""
    nodes = [p for p in net.procs if p.name != "bootstrap"]
    ids = {p.name: ask(p)["peer_id"] for p in nodes}
    before = {p.name: _step(p) for p in nodes}
    launcher.partition(net)
    time.sleep(split_s)  # the split lasts this long by design: a measured input, not a sync
    after = {p.name: _step(p) for p in nodes}
    replicas = [ask(p, "rundoc") for p in nodes]
    snapshot: dict[str, list] = {}
    for r in replicas:
        for k, v in r.items():
            snapshot[k] = max(snapshot.get(k, v), v)
    behind = sum(1 for r in replicas for k, v in snapshot.items() if r.get(k) != v)
    launcher.heal(net)
    healed = time.monotonic()
    for p in nodes:
        others = {ids[q.name] for q in nodes if q is not p}
        _seconds_until(
            lambda p=p, o=others: {x["peer_id"] for x in _view(p, "peers")} >= o,
            120,
            f"{p.name} to see every peer",
        )
    live_s = time.monotonic() - healed
    for p in nodes:
        _seconds_until(
            lambda p=p: holds(ask(p, "rundoc"), snapshot),
            120,
            f"{p.name}'s run document to converge",
        )
    converged_s = time.monotonic() - healed
    half = (len(nodes) + 1) // 2  # as launcher.partition splits them
    gained = [after[p.name] - before[p.name] for p in nodes]
    return {
        "split_s": split_s,
        "steps_a": min(gained[:half]),
        "steps_b": min(gained[half:]),
        "behind": behind,
        "live_s": live_s,
        "converged_s": converged_s,
    }


def main(quick: bool = False, doc: Path | None = None) -> str:
    from rich.console import Console

    reason = netns.available()
    if reason:
        raise BenchUnavailable(
            f"the partition benchmark runs nodes in network namespaces: {reason}"
        )
    console = Console()
    splits = [5.0] if quick else [10.0, 30.0, 60.0]
    nodes = 2 if quick else 4
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "tn"
        net = launcher.up(
            directory,
            nodes,
            detached=True,
            netns=True,
            manifest=launcher.scenario_manifest_path("partition"),
        )
        try:
            procs = [p for p in net.procs if p.name != "bootstrap"]
            with console.status("waiting for every node to train and see every peer"):
                for p in procs:
                    _seconds_until(
                        lambda p=p: _step(p) > 0 and len(_view(p, "members")) == nodes - 1,
                        120,
                        f"{p.name} to train",
                    )
            for split_s in splits:
                with console.status(f"split for {split_s:g} s, then heal"):
                    rows.append(cycle(net, split_s))
                console.print(rows[-1])
        finally:
            launcher.down(directory)
    table = md_table(
        [
            "split s",
            "steps during split (half A / B, slowest node)",
            "entries to exchange",
            "peers all live again s",
            "run documents converged s",
        ],
        [
            [
                f"{r['split_s']:g}",
                f"{r['steps_a']} / {r['steps_b']}",
                str(r["behind"]),
                f"{r['live_s']:.1f}",
                f"{r['converged_s']:.1f}",
            ]
            for r in rows
        ],
    )
    console.print(table)
    median = statistics.median(r["converged_s"] for r in rows)
    text = (
        f"## Partition and heal: run-document convergence\n\n"
        f"`node bench partition{' --quick' if quick else ''}` on {machine()}: {nodes} nodes "
        f"of the partition scenario (the demo model, checkpoints every 50 steps), each process "
        f"in a network namespace of its own behind one router namespace. A split adds "
        f"`ip rule ... unreachable` between the halves at the router (dials fail at once) and "
        f"aborts the TCP connections across (`ss -K`); the heal removes the rules and leaves "
        f"reconnecting to the nodes (node/membership/redial.py). Half A is the bootstrap and "
        f"the first half of the nodes. Times are from the heal, polled every ~0.1 s per node.\n\n"
        f"{table}\n\n"
        f"'entries to exchange': (replica, entry) pairs where a replica lacked the newest "
        f"version at the heal. Both halves train through the split (NoLoCo pairs inside "
        f"each half). After the heal every node lists every peer again within "
        f"{max(r['live_s'] for r in rows):.1f} s (py-libp2p's AutoConnector and "
        f"node/membership/redial.py both redial; whichever is first), and the run documents hold "
        f"everything both halves wrote within {max(r['converged_s'] for r in rows):.1f} s "
        f"(median {median:.1f} s): a peer that comes back into the live view is synced with "
        f"by anti-entropy at once (node/run/rundoc_sync.py) instead of at the next random round."
    )
    write_section("partition", text, doc) if doc else write_section("partition", text)
    return text
