"""Console helpers shared by the CLI modules."""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import typer
from rich.console import Console
from rich.text import Text

from cli.lifecycle import EXIT_SIGINT, exit_code_for, leave_safely_if_threads_alive
from node.errors import NodeError

TRACEBACK_ENV = "PEERTRAIN_TRACEBACK"
EXIT_BUG = 70  # EX_SOFTWARE

err = Console(stderr=True, soft_wrap=True)  # a multiaddr is never broken across lines
out = Console(soft_wrap=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` to stderr and return the Exit to raise.

    The message is plain text, never rich markup: user input in it ("[model]", "Qm[/]")
    is printed as given. It is not wrapped either: one line stays one line.
    """
    err.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True,
              highlight=False)
    return typer.Exit(code)


class App(typer.Typer):
    """typer.Typer whose usage errors (a bad flag value, a missing argument) print as one
    `error:` line with exit 2, like the CLI's own errors, instead of a rich panel."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("standalone_mode", False)
        try:
            code = super().__call__(*args, **kwargs)
        except typer.TyperException as e:
            show = getattr(e, "show", None)
            if type(e).__name__ == "NoArgsIsHelpError" and show is not None:
                show()  # `node` alone, `node run`: the help text
                sys.exit(e.exit_code)
            fail(e.format_message(), e.exit_code)
            sys.exit(e.exit_code)
        except typer.Abort:
            sys.exit(130)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # a bug: one line, unless asked for the traceback
            if os.environ.get(TRACEBACK_ENV):
                raise
            fail(f"unexpected {type(e).__name__}: {e} (a bug; set {TRACEBACK_ENV}=1 to see "
                 "the traceback, and please report it)", EXIT_BUG)
            sys.exit(EXIT_BUG)
        sys.exit(code if isinstance(code, int) else 0)


def run_async(main: Callable[[], Awaitable[int | None]]) -> None:
    """trio.run with the errors a user sees turned into messages, not tracebacks.

    `main` may return the signal that stopped it (a node): SIGINT exits 130, SIGTERM 0.
    """
    code = 0
    try:
        code = exit_code_for(trio.run(main))
    except* KeyboardInterrupt:
        # trio wraps Ctrl-C in an exception group; Typer would print it all.
        code = EXIT_SIGINT
    except* NodeError as group:
        e = group.exceptions[0]
        while isinstance(e, BaseExceptionGroup):
            e = e.exceptions[0]
        code = getattr(e, "exit_code", 1)
        fail(str(e), code)
    leave_safely_if_threads_alive(code)
    if code:
        raise typer.Exit(code)
