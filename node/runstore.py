"""Manifests this node holds, as canonical bytes in `state_dir/runs/<run-id>.json`.

A node serves every manifest in its store over `/peertrain/manifest/1.0.0`; the file name is
the run-id and the content hashes to it, so a corrupt or swapped file is detected on load.
"""

from __future__ import annotations

import os
from pathlib import Path

from protocols import manifest as mf


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


class RunStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir) / "runs"

    def put(self, canonical: bytes) -> str:
        run_id = mf.run_id(canonical)
        atomic_write(self.dir / f"{run_id}.json", canonical)
        return run_id

    def get(self, run_id: str) -> bytes | None:
        path = self.dir / f"{run_id}.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if mf.run_id(data) != run_id:  # bit rot or a hand edit: never serve it
            return None
        return data

    def run_ids(self) -> list[str]:
        if not self.dir.exists():
            return []
        return sorted(p.stem for p in self.dir.glob("*.json") if self.get(p.stem) is not None)
