"""torch in the background: the p2p side starts while torch loads.

`import torch` costs seconds (5.6 s cold on the 2-core dev machine, more than libp2p's
2.7 s), and a joiner needs it only to train. The daemon calls `start()` as its node starts
(node/daemon.py) and torch is imported in a daemon thread while the node dials its
bootstrap peers, discovers the run and pulls the newest checkpoint; the training services
`await ready()` (a worker thread joins the import) before they touch torch. Nothing on the
trio thread may import a torch-importing module before `ready()` returns: Python's import
lock would block the event loop until the background import finishes.

The import competes with the trio thread for the GIL, so every round trip of the join
(dial, discovery, the first run-document sync) takes longer beside it, and until
2026-11-26 the import was held until the checkpoint download began (measured then at load
~9: the round trips took 1.3 s without the import, 5-20 s with it). It starts with the
node now: on a 16-core GPU machine the join waited 6.7-8.1 s for the CUDA build of torch
after its download (docs/benchmarks.md, "On a GPU"), and on the 2-core machine among 4
trainers both orders measured the same (`node bench join`: median 6.6 s from the start,
6.9 s held, loads 2-5).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import trio

_lock = threading.Lock()
_thread: threading.Thread | None = None
_done = threading.Event()
_error: BaseException | None = None
_seconds: float | None = None


def start() -> None:
    """Begin importing torch in a daemon thread (once; later calls do nothing)."""
    global _thread
    with _lock:
        if _thread is not None:
            return
        _thread = threading.Thread(target=_load, name="peertrain-torch-import", daemon=True)
        _thread.start()


def _load() -> None:
    global _error, _seconds
    began = time.perf_counter()
    # Not niced like the trainer thread: the import is on the path to the first step, and
    # a niced import took 55 s instead of ~9 s on the shared 2-core machine at load 11-17
    # (every nice-0 process of the machine ran first).
    try:
        # torch only, nothing of ours: a module of ours being imported here (waiting on
        # torch) would hold its import lock, and the trio thread importing it too
        # (node.daemon shares modules with node.averaging) would block. There is no
        # warm-up step since the trainer's AdamW is our own (node/ml/trainer/adamw.py):
        # torch.optim's imported torch._dynamo on first use, as long as torch itself.
        import torch  # noqa: F401
    except BaseException as e:  # reported by wait(): the node says why it cannot train
        _error = e
    finally:
        _seconds = time.perf_counter() - began
        _done.set()


def wait(timeout: float | None = None) -> bool:
    """Block until torch is imported (starting the import if nobody did); re-raise its
    error. False if it was still loading after `timeout` seconds."""
    start()
    if not _done.wait(timeout):
        return False
    if _error is not None:
        raise _error
    return True


async def ready() -> None:
    """`wait()` from the trio thread, in a worker thread: the event loop keeps running."""
    if not _done.is_set():
        await trio.to_thread.run_sync(wait, abandon_on_cancel=True)
    wait()


def pending() -> bool:
    """True until torch is imported (held, or loading): the trainer cannot start yet."""
    return not _done.is_set()


def statistics() -> dict[str, Any]:
    """For `node status` and the join benchmark: did the import finish, and in how long."""
    return {"started": _thread is not None, "done": _done.is_set(),
            "seconds": None if _seconds is None else round(_seconds, 3),
            "error": None if _error is None else f"{type(_error).__name__}: {_error}"}
