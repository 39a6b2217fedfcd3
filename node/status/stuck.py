"""A node that does not stop within its grace period says what it waits on, then exits.

Seen: one Ctrl-C of a training node hung for over 90 s with nothing in the log. A stop
cancels every task; whatever outlives the cancellation is shielded (a bounded cleanup that
is not bounded), inside a worker thread that cannot be abandoned, or in the trainer's
step. When the control service is cancelled (the node is stopping) it arms this watchdog,
a plain thread: if the node's task has not ended after GRACE_S, it logs every thread's
stack and trio's task tree (each task's innermost await), then ends the process with
os._exit(EXIT_STUCK), flushed. A stop that ends in time never sees it.

The task tree is read from the watchdog thread while the trio thread is stuck: the
objects are only read (task names, coroutine frames), under the GIL; it is a diagnostic
taken once, right before the process ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback
from types import FrameType
from typing import Any

log = logging.getLogger("node")

GRACE_S = 45.0  # the trainer's join (30 s, node/training/service.py) and the rest's cleanup
EXIT_STUCK = 75  # EX_TEMPFAIL: the stop was asked for and did not finish by itself


def thread_stacks() -> list[str]:
    """Every thread's Python stack, innermost call last, headed by the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watchdog itself
        stack = "".join(traceback.format_stack(frame, limit=12)).rstrip()
        out.append(f"thread {names.get(ident, ident)}:\n{stack}")
    return out


def _innermost(coro: Any) -> list[str]:
    """Where a coroutine is suspended: file:line function, outermost first."""
    where = []
    for _ in range(64):
        frame: FrameType | None = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if coro is None:
            break
    return where


def task_tree(root: Any) -> list[str]:
    """trio's tasks below `root`, each with where it waits (its innermost await)."""
    lines: list[str] = []

    def walk(task: Any, depth: int) -> None:
        if len(lines) > 400:
            return
        where = _innermost(task.coro)
        ours = [w for w in where if f"{os.sep}trio{os.sep}" not in w] or where  # not trio's
        lines.append(f"{'  ' * depth}{task.name}: {ours[-1] if ours else '(running)'}")
        for nursery in list(task.child_nurseries):
            for child in list(nursery.child_tasks):
                walk(child, depth + 1)

    with contextlib.suppress(Exception):  # a tree changing under us: what we have
        walk(root, 0)
    return lines


def finished(task: Any) -> bool:
    """True once `task`'s coroutine has returned (or raised)."""
    return getattr(task.coro, "cr_frame", None) is None


class StopWatchdog:
    """Armed once the node is stopping; fires unless `owner` (the task running the node)
    ends first. Watching the node's task, not the process: a test runs nodes inside a
    process that goes on after they stop."""

    def __init__(self, owner: Any, grace_s: float = GRACE_S, exit: Any = os._exit) -> None:
        self.owner = owner
        self.grace_s = grace_s
        self._exit = exit
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="stop-watchdog",
                                            daemon=True)
            self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _watch(self) -> None:
        stopped = threading.Event()  # never set: a sleep that polls the node's task
        waited = 0.0
        while waited < self.grace_s:
            if finished(self.owner):
                return
            step = min(0.25, self.grace_s - waited)
            stopped.wait(step)
            waited += step
        if finished(self.owner):
            return
        report = (f"the node did not stop within {self.grace_s:g} s of being asked; it waits "
                  "on:\n" + "\n".join(task_tree(self.owner))
                  + "\n" + "\n".join(thread_stacks()))
        log.error("%s\nexiting now (exit %d)", report, EXIT_STUCK)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        with contextlib.suppress(OSError, ValueError):
            print(report, file=sys.stderr, flush=True)
        self._exit(EXIT_STUCK)
