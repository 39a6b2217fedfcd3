"""One testnet command at a time per testnet directory: an flock on `<dir>/testnet.lock`.

Why: `up`, `down`, `kill-stage`, `add-node`, a restart by the churn driver each read
testnet.json, start or stop processes, and write it back. Two at once lose an update: two
`kill-stage` commands both named their replacement node5, the second failed on node5's
state-dir lock, and testnet.json kept its dead pid, so `status` showed the live node as
exited and `down` left it running. Under the lock a command reads testnet.json afresh,
acts, and writes it back before the next one reads it.

The lock is reentrant within a process (`up` calls `down` when it fails; the churn driver's
restart runs inside its own loop), and the kernel drops it when the holder exits, however
it exits. The file keeps the holder's pid and command, to name them to a waiter.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK_FILE = "testnet.lock"
WAIT_S = 900.0  # longer than any one command (`up` of a large pipeline, a kill-stage)

_held: dict[str, tuple[int, int]] = {}  # resolved dir -> (fd, depth), this process
_guard = threading.RLock()


class DirLocked(Exception):
    """Another testnet command held the directory for longer than the wait."""


@contextlib.contextmanager
def locked(directory: Path, *, wait_s: float = WAIT_S,
           on_wait: Callable[[str], None] = lambda msg: None) -> Iterator[None]:
    """Hold the testnet directory's lock for the block; waits up to `wait_s` for another
    command to finish (`on_wait` is told once, naming it)."""
    key = str(Path(directory).resolve())
    with _guard:
        if key in _held:
            fd, depth = _held[key]
            _held[key] = (fd, depth + 1)
            try:
                yield
            finally:
                _release(key)
            return
        Path(key).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(key) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _acquire(fd, key, wait_s, on_wait)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {' '.join(sys.argv[1:])[:200]}\n".encode(), 0)
        _held[key] = (fd, 1)
        try:
            yield
        finally:
            _release(key)


def _acquire(fd: int, key: str, wait_s: float, on_wait: Callable[[str], None]) -> None:
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        holder = holder_of(fd)
        if not told:
            on_wait(f"waiting for another testnet command in {key} ({holder})")
            told = True
        if time.monotonic() >= deadline:
            raise DirLocked(f"another testnet command holds {key} ({holder}) for over "
                            f"{wait_s:g} s; wait for it or stop it")
        time.sleep(0.1)


def holder_of(fd: int) -> str:
    text = os.pread(fd, 256, 0).decode(errors="replace").strip()
    pid, _, cmd = text.partition(" ")
    return f"pid {pid}: {cmd or 'a testnet command'}" if pid else "pid unknown"


def _release(key: str) -> None:
    fd, depth = _held[key]
    if depth > 1:
        _held[key] = (fd, depth - 1)
        return
    del _held[key]
    os.close(fd)  # closing drops the flock
