"""Files that survive a crash: every write of state goes through `atomic_write`."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Temp file, fsync, rename: a crash leaves the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or a kill leaves the old file, and no temp file
        tmp.unlink(missing_ok=True)
        raise
