"""Console helpers shared by the CLI modules."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import typer
from rich.console import Console

from node.errors import NodeError

err = Console(stderr=True)
out = Console()


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    return typer.Exit(code)


def run_async(main: Callable[[], Awaitable[None]]) -> None:
    """trio.run with the errors a user sees turned into messages, not tracebacks."""
    try:
        trio.run(main)
    except* KeyboardInterrupt:
        # trio wraps Ctrl-C in an exception group; Typer would print it all.
        raise typer.Exit(130) from None
    except* NodeError as group:
        e = group.exceptions[0]
        while isinstance(e, BaseExceptionGroup):
            e = e.exceptions[0]
        raise fail(str(e), getattr(e, "exit_code", 1)) from None
