"""Writing benchmark results into docs/benchmarks.md, one marked section per benchmark."""

from __future__ import annotations

import os
import platform
import re
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is rewritten by the command named in it.\n"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:  # a GPU machine running one bench without the node's deps
        return "(not installed)"


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    libs = ", ".join(f"{p} {_version(p)}" for p in ("libp2p", "trio", "torch"))
    return (f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores ({cpu}), "
            f"Python {platform.python_version()}, {libs}")


def pyplot() -> Any | None:
    """matplotlib.pyplot drawing to files (Agg), or None when matplotlib (the `bench`
    extra) is not installed: a benchmark then writes its table and says there is no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace the block between `<!-- bench:NAME:start/end -->`, or append it."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = doc.read_text() if doc.exists() else HEADER
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else \
        text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def print_tables(console: Console, tables: list[tuple[str, list[str], list[list[str]]]]) -> None:
    """Show (title, headers, rows) tables on the terminal: first column left, numbers right."""
    from rich.table import Table

    for title, headers, rows in tables:
        table = Table(title=title)
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
