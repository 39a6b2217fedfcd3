"""Rich renderings shared by `node status` and the testnet's live table."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def short(peer_id: str | None) -> str:
    return f"…{peer_id[-8:]}" if peer_id else "-"


def node_status_table(st: dict[str, Any]) -> Group:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("peer", st["peer_id"])
    head.add_row("role / phase", f"{st['role']} / {st['phase']}")
    if st.get("run"):
        head.add_row("run", f"{st['run']} ({st.get('run_name')})")
    head.add_row("device", str(st.get("device")))
    head.add_row("uptime", f"{st['uptime_s']:.0f} s")
    head.add_row("addrs", "\n".join(st["addrs"]))
    head.add_row("connections", f"{st['connections']} (DHT table {st['dht_routing_table']})")
    peers = Table(title=f"{len(st['peers'])} live peers", title_justify="left")
    for col in ("peer", "last seen", "device", "addrs"):
        peers.add_column(col)
    for p in st["peers"]:
        peers.add_row(p["peer_id"], f"{p['last_seen_s']:.1f} s ago", str(p.get("device", "")),
                      (p.get("addrs") or ["-"])[0])
    return Group(head, Text(""), peers)


def testnet_table(rows: list[dict[str, Any]], title: str) -> Table:
    """One row per testnet process; `rows` come from `testnet.launcher.collect_status`."""
    table = Table(title=title, title_justify="left")
    for col in ("node", "pid", "peer", "phase", "peers", "conns", "uptime"):
        table.add_column(col, justify="right" if col in ("pid", "peers", "conns") else "left")
    for r in rows:
        st = r.get("status")
        if st is None:
            table.add_row(r["name"], str(r["pid"]), "-", Text(r.get("error", "down"), "red"),
                          "-", "-", "-")
            continue
        phase = Text(st["phase"], "green" if st["phase"] == "running" else "yellow")
        peers = "-" if st["role"] == "bootstrap" else str(len(st["peers"]))
        table.add_row(r["name"], str(r["pid"]), short(st["peer_id"]), phase, peers,
                      str(st["connections"]), f"{st['uptime_s']:.0f} s")
    return table
