"""The trainer thread: torch's work in a thread of its own, started and stopped from trio.

Both kinds of training run their steps this way: data-parallel (node/training/service.py)
and a pipeline stage (node/pipe/stage_thread.py). A step holds the GIL for milliseconds at
a time and must never block the event loop that answers heartbeats and streams, and a
stopping node must wait for the step under way rather than tear the interpreter down
beneath it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import trio

log = logging.getLogger("node.training")

JOIN_TIMEOUT_S = 30.0  # a stop waits this long for the trainer's current step


async def run_trainer_thread(target: Callable[[], None], stop: threading.Event, name: str,
                             join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Run `target` in a daemon thread named `name` until it returns; raise what it raised.

    However this ends (the target returns or fails, or the caller is cancelled), `stop` is
    set, which the target must watch between steps, and the thread is joined for at most
    `join_timeout_s`, shielded: unshielded, a cancel (SIGINT/SIGTERM) raised at once and the
    interpreter tore down under a daemon thread still inside torch, which aborted the
    process ("terminate called without an active exception", exit 134)."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    failure: list[BaseException] = []

    def main() -> None:
        try:
            target()
        except BaseException as e:  # re-raised in the trio task below
            failure.append(e)
        finally:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(done.set, trio_token=token)

    thread = threading.Thread(target=main, daemon=True, name=name)
    thread.start()
    try:
        await done.wait()
    finally:
        stop.set()
        with trio.move_on_after(join_timeout_s) as waited:
            waited.shield = True
            await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
        if thread.is_alive():
            log.error("the trainer thread %s did not stop within %g s", name, join_timeout_s)
    if failure:
        raise failure[0]
