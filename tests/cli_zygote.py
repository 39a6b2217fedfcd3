"""A CLI process that forks one child per command: `node ...` without paying the imports.

The suite runs ~80 short CLI commands that are refused or answered before any node starts
(a bad flag value, `--help`, `config show`). As fresh `python -m cli` processes each costs
about a second of interpreter start and imports on a 2-core machine; forked from this
process, which has imported the CLI once, each costs milliseconds. Each command still runs
in a process of its own, with its own exit status, stdout and stderr, exactly as
`python -m cli` would run it (cli/__main__.py: `app(prog_name="node")`).

Protocol (tests/conftest.py's `cli`): one JSON request per line on stdin,
{"argv": [...], "cwd": "...", "timeout": seconds}; one JSON answer per line on stdout,
{"code": int, "stdout": str, "stderr": str}. A child still running at its timeout is
killed and answers code -9.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time

import node.daemon  # noqa: F401  # what `join` and `bootstrap` import before checking flags
from cli.main import app


def child(argv: list[str], cwd: str, out: int, err: int) -> None:
    """Runs in the forked child and never returns."""
    code = 70
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(cwd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        app(args=argv, prog_name="node")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def run(argv: list[str], cwd: str, timeout: float) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            child(argv, cwd, out.fileno(), err.fileno())
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.005)  # polling a child's exit, not synchronizing a test
        code = os.waitstatus_to_exitcode(status)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", "replace"))
    return {"code": code, "stdout": texts[0], "stderr": texts[1]}


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        answer = run(req["argv"], req["cwd"], req["timeout"])
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
