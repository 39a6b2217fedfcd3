"""Manifests this node holds, as canonical bytes in `state_dir/runs/<run-id>.json`.

A node serves every manifest in its store over `/peertrain/manifest/1.0.0`; the file name is
the run-id and the content hashes to it, so a corrupt or swapped file is detected on load.
"""

from __future__ import annotations

from pathlib import Path

from node.files import atomic_write
from protocols import manifest as mf


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
