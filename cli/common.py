"""Console helpers shared by the CLI modules.

`--json`: a command that prints data takes `--json` (the `Json` option below) and prints one
JSON document on stdout instead of text. Errors follow the flag centrally: when the
command line holds `--json`, `fail()` (every error the CLI prints goes through it, usage
errors and bugs included) writes one line on stderr, `{"error": "...", "exit_code": N}`,
with the same documented exit code (docs/operator.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import trio
import typer
import typer.core
import typer.main
from rich.console import Console
from rich.text import Text

from cli.lifecycle import EXIT_SIGINT, exit_code_for, leave_safely_if_threads_alive
from node.errors import NodeError

TRACEBACK_ENV = "PEERTRAIN_TRACEBACK"
EXIT_BUG = 70  # EX_SOFTWARE

err = Console(stderr=True, soft_wrap=True)  # a multiaddr is never broken across lines
out = Console(soft_wrap=True)

JSON_FLAG = "--json"
Json = Annotated[bool, typer.Option(
    JSON_FLAG, help="Print the result as one JSON document; an error as one JSON object "
    "on stderr.")]


class _Mode:
    json_errors = False  # set per invocation by App.__call__ from the command line


def json_errors() -> bool:
    """Whether this invocation asked for JSON (`--json` on its command line)."""
    return _Mode.json_errors


def asks_json(argv: list[str]) -> bool:
    """`--json` among the options (not after `--`, where it would be an argument)."""
    for arg in argv:
        if arg == "--":
            return False
        if arg == JSON_FLAG:
            return True
    return False


def print_json(doc: Any, indent: int | None = None) -> None:
    """A command's --json result on stdout."""
    print(json.dumps(doc, indent=indent, default=str), flush=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` to stderr and return the Exit to raise; under --json, one
    JSON object `{"error": message, "exit_code": code}` instead.

    The message is plain text, never rich markup: user input in it ("[model]", "Qm[/]")
    is printed as given. It is not wrapped either: one line stays one line.
    """
    if _Mode.json_errors:
        print(json.dumps({"error": message, "exit_code": code}), file=sys.stderr, flush=True)
    else:
        err.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True,
                  highlight=False)
    return typer.Exit(code)


StateDir = Annotated[Path | None, typer.Option(
    "--state-dir", help="The node's identity, logs and run data. Default: the user data dir.",
    show_default=False)]

# What a value is, as a person reads it in --help (typer would print <list[str]>, <bool>).
METAVARS = {
    "bootstrap": "MULTIADDR", "listen": "MULTIADDR", "announce": "MULTIADDR",
    "from": "MULTIADDR", "state_dir": "DIR", "dir": "DIR", "config": "FILE", "data": "FILE",
    "manifest": "FILE", "device": "auto|cpu|cuda[:N]", "log_level": "LEVEL",
    "neighbour": "PEER_ID", "attack": "label-flip|backdoor", "run": "RUN_ID",
}


def humane_help(command: Any) -> Any:
    """Name every value in --help for what it is: MULTIADDR, DIR, SECONDS, N instead of
    <list[str]>, <path>, <float>, <int>; arguments in capitals."""
    for param in command.params:
        if param.metavar is not None or getattr(param, "is_flag", False):
            continue
        if param.param_type_name == "argument":
            param.metavar = (param.name or "").upper()
        elif param.name in METAVARS:
            param.metavar = METAVARS[param.name]
        else:
            desc = param.type_descriptor
            kind = getattr(desc.annotation, "__name__", "")
            seconds = any(w in (param.name or "") for w in ("timeout", "duration", "interval"))
            param.metavar = ("SECONDS" if seconds else "NUMBER" if kind == "float"
                             else "N" if kind == "int" else "PATH" if desc.is_path
                             else "TEXT")
    for sub in getattr(command, "commands", {}).values():
        humane_help(sub)
    return command


def _plain_usage_name(self: Any) -> str:
    """RUN_ID, [NODE], FILE...: click's usage convention (typer 0.29 writes {RUN_ID})."""
    name = self.display_name_raw
    name = name if self.required else f"[{name}]"
    return name + ("..." if self.nargs != 1 else "")


# typer 0.29 writes arguments as {RUN_ID} in usage, <str> beside their name and <bool>
# beside every flag (--help too): small patches of its help rendering
# (tests/cli/test_cli_help.py pins what a user sees).
# Another typer (an older one was seen on a GPU machine's image) may lack these hooks: its
# help then reads a little differently, and the CLI still starts.
_option_type = getattr(typer.core.TyperOption, "display_type_rich", None)
if _option_type is not None and hasattr(typer.core.TyperArgument, "_usage_display_name"):
    typer.core.TyperArgument._usage_display_name = _plain_usage_name  # type: ignore[method-assign]
    typer.core.TyperArgument.display_type_rich = lambda self, ctx: None  # type: ignore[method-assign]
    typer.core.TyperOption.display_type_rich = (  # type: ignore[method-assign]
        lambda self, ctx: None if self.is_flag else _option_type(self, ctx))


class App(typer.Typer):
    """typer.Typer whose usage errors (a bad flag value, a missing argument) print as one
    `error:` line with exit 2, like the CLI's own errors, instead of a rich panel; its help
    names values as a person reads them (humane_help)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("standalone_mode", False)
        argv = args[0] if args else kwargs.get("args")
        _Mode.json_errors = asks_json(list(sys.argv[1:] if argv is None else argv))
        try:
            code = humane_help(typer.main.get_command(self))(*args, **kwargs)
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


class _Frames:
    """Redrawing where there is no terminal to redraw on (a pipe, a file, `| tee`): each
    view printed whole under a time line, flushed, so a reader sees every update."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def update(self, renderable: Any) -> None:
        import time

        self.console.print(f"--- {time.strftime('%H:%M:%S')}", markup=False, highlight=False)
        self.console.print(renderable)
        self.console.file.flush()


class _LiveView:
    def __init__(self, live: Any) -> None:
        self.live = live

    def update(self, renderable: Any) -> None:
        self.live.update(renderable, refresh=True)


@contextlib.contextmanager
def redrawn(console: Console, first: Any) -> Iterator[_Frames | _LiveView]:
    """A view to `update()` again and again: redrawn in place on a terminal (rich's Live),
    printed frame after frame elsewhere, where Live printed nothing until it ended."""
    if not console.is_terminal:
        frames = _Frames(console)
        frames.update(first)
        yield frames
        return
    from rich.live import Live

    with Live(first, console=console, auto_refresh=False, transient=False) as live:
        yield _LiveView(live)
