"""One node per state directory: an exclusive flock on `state_dir/node.lock`.

Taken before anything in the directory is written (the log, addrs.json, control.json, the
identity) and held for the life of the process; the kernel drops it when the process
exits, however it exits, so a node killed with -9 leaves no stale lock. The file keeps the
pid of the last holder, to name it in the refusal. It is never deleted: deleting a lock
file that another process may have just opened would let two holders in.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from node.errors import StateDirError

LOCK_FILE = "node.lock"


class StateDirInUse(StateDirError):
    """Another live process holds the state directory."""


class StateLock:
    def __init__(self, state_dir: Path, fd: int) -> None:
        self.state_dir = state_dir
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def acquire(state_dir: Path) -> StateLock:
    """Create `state_dir` if needed and lock it; raises StateDirError (exit 6) otherwise."""
    state_dir = Path(state_dir)
    if state_dir.exists() and not state_dir.is_dir():
        raise StateDirError(f"cannot use state directory {state_dir}: it is a file, "
                            "not a directory")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        # O_CLOEXEC (Python's default): children of the node do not inherit the lock.
        fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise StateDirError(f"cannot use state directory {state_dir}: "
                            f"{e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _read_pid(fd)
        os.close(fd)
        if isinstance(e, BlockingIOError):
            raise StateDirInUse(
                f"cannot use state directory {state_dir}: a node is running there "
                f"(pid {holder or 'unknown'}); stop it or pass another --state-dir") from None
        raise StateDirError(f"cannot use state directory {state_dir}: cannot lock "
                            f"{LOCK_FILE}: {e.strerror or e}") from None
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateLock(state_dir, fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None
