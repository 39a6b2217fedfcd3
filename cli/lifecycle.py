"""How a node process ends: exit codes for the signals that stop it, and a last guard.

Exit codes (docs/operator.md): SIGINT (Ctrl-C) exits 130, the shell's convention; SIGTERM
is a requested, orderly stop (`node testnet down`, systemd, docker stop) and exits 0, which
service managers count as a clean stop.

The guard: the trainer thread is joined before trio.run returns (node/training/service.py). If it
is still alive anyway (a second Ctrl-C interrupted the wait, or a step outran the join
deadline), letting the interpreter finalize would abort the process: a daemon thread that
re-takes the GIL during finalization is unwound by pthread_exit, and the unwind through
torch's C++ frames ends in std::terminate ("terminate called without an active exception",
exit 134). Then the process flushes its logs and leaves with os._exit instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

TRAINER_THREAD = "peertrain-trainer"  # the name node/training/service.py gives its thread

EXIT_SIGINT = 130
EXIT_SIGTERM = 0


def exit_code_for(stop_signal: int | None) -> int:
    if stop_signal == signal.SIGINT:
        return EXIT_SIGINT
    return EXIT_SIGTERM if stop_signal == signal.SIGTERM else 0


def leave_safely_if_threads_alive(code: int) -> None:
    """os._exit(code) after flushing, if a thread that may be inside torch is still alive."""
    alive = [t for t in threading.enumerate() if t.name == TRAINER_THREAD and t.is_alive()]
    if not alive:
        return
    logging.getLogger("node").warning("the trainer thread is still running; exiting without "
                                      "waiting for it (the last checkpoint on disk is whole)")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
