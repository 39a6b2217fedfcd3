"""`node ckpt ls|verify`: the checkpoints in a node's state directory."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cli.common import fail, out
from node.checkpoints import CheckpointError, CheckpointStore
from node.config import default_state_dir

app = typer.Typer(no_args_is_help=True, help="List and verify local checkpoints.")
StateDir = Annotated[Path | None, typer.Option("--state-dir", help="The node's state dir.")]


@app.command("ls")
def ls(state_dir: StateDir = None,
       run: Annotated[str | None, typer.Option(help="Only this run.")] = None) -> None:
    """Checkpoints held here: id, run, step, size, age."""
    store = CheckpointStore(state_dir or default_state_dir())
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
           state_dir: StateDir = None) -> None:
    """Check every chunk of a checkpoint against its hash."""
    store = CheckpointStore(state_dir or default_state_dir())
    try:
        problems = store.verify(cid)
    except CheckpointError as e:
        raise fail(str(e), 8) from None
    if problems:
        raise fail(f"checkpoint {cid} is damaged:\n  " + "\n  ".join(problems), 8)
    m = store.manifest(cid)
    out.print(f"checkpoint {cid}: step {m.step}, {len(m.chunks)} chunks, all verified")
