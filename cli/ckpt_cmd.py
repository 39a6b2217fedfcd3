"""`node ckpt ls|verify|pull`: the checkpoints in a node's state directory."""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from cli.common import Json, StateDir, err, fail, out, print_json, run_async
from node.checkpoints.store import CheckpointError, CheckpointStore
from node.config import default_state_dir
from node.errors import NodeError

app = typer.Typer(no_args_is_help=True, help="List, verify and pull checkpoints.")


@app.command("ls")
def ls(state_dir: StateDir = None,
       run: Annotated[str | None, typer.Option(help="Only this run.")] = None,
       as_json: Json = False) -> None:
    """Checkpoints held here: id, run, step, size, age."""
    store = CheckpointStore(state_dir or default_state_dir())
    if as_json:
        print_json({"store": str(store.root), "checkpoints": [
            {"cid": cid, "run": m.run, "step": m.step, "bytes": m.size,
             "chunks": len(m.chunks), "created_ms": m.created_ms}
            for cid, m in store.list(run)]})
        return
    table = Table(title=f"checkpoints in {store.root}", title_justify="left")
    for col in ("checkpoint", "run", "step", "MB", "age"):
        table.add_column(col)
    now = time.time() * 1000
    for cid, m in store.list(run):
        table.add_row(cid, f"…{m.run[-8:]}", str(m.step), f"{m.size / 1e6:.1f}",
                      f"{(now - m.created_ms) / 1000:.0f} s")
    out.print(table)


@app.command()
def verify(cid: Annotated[str, typer.Argument(help="Checkpoint id (from `node ckpt ls`).")],
           state_dir: StateDir = None, as_json: Json = False) -> None:
    """Check every chunk of a checkpoint against its hash."""
    from node.checkpoints.fetch import validate_cid

    try:
        validate_cid(cid)
    except NodeError as e:
        raise fail(str(e), 2) from None
    store = CheckpointStore(state_dir or default_state_dir())
    try:
        problems = store.verify(cid)
    except CheckpointError as e:
        raise fail(str(e), 8) from None
    except OSError as e:
        raise fail(f"cannot read checkpoint {cid}: {e.strerror or e}", 8) from None
    if problems:
        raise fail(f"checkpoint {cid} is damaged:\n  " + "\n  ".join(problems), 8)
    m = store.manifest(cid)
    if as_json:
        print_json({"cid": cid, "run": m.run, "step": m.step, "bytes": m.size,
                    "chunks": len(m.chunks), "verified": True})
        return
    out.print(f"checkpoint {cid}: step {m.step}, {len(m.chunks)} chunks, all verified",
              markup=False, highlight=False)


@app.command()
def pull(
    cid: Annotated[str, typer.Argument(help="Checkpoint id (from `node ckpt ls` on a holder).")],
    from_: Annotated[list[str] | None, typer.Option(
        "--from", "-f", help="Multiaddr of a peer holding it (repeatable); all are used at "
                             "once.")] = None,
    bootstrap: Annotated[list[str] | None, typer.Option(
        "--bootstrap", "-b", help="Multiaddr of a peer to enter the DHT through: its "
                                  "providers of the checkpoint are used too (repeatable).")]
    = None,
    state_dir: StateDir = None,
    run: Annotated[str | None, typer.Option(
        help="Refuse the checkpoint unless it belongs to this run-id.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a dial or a chunk.")]
    = 30.0,
    as_json: Json = False,
) -> None:
    """Download a checkpoint from its providers in parallel, verify it, store it here."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from cli.checks import positive_seconds
    from node.checkpoints.fetch import FetchReport, fetch, validate_cid
    from protocols import checkpoint as ck
    from protocols import manifest as mf

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # we report failures ourselves
    positive_seconds("--timeout", timeout)
    try:
        validate_cid(cid)
    except NodeError as e:
        raise fail(str(e), 2) from None
    if run is not None:
        try:
            run = mf.validate_run_id(run)
        except mf.ManifestError as e:
            raise fail(f"--run: {e}", 2) from None
    store = CheckpointStore(state_dir or default_state_dir())
    bar = Progress(TextColumn("pulling {task.fields[what]}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), console=err, transient=True, disable=as_json)
    task = bar.add_task("pull", total=None, what=f"…{cid[-8:]}")
    reports: list[FetchReport] = []

    def progress(done: int, total: int, manifest: ck.CheckpointManifest | None) -> None:
        if manifest is not None:
            size = manifest.size
            bar.update(task, total=size, completed=min(size, done * manifest.chunk),
                       what=f"…{cid[-8:]} (step {manifest.step})")

    async def main() -> None:
        reports.append(await fetch(cid, store, peers=list(from_ or []),
                                   bootstrap=list(bootstrap or []), run=run,
                                   dial_timeout=min(timeout, 10.0), chunk_timeout=timeout,
                                   progress=progress))

    with bar:
        run_async(main)
    r = reports[0]
    m, res = r.manifest, r.result
    providers = {p: {"bytes": n, "chunks": res.chunks_by_peer.get(p, 0),
                     "path": res.paths.get(p, "stream")}
                 for p, n in sorted(res.bytes_by_peer.items())} if res else {}
    if as_json:
        print(json.dumps({
            "cid": r.cid, "run": m.run, "step": m.step, "size": m.size,
            "chunks": len(m.chunks), "already_held": r.already_held,
            "fetched_bytes": res.fetched_bytes if res else 0,
            "chunks_local": res.chunks_local if res else len(m.chunks),
            "seconds": round(res.seconds, 3) if res else 0.0, "mb_s": round(r.mb_s, 1),
            "providers": providers, "dropped": res.failures if res else {},
            "unreachable": r.unreachable, "dht_providers": r.dht_providers,
            "store": str(store.root)}))
        return
    for addr, why in r.unreachable.items():
        err.print(Text.assemble(("warning:", "yellow"), f" could not reach {addr}: {why}"),
                  highlight=False, soft_wrap=True)
    head = f"checkpoint {r.cid}: run {m.run}, step {m.step}, {m.size / 1e6:.1f} MB"
    if r.already_held or res is None:
        out.print(f"{head}, already here and verified ({store.root})", highlight=False,
                  markup=False)
        return
    out.print(f"{head}, {len(m.chunks)} chunks, all verified", highlight=False, markup=False)
    local = f" ({res.chunks_local} chunks were already here)" if res.chunks_local else ""
    out.print(f"downloaded {res.fetched_bytes / 1e6:.1f} MB in {res.seconds:.2f} s: "
              f"{r.mb_s:.1f} MB/s from {len(providers)} provider"
              f"{'' if len(providers) == 1 else 's'}{local}", highlight=False)
    table = Table(box=None, show_header=True, pad_edge=False)
    for col in ("provider", "MB", "chunks", ""):
        table.add_column(col)
    for peer in sorted(set(providers) | set(res.failures)):
        p = providers.get(peer, {"bytes": 0, "chunks": 0})
        table.add_row(peer, f"{p['bytes'] / 1e6:.1f}", str(p["chunks"]),
                      f"dropped: {res.failures[peer]}" if peer in res.failures else "")
    out.print(table)
    out.print(f"stored in {store.root}", highlight=False, markup=False)
