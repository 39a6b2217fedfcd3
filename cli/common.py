"""Console helpers shared by the CLI modules."""

from __future__ import annotations

import os
import sys
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

TRACEBACK_ENV = "PEERTRAIN_TRACEBACK"
EXIT_BUG = 70  # EX_SOFTWARE

err = Console(stderr=True)
out = Console()


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
