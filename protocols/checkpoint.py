"""Checkpoint manifests: content-addressed chunks under a manifest whose hash is the id.

A checkpoint is one safetensors file (model, optimizer and outer-optimizer state) cut into
chunks of CHUNK_BYTES; each chunk is named by its sha256, and the manifest lists them:

    manifest = msgpack {"v": 1, "run": run-id, "step": int, "created_ms": int,
                        "size": total bytes, "chunk": chunk bytes, "chunks": [sha256 hex],
                        "meta": {small str -> int|float|str}}
    cid      = base58btc(multihash sha2-256(manifest bytes))          ("Qm...", 46 chars)

Whoever holds the manifest can verify every chunk from any source, so chunks can come from
several peers at once and a liar is caught chunk by chunk. `decode` checks sizes before
trusting them: a manifest that lists absurd sizes, or a chunk count that does not match its
size, is refused.

A checkpoint's claim of progress (its step) is only its writer's word; `progress_refusal`
is the check a joiner makes before it believes one (docs/checkpoints.md): the candidate's
validation loss must cover a good share of what the swarm reports having gained over the
run's initial weights.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import msgpack

from protocols import multihash
from protocols.errors import RemoteProtocolError

VERSION = 1
CHUNK_BYTES = 4 << 20
MAX_CHECKPOINT_BYTES = 64 << 30
MAX_MANIFEST_BYTES = 1 << 20
#: A candidate checkpoint must have at least this share of the swarm's loss gain over the
#: initial weights. Half: a checkpoint a few intervals older than the swarm passes (the
#: loss falls fastest early, when the gap between checkpoints matters most), a model
#: trained a few steps or averaged once with the swarm does not.
MIN_GAIN_SHARE = 0.5


@dataclass(frozen=True)
class CheckpointManifest:
    run: str
    step: int
    created_ms: int
    size: int
    chunk: int
    chunks: tuple[str, ...]
    meta: dict = field(default_factory=dict)

    def encode(self) -> bytes:
        return msgpack.packb({"v": VERSION, "run": self.run, "step": self.step,
                              "created_ms": self.created_ms, "size": self.size,
                              "chunk": self.chunk, "chunks": list(self.chunks),
                              "meta": dict(sorted(self.meta.items()))})

    @property
    def cid(self) -> str:
        return cid_of(self.encode())

    def chunk_size(self, index: int) -> int:
        """Bytes in chunk `index` (the last one may be short)."""
        return min(self.chunk, self.size - index * self.chunk)


def cid_of(manifest_bytes: bytes) -> str:
    return multihash.sha256_id(manifest_bytes)


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def build(run: str, step: int, created_ms: int, data: bytes | memoryview,
          meta: dict | None = None, chunk: int = CHUNK_BYTES) -> CheckpointManifest:
    view = memoryview(data).cast("B")
    chunks = tuple(sha256_hex(view[i:i + chunk]) for i in range(0, len(view), chunk))
    return CheckpointManifest(run, step, created_ms, len(view), chunk, chunks, dict(meta or {}))


def decode(data: bytes, expected_cid: str | None = None) -> CheckpointManifest:
    """Verify and parse manifest bytes; RemoteProtocolError says what is wrong."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise RemoteProtocolError(f"checkpoint manifest of {len(data)} bytes is too large")
    if expected_cid is not None and cid_of(data) != expected_cid:
        raise RemoteProtocolError(f"manifest hashes to {cid_of(data)}, not {expected_cid}")
    try:
        doc = msgpack.unpackb(data, max_str_len=1 << 16, max_bin_len=0,
                              max_array_len=MAX_CHECKPOINT_BYTES // (1 << 16),
                              max_map_len=64)
    except Exception as e:
        raise RemoteProtocolError(f"checkpoint manifest is not msgpack: {e}") from e
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise RemoteProtocolError("checkpoint manifest of an unknown version")
    try:
        run, step, created, size, chunk, chunks, meta = (
            doc["run"], doc["step"], doc["created_ms"], doc["size"], doc["chunk"],
            doc["chunks"], doc["meta"])
    except KeyError as e:
        raise RemoteProtocolError(f"checkpoint manifest lacks {e}") from None
    ints = (step, created, size, chunk)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints):
        raise RemoteProtocolError("checkpoint step, time and sizes must be non-negative ints")
    if not 0 < size <= MAX_CHECKPOINT_BYTES or not (1 << 16) <= chunk <= (64 << 20):
        raise RemoteProtocolError(f"absurd checkpoint sizes: {size} bytes in chunks of {chunk}")
    if not isinstance(chunks, list) or len(chunks) != -(-size // chunk):
        raise RemoteProtocolError(f"{size} bytes need {-(-size // chunk)} chunks of {chunk}")
    if not all(isinstance(c, str) and len(c) == 64 for c in chunks):
        raise RemoteProtocolError("chunk names must be sha256 hex")
    if not isinstance(run, str) or not isinstance(meta, dict):
        raise RemoteProtocolError("checkpoint run must be a str and meta a map")
    return CheckpointManifest(run, step, created, size, chunk, tuple(chunks), meta)


def progress_refusal(candidate: float, initial: float, swarm: float,
                     share: float = MIN_GAIN_SHARE) -> str | None:
    """Why a checkpoint whose validation loss is `candidate` is not the swarm's progress,
    or None when it is. `initial` is the loss of the run's initial weights (every node
    draws the same from the seed) and `swarm` the loss the live peers report, all on the
    same validation batches. A swarm that has gained nothing over the initial weights yet
    (`initial - swarm` <= 0) leaves nothing to check: any finite candidate passes."""
    if not math.isfinite(candidate):
        return f"its validation loss is {candidate}"
    gain = initial - swarm
    if not (math.isfinite(gain) and gain > 0):
        return None
    limit = swarm + (1 - share) * gain
    if candidate <= limit:
        return None
    return (f"its validation loss {candidate:.3f} is above {limit:.3f}: the swarm reports "
            f"{swarm:.3f} and the run's initial weights score {initial:.3f}, so it has "
            f"{max(0.0, initial - candidate) / gain:.0%} of the swarm's progress "
            f"(at least {share:.0%} needed)")
