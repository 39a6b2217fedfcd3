"""Rich renderings shared by `node status` and the testnet's live table."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def short(peer_id: str | None) -> str:
    return f"…{peer_id[-6:]}" if peer_id else "-"


#: A clock this far off the swarm's is worth a line in `node status`: heartbeat ages are
#: corrected for it (node/membership/view.py), other peers' view of this node's are not.
CLOCK_WARN_S = 5.0
#: A pipeline's last stage computes its loss every step: one older than this is shown with
#: its age, not as the current loss (issue 27: a loss 8 minutes old read as current).
LOSS_OLD_S = 30.0


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
    p2p = st.get("p2p") or {}
    conns = Text(f"{p2p.get('connections', 0)} (DHT table {p2p.get('dht_routing_table', 0)})")
    refused = (p2p.get("inbound") or {}).get("refused") or {}
    if refused:  # p2p/slots.py: every inbound slot taken, or one peer over its share
        conns.append("; inbound refused: " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(refused.items())), "yellow")
    head.add_row("connections", conns)
    reach = st.get("reach")
    if reach:
        head.add_row("reachability", reach_line(reach))
    relay = st.get("relay") or {}
    if relay.get("reservations") or relay.get("serving") or relay.get("error"):
        head.add_row("relays", relay_line(relay))
    offset = (st.get("membership") or {}).get("clock_offset_s")
    if offset is not None and abs(offset) >= CLOCK_WARN_S:
        head.add_row("clock", Text(f"{abs(offset):.0f} s {'ahead of' if offset > 0 else 'behind'}"
                                   " the swarm's (median of the peers' heartbeats): is NTP "
                                   "running?", "yellow"))
    punch = st.get("punch") or {}
    if punch.get("attempts") or punch.get("answered") or punch.get("error"):
        head.add_row("hole punching", punch_line(punch))
    pipe = st.get("pipeline")
    t = st.get("training") or (pipe or {}).get("training")
    if pipe:
        for label, line in pipeline_lines(pipe):
            head.add_row(label, line)
    if t:
        head.add_row("training", Text(f"{t['phase']}: step {t['step']}, loss "
                                      f"{loss_text(t)}, val {_num(t['val_loss'], '{:.3f}')}, "
                                      f"compute {t['compute_fraction']:.0%}",
                                      phase_style(t['phase'])))
    if t and not pipe:
        head.add_row("averaging", f"{t['rounds_averaged']} rounds averaged, "
                     f"{t['rounds_local']} local; last partner {short(t['last_partner'])}; "
                     f"sent {_bytes(t['bytes_sent'])}, received {_bytes(t['bytes_received'])}")
    if t and t.get("error"):
        head.add_row("error", Text(t["error"], "red"))
    live = _peers(st)
    peers = Table(title=f"{len(live)} live peers", title_justify="left")
    kinds = (st.get("peer_paths") or {}).get("peers")
    paths = ({peer: k["path"] for peer, k in kinds.items()} if kinds is not None
             else relay.get("paths") or {})
    # a WebRTC data channel (node/webrtc/) replaces a relayed path for our streams
    paths = {**paths, **((st.get("webrtc") or {}).get("paths") or {})}
    partners = (st.get("averaging") or {}).get("partners") or {}
    for col in ("peer", "last seen", "device", "path", "rtt", "exchange", "addrs"):
        peers.add_column(col, justify="right" if col in ("rtt", "exchange") else "left")
    for p in live:
        path = path_text(paths.get(p["peer_id"], "not connected"))
        rtt = ((kinds or {}).get(p["peer_id"]) or {}).get("rtt_ms")
        peers.add_row(p["peer_id"], f"{p['last_seen_s']:.1f} s ago", str(p.get("device", "")),
                      path, _num(rtt, "{:.0f} ms"), exchange_cell(partners.get(p["peer_id"])),
                      (p.get("addrs") or ["-"])[0])
    parts = [head, Text(""), peers]
    bans = (st.get("guard") or {}).get("bans") or {}
    if bans:
        parts += [Text(""), _bans(bans)]
    return Group(*parts)


def phase_style(phase: str | None) -> str:
    """Red for a stalled pipeline (node/pipe/stall.py), yellow for any other phase that
    is not training or running."""
    if phase and phase.startswith("stalled"):
        return "red"
    return "" if phase in ("running", "training", None) else "yellow"


def loss_text(t: dict[str, Any], compact: bool = False) -> str:
    """The loss, with its age when it is older than LOSS_OLD_S (`3.310 (8 min old)`;
    compact: `3.310 old`)."""
    loss, age = t.get("loss"), t.get("loss_age_s")
    if loss is None or age is None or age <= LOSS_OLD_S:
        return _num(loss, "{:.3f}")
    return f"{loss:.3f} old" if compact else f"{loss:.3f} ({_age(age)} old)"


def _age(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _short_phase(phase: str) -> str:
    """The compact table's phase: `stalled: waiting for stage 2 since 40 s` as
    `stalled>2 40s` (`>2!`: stage 2 has no live host; `q21`: 21 messages queued here)."""
    if phase.startswith("stalled: "):
        what, _, since = phase.removeprefix("stalled: ").partition(" since ")
        if what.startswith("waiting for stage"):
            what = ">" + what.removeprefix("waiting for stage").strip().removeprefix(
                "s ").replace(" (no live host)", "!").replace(" ", "")
        else:
            what = " q" + what.split()[0]
        seconds = since.removesuffix(" s")
        age = _age(float(seconds)).replace(" min", "m") if seconds.isdigit() else since
        return f"stalled{what} {age.replace(' s', 's')}"
    return _SHORT_PHASES.get(phase, phase)


def pipeline_lines(pipe: dict[str, Any]) -> list[tuple[str, str | Text]]:
    """`node status`'s pipeline rows: this node's stage, its traffic, the stage map."""
    stage = pipe.get("stage")
    lines: list[tuple[str, str | Text]] = [
        ("pipeline", Text(f"stage {_num(stage, '{:d}')} of {pipe.get('stages')} "
                          f"({pipe.get('phase')}; {pipe.get('moves', 0)} moves)",
                          phase_style(pipe.get("phase"))))]
    w = pipe.get("worker") or {}
    if w:
        per_mb = pipe.get("bytes_per_micro_batch") or {}
        lines.append(("micro-batches", f"{w['micro_batches']} done, {w['dropped']} dropped, "
                      f"{w['stale']} stale, {w['micro_batches_per_s']}/s; "
                      + ", ".join(f"{k} {_bytes(v)}/mb" for k, v in per_mb.items())))
    rep = pipe.get("replicas") or {}
    if rep:
        lines.append(("replicas", f"{rep['rounds_averaged']} rounds averaged with this "
                      f"stage's other hosts, {rep['rounds_local']} local, {rep['rounds_alone']} "
                      f"alone; last partner {short(rep.get('last_partner'))}"))
    refused = pipe.get("refused") or {}
    if refused:
        lines.append(("refused", ", ".join(f"{k} {v}" for k, v in sorted(refused.items()))))
    smap = pipe.get("map") or {}
    lines.append(("stage map", "\n".join(
        f"{s}: {', '.join(short(p) for p in hosts) or 'NO HOST'}"
        + (" (this node)" if str(stage) == s else "") for s, hosts in smap.items())))
    return lines


def reach_line(reach: dict[str, Any]) -> Text:
    """`public via upnp (DHT server); upnp: mapped /ip4/...` or the gateway's refusal."""
    state = reach.get("reachability", "unknown")
    colour = {"public": "green", "private": "yellow"}.get(state, "")
    line = Text(state, colour)
    if reach.get("via"):
        line.append(f" via {reach['via']}")
    line.append(f" (DHT {reach.get('dht', '?')})")
    upnp = reach.get("upnp") or {}
    if upnp.get("mapping"):
        line.append(f"; upnp: {upnp['mapping']}")
    elif upnp.get("error"):
        line.append("; upnp: ")
        line.append(upnp["error"], "red")
    return line


def exchange_cell(partner: dict[str, Any] | None) -> str:
    """The last exchange with a peer: its wire rate and codec (`12.5 MB/s bf16`), `-` if
    none yet."""
    if not partner or partner.get("wire_mb_per_s") is None:
        return "-"
    return f"{partner['wire_mb_per_s']:.1f} MB/s {partner.get('codec') or ''}".rstrip()


def path_text(path: str) -> str:
    """A path kind for a table: `relayed via …abc123` (the relay's id shortened)."""
    if path.startswith("relayed via "):
        return f"relayed via {short(path[len('relayed via '):])}"
    return path


def punch_line(punch: dict[str, Any]) -> Text:
    """`2 punched of 3 tries; answered 1 (1 punched); 0 bad sessions`, and the last error."""
    line = Text(f"{punch.get('punched', 0)} punched of {punch.get('attempts', 0)} tries; "
                f"answered {punch.get('answered', 0)} ({punch.get('answered_punched', 0)} "
                f"punched); {punch.get('protocol_errors', 0)} bad sessions")
    if punch.get("error"):
        line.append(f"; last: {punch['error']}", "yellow")
    return line


def paths_cell(paths: dict[str, Any] | None) -> str:
    """Peers per path kind for the testnet table: `2d 1p 1r` (direct, punched, relayed;
    u: upnp, w: webrtc)."""
    by_kind = (paths or {}).get("by_kind") or {}
    parts = [f"{n}{kind[0]}" for kind, n in by_kind.items() if n]
    return " ".join(parts) or "-"


def relay_line(relay: dict[str, Any]) -> Text:
    """`reserved on …abc, …def` (a private node) or `serving 2 reservations, 1 circuit,
    3.1 MB relayed` (a public one), and the last error."""
    parts = []
    held = relay.get("reservations") or {}
    if held:
        parts.append("reserved on " + ", ".join(short(r) for r in sorted(held)))
    serving = relay.get("serving")
    if serving:
        refused = sum((serving.get("refused") or {}).values())
        parts.append(f"serving {len(serving.get('reservations') or {})} reservations, "
                     f"{len(serving.get('circuits') or [])} circuits, "
                     f"{_bytes(serving.get('bytes_relayed', 0))} relayed, {refused} refused")
    line = Text("; ".join(parts))
    if relay.get("error"):
        line.append(("; " if parts else "") + str(relay["error"]), "yellow")
    return line


def _bans(bans: dict[str, dict[str, Any]]) -> Table:
    """Banned peers (the guard service): who, why, until when."""
    table = Table(title=f"{len(bans)} banned peers", title_justify="left")
    for col in ("peer", "why", "until", "ban #"):
        table.add_column(col)
    for peer, ban in sorted(bans.items()):
        until = ban.get("until_unix")
        when = time.strftime("%H:%M:%S", time.localtime(until)) if until else "-"
        table.add_row(peer, str(ban.get("reason", "?")),
                      f"{when} ({ban.get('seconds_left', 0):.0f} s)", str(ban.get("count", 1)))
    return table


def _peers(st: dict[str, Any]) -> list[dict[str, Any]]:
    """The live peers in a status (the membership service's view)."""
    return (st.get("membership") or {}).get("peers", [])


def testnet_table(rows: list[dict[str, Any]], title: str, width: int | None = None,
                  churn: dict[str, Any] | None = None) -> Table:
    """One row per testnet process; `rows` come from `testnet.launcher.collect_status`.

    `churn` (testnet.churn.summary) adds a `kills` column and a caption with the counts.

    Classification runs (the sybil scenario) get accuracy, attack-success and the weight
    this node's aggregator gave to sybils in place of the partner and traffic columns.
    Partners are named by their testnet names. Below 100 columns of `width` the table drops
    its borders and the peer-id column, so that it fits an 80-column terminal."""
    compact = width is not None and width < 100
    table = (Table(title=title, title_justify="left", box=None, pad_edge=False,
                   header_style="bold underline") if compact
             else Table(title=title, title_justify="left"))
    robust = any(((r.get("status") or {}).get("training") or {}).get("val_metrics", {})
                 and "accuracy" in r["status"]["training"]["val_metrics"] for r in rows)
    names = {st["peer_id"]: r["name"] for r in rows if (st := r.get("status"))}
    sybils = {pid for pid, name in names.items() if name.startswith("sybil")}
    columns = (["node", "id", "phase", "peers", "step", "loss", "acc", "flip", "backdoor",
                "sybil weight"] if robust else
               ["node", "id", "phase", "peers", "paths", "step", "loss", "val", "partner",
                "MB out/in", "compute"])
    if compact:  # 80 columns: `node status` shows the id and each path
        columns = [c for c in columns if c not in ("id", "paths")]
        if not any(_training(r).get("val_loss") is not None for r in rows):
            # (pipeline stages: none) room for a stall and a loss's age
            columns = [c for c in columns if c != "val"]
    if any((r.get("status") or {}).get("pipeline") for r in rows):
        columns.insert(columns.index("phase") + 1, "stage")
    if churn:
        columns.insert(columns.index("phase") + 1, "kills")
        from testnet.churn import describe

        table.caption, table.caption_justify = describe(churn), "left"
    for col in columns:
        table.add_column(col, no_wrap=compact or col != "phase",  # a stall's phase is long
                         justify="left" if col in ("node", "id", "phase", "partner") else "right")
    for r in rows:
        st = r.get("status")
        if st is None:
            cells: dict[str, Any] = dict.fromkeys(columns, "-")
            cells.update(node=r["name"], phase=Text(r.get("error", "down"), "red"),
                         kills=str((churn or {}).get("per_node", {}).get(r["name"], 0)))
            table.add_row(*(cells[c] for c in columns))
            continue
        pipe = st.get("pipeline") or {}
        t = st.get("training") or pipe.get("training") or {}
        vm = t.get("val_metrics") or {}
        phase = t.get("phase") if st["phase"] == "running" and t else st["phase"]
        style = "green" if phase in ("running", "training") else phase_style(phase)
        cells = {
            "node": r["name"],
            "kills": str((churn or {}).get("per_node", {}).get(r["name"], 0)),
            "stage": _num(pipe.get("stage"), "{:d}"),
            "id": short(st["peer_id"]),
            "phase": Text((_short_phase(phase) if compact and phase else phase) or "-", style),
            "peers": "-" if st["role"] == "bootstrap" else str(len(_peers(st))),
            "paths": paths_cell(st.get("peer_paths")),
            "step": _num(t.get("step"), "{:d}"),
            "loss": loss_text(t, compact),
            "val": _num(t.get("val_loss"), "{:.3f}"),
            "partner": _partners(t.get("last_partner"), names),
            "MB out/in": _mb_pair(t.get("bytes_sent"), t.get("bytes_received")),
            "compute": _num(t.get("compute_fraction"), "{:.0%}"),
            "acc": _num(vm.get("accuracy"), "{:.1%}"),
            "flip": _num(vm.get("label_flip"), "{:.1%}"),
            "backdoor": _num(vm.get("backdoor"), "{:.1%}"),
            "sybil weight": _sybil_weight(t.get("aggregation"), sybils),
        }
        table.add_row(*(cells[c] for c in columns))
    return table


_SHORT_PHASES = {"downloading checkpoint": "download", "finding providers": "providers",
                 "syncing state": "syncing"}  # for the compact table


def _training(row: dict[str, Any]) -> dict[str, Any]:
    st = row.get("status") or {}
    return st.get("training") or (st.get("pipeline") or {}).get("training") or {}


def _partners(last: str | None, names: dict[str, str]) -> str:
    """The last round's partners ("a,b" for gossip learning) by testnet name where known."""
    if not last:
        return "-"
    return ",".join(names.get(p) or short(p) for p in last.split(","))


def _sybil_weight(aggregation: dict[str, Any] | None, sybils: set[str | None]) -> str:
    """Share of the last aggregation that came from sybils ("-" if none was aggregated)."""
    weights = (aggregation or {}).get("weights") or {}
    if not weights:
        return "-"
    return f"{sum(w for peer, w in weights.items() if peer in sybils):.1%}"


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _mb_pair(sent: int | None, received: int | None) -> str:
    return "-" if not (sent or received) else f"{(sent or 0) / 1e6:.0f}/{(received or 0) / 1e6:.0f}"


def _bytes(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.0f} TB"
