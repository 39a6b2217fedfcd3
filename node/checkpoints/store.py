"""The local checkpoint store: safetensors bytes in content-addressed chunks, atomically.

    state_dir/checkpoints/chunks/<sha256>        chunk files
    state_dir/checkpoints/manifests/<cid>        manifest bytes (protocols/checkpoint.py)

Every file is written to a temp name, fsynced and renamed, and the manifest is written
last: a process killed in the middle of a save (or a full disk) leaves at most orphan
chunks, never a manifest that points at missing or partial data, so `latest()` only ever
returns complete checkpoints. Loads verify every chunk's hash before anything is parsed.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from node.errors import NodeError
from node.files import atomic_write
from protocols import checkpoint as ck
from protocols.errors import RemoteProtocolError

log = logging.getLogger("node.checkpoints")


class CheckpointError(NodeError):
    exit_code = 8


class CheckpointStore:
    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "checkpoints"
        self.chunks = self.root / "chunks"
        self.manifests = self.root / "manifests"
        # Chunks this process fetched and verified (`put_chunk`), not hashed again when
        # loaded: a joiner loads the 128 MB it has just pulled on its way to its first step.
        # A load takes them out; retention forgets the dropped ones.
        self._verified: set[str] = set()

    # -- writing ------------------------------------------------------------------------

    def save(self, run: str, step: int, tensors: dict, meta: dict | None = None) -> str:
        """Write a checkpoint of `tensors` (name -> torch tensor); returns its cid."""
        from safetensors.torch import save

        data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
        manifest = ck.build(run, step, time.time_ns() // 1_000_000, data, meta)
        try:
            self.chunks.mkdir(parents=True, exist_ok=True)
            self.manifests.mkdir(parents=True, exist_ok=True)
            view = memoryview(data)
            for i, digest in enumerate(manifest.chunks):
                path = self.chunks / digest
                if not path.exists():
                    atomic_write(path, view[i * manifest.chunk:(i + 1) * manifest.chunk])
            atomic_write(self.manifests / manifest.cid, manifest.encode())
        except OSError as e:
            raise CheckpointError(f"could not write checkpoint of step {step} to {self.root}: "
                                  f"{e.strerror or e}; earlier checkpoints are intact") from e
        return manifest.cid

    def put_chunk(self, digest: str, data: bytes | bytearray) -> None:
        """Store a chunk fetched from elsewhere, after checking it is what its name says."""
        if ck.sha256_hex(data) != digest:
            raise RemoteProtocolError(f"chunk {digest[:12]} does not match its hash")
        self.chunks.mkdir(parents=True, exist_ok=True)
        atomic_write(self.chunks / digest, data)
        self._verified.add(digest)

    def put_manifest(self, cid: str, data: bytes) -> None:
        """Store a fetched manifest (last, after its chunks: the checkpoint becomes visible)."""
        ck.decode(data, expected_cid=cid)
        self.manifests.mkdir(parents=True, exist_ok=True)
        atomic_write(self.manifests / cid, data)

    # -- reading ------------------------------------------------------------------------

    def manifest(self, cid: str) -> ck.CheckpointManifest:
        try:
            return ck.decode((self.manifests / cid).read_bytes(), expected_cid=cid)
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint {cid} in {self.root}") from None
        except RemoteProtocolError as e:
            raise CheckpointError(f"checkpoint {cid} is damaged: {e}") from e

    def latest_ok(self, cid: str) -> bool:
        """True if we hold a complete, readable manifest for `cid` (we can serve it)."""
        try:
            self.manifest(cid)
            return True
        except CheckpointError:
            return False

    def list(self, run: str | None = None) -> list[tuple[str, ck.CheckpointManifest]]:
        """(cid, manifest) of every readable checkpoint, oldest step first."""
        out = []
        for path in self.manifests.glob("Qm*") if self.manifests.exists() else []:
            try:
                m = self.manifest(path.name)
            except CheckpointError as e:
                log.warning("%s", e)
                continue
            if run is None or m.run == run:
                out.append((path.name, m))
        return sorted(out, key=lambda x: (x[1].step, x[1].created_ms))

    def latest(self, run: str) -> str | None:
        found = self.list(run)
        return found[-1][0] if found else None

    def verify(self, cid: str) -> builtins.list[str]:
        """Problems with a checkpoint (missing or corrupt chunks); empty when it is sound."""
        return [problem for _, problem in self._chunks_of(self.manifest(cid)) if problem]

    def load(self, cid: str) -> tuple[ck.CheckpointManifest, dict]:
        """The checkpoint's tensors, every chunk verified as it is read (once: a joiner
        loads 128 MB on its way to its first step; not at all when this process has just
        fetched and verified it)."""
        from safetensors.torch import load

        m = self.manifest(cid)
        parts = []
        for data, problem in self._chunks_of(m, trust_verified=True):
            if problem:
                raise CheckpointError(f"checkpoint {cid} fails verification: {problem}")
            parts.append(data)
        self._verified.difference_update(m.chunks)
        return m, load(b"".join(parts))

    def _chunks_of(self, m: ck.CheckpointManifest, trust_verified: bool = False
                   ) -> Iterator[tuple[bytes, str | None]]:
        """Each chunk's bytes and what is wrong with it (None: sound), in order."""
        for i, digest in enumerate(m.chunks):
            try:
                data = (self.chunks / digest).read_bytes()
            except FileNotFoundError:
                yield b"", f"chunk {i} ({digest[:12]}) is missing"
                continue
            sound = (trust_verified and digest in self._verified
                     and len(data) == m.chunk_size(i)) or ck.sha256_hex(data) == digest
            yield data, None if sound else f"chunk {i} ({digest[:12]}) is corrupt"

    # -- retention ----------------------------------------------------------------------

    def retain(self, run: str, keep: int) -> int:
        """Keep the newest `keep` checkpoints of `run`; drop the rest and unreferenced chunks."""
        found = self.list(run)
        for cid, _ in found[:-keep] if keep > 0 else found:
            (self.manifests / cid).unlink(missing_ok=True)
        return self._drop_unreferenced()

    def discard(self, cid: str) -> None:
        """Forget checkpoint `cid` (a joiner refused it: not resumed, not served)."""
        (self.manifests / cid).unlink(missing_ok=True)
        self._drop_unreferenced()

    def _drop_unreferenced(self) -> int:
        """Delete the chunks no manifest lists; returns how many."""
        referenced = {d for _, m in self.list() for d in m.chunks}
        self._verified &= referenced
        dropped = 0
        for path in self.chunks.glob("*") if self.chunks.exists() else []:
            if path.name not in referenced:
                path.unlink(missing_ok=True)
                dropped += 1
        return dropped
