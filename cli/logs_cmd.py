"""`node logs [-f]`: the local node's JSON-lines log (state_dir/node.log), readable.

Each record prints as `HH:MM:SS level logger: message`, with any extra fields a record
carries (peer, reason, step, loss, ...) after it; a line that is not JSON prints as is.
`-f` keeps printing what the node appends, across a rotation (node.log is rotated at
20 MB: a new, shorter file, or another inode, is read from its start), until Ctrl-C.
`--json` prints the records as they are in the file.

A training node writes a `progress` record (step, losses) at every point of its loss
history, as often as every 2 s, so that a loss curve can be drawn from the log; read as is,
they buried every other line (40 lines: the last 80 s of progress). They are folded: one
per PROGRESS_EVERY_S is shown, the rest skipped, and `--progress` shows them all.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import StateDir, fail, out
from cli.lifecycle import EXIT_SIGINT
from node.status.logs import LOG_FILE

FOLLOW_POLL_S = 0.25  # how often `-f` looks for new lines (tail -f polls too)
MAX_LINE = 64 * 1024  # a longer line is cut: a log line is never a reason to buffer MBs

_SHOWN = ("ts", "level", "logger", "msg", "exc")
PROGRESS_EVERY_S = 60.0


class ProgressFold:
    """Keeps a `progress` record only if PROGRESS_EVERY_S have passed (by the records'
    own times) since the last one kept; every other line is kept."""

    def __init__(self, every_s: float = PROGRESS_EVERY_S) -> None:
        self.every_s = every_s
        self.last: float | None = None

    def keep(self, line: str) -> bool:
        if '"event": "progress"' not in line:  # cheap: most lines are not progress
            return True
        try:
            ts = float(json.loads(line)["ts"])
        except (ValueError, KeyError, TypeError):
            return True
        if self.last is not None and 0 <= ts - self.last < self.every_s:
            return False
        self.last = ts
        return True


def render(line: str) -> str:
    """One node.log line as a person reads it; a line that is not a record, unchanged."""
    try:
        doc: Any = json.loads(line)
        stamp = datetime.fromtimestamp(float(doc["ts"])).strftime("%H:%M:%S")
        text = f"{stamp} {doc['level']:7} {doc['logger']}: {doc['msg']}"
    except (ValueError, KeyError, TypeError, OverflowError, OSError):
        return line
    extra = " ".join(f"{k}={v}" for k, v in doc.items() if k not in _SHOWN)
    if extra:
        text += f"  [{extra}]"
    if doc.get("exc"):
        text += "\n" + str(doc["exc"])
    return text


def last_lines(path: Path, n: int, fold: ProgressFold | None = None
               ) -> tuple[list[str], int]:
    """The file's last `n` lines (of those `fold` keeps) and the offset read up to (the
    whole file is read: node.log is rotated at 20 MB)."""
    with path.open("rb") as f:
        data = f.read()
    lines = [_text(b) for b in data.splitlines()]
    if fold is not None:
        lines = [line for line in lines if fold.keep(line)]
    return lines[-n:], len(data)


def follow(path: Path, start: int, poll_s: float = FOLLOW_POLL_S) -> Iterator[str]:
    """Lines appended to `path` after byte `start`, forever (Ctrl-C ends it)."""
    f = path.open("rb")
    f.seek(start)
    inode, pending = os.fstat(f.fileno()).st_ino, b""
    try:
        while True:
            chunk = f.read(MAX_LINE)
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    yield _text(raw)
                if len(pending) > MAX_LINE:
                    yield _text(pending)
                    pending = b""
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                st = None  # mid-rotation: the new file is not there yet
            if st is not None and (st.st_ino != inode or st.st_size < f.tell()):
                f.close()  # rotated (or truncated): the new file from its start
                f = path.open("rb")
                inode, pending = os.fstat(f.fileno()).st_ino, b""
                continue
            time.sleep(poll_s)
    finally:
        f.close()


def _text(raw: bytes) -> str:
    return raw[:MAX_LINE].decode("utf-8", errors="replace")


def logs(
    state_dir: StateDir = None,
    lines: Annotated[int, typer.Option(
        "--lines", "-n", help="How many of the last lines to print.")] = 40,
    follow_: Annotated[bool, typer.Option(
        "--follow", "-f", help="Keep printing new lines until Ctrl-C.")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="The records as they are in node.log (JSON lines).")] = False,
    progress: Annotated[bool, typer.Option(
        "--progress", help="Every progress record (default: one a minute).")] = False,
) -> None:
    """Print the local node's log (node.log), readable; -f follows it."""
    from node.config import default_state_dir

    if lines < 1:
        raise fail(f"--lines {lines}: expected at least 1", 2)
    path = (state_dir or default_state_dir()) / LOG_FILE
    fold = None if progress else ProgressFold()
    try:
        tail, size = last_lines(path, lines, fold)
    except FileNotFoundError:
        raise fail(f"no log at {path}: no node has run with that state directory") from None
    except OSError as e:
        raise fail(f"cannot read {path}: {e.strerror or e}") from None
    show = (lambda line: line) if as_json else render
    for line in tail:
        out.print(show(line), highlight=False, markup=False)
    if follow_:
        try:
            for line in follow(path, size):
                if fold is None or fold.keep(line):
                    out.print(show(line), highlight=False, markup=False)
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_SIGINT) from None
