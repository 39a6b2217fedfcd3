"""Console helpers shared by the CLI modules."""

from __future__ import annotations

import typer
from rich.console import Console

err = Console(stderr=True)
out = Console()


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    return typer.Exit(code)
