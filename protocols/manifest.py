"""Run manifests (TOML) and run-ids.

A run is defined by its manifest: model, data, algorithms and their hyperparameters, admin
keys, bootstrap addresses. The manifest is validated (unknown keys refused, every error
naming its field), defaults are filled in, and the result is serialized canonically:

    canonical = JSON(sort_keys, no whitespace, UTF-8) of the validated manifest
    run-id    = base58btc(multihash sha2-256(canonical))        -> "Qm..." (46 chars)

So comments, key order and formatting of the TOML do not change the run-id; any semantic
change does. A joiner fetches canonical bytes from any peer and checks they hash to the
run-id it asked for (`parse_canonical`), so nobody can feed it another run.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import base58
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SCHEMA = 1
MAX_MANIFEST_BYTES = 64 * 1024
_MULTIHASH_SHA256 = b"\x12\x20"
_BASE58 = re.compile(r"^[1-9A-HJ-NP-Za-km-z]+$")


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the source, field and reason."""


class ManifestMismatch(ManifestError):
    """Bytes that do not hash to the run-id they were fetched for."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


PosInt = Annotated[int, Field(ge=1)]


class RunSection(_Section):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    description: Annotated[str, Field(max_length=2000)] = ""
    seed: Annotated[int, Field(ge=0, lt=2**63)] = 0


class ModelSection(_Section):
    task: Literal["bytes-gpt", "digits-mlp"] = "bytes-gpt"
    factory: Annotated[str, Field(
        pattern=r"^$|^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$", max_length=256)] = ""
    d_model: Annotated[int, Field(ge=1, le=16384)] = 128
    n_layers: Annotated[int, Field(ge=1, le=512)] = 4
    n_heads: Annotated[int, Field(ge=1, le=1024)] = 4
    context: Annotated[int, Field(ge=1, le=65536)] = 128

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of "
                             f"n_heads ({self.n_heads})")
        return self


class DataSection(_Section):
    source: Literal["stdlib", "digits", "files"] = "stdlib"
    paths: Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]],
                     Field(max_length=1024)] = []
    format: Literal["text", "jsonl"] = "text"
    jsonl_field: Annotated[str, Field(min_length=1, max_length=128)] = "text"
    val_fraction: Annotated[float, Field(gt=0, lt=0.5)] = 0.05

    @model_validator(mode="after")
    def _paths_for_files(self) -> DataSection:
        if self.source == "files" and not self.paths:
            raise ValueError('source = "files" needs a non-empty paths list')
        return self


class TrainSection(_Section):
    batch_size: Annotated[int, Field(ge=1, le=65536)] = 16
    lr: Annotated[float, Field(gt=0, le=1)] = 2e-3
    warmup_steps: Annotated[int, Field(ge=0, lt=2**31)] = 50
    total_steps: Annotated[int, Field(ge=1, lt=2**40)] = 100_000
    weight_decay: Annotated[float, Field(ge=0, le=10)] = 0.1
    grad_clip: Annotated[float, Field(ge=0, le=1e6)] = 1.0
    eval_every: Annotated[int, Field(ge=1, lt=2**31)] = 50
    eval_batches: Annotated[int, Field(ge=1, le=10_000)] = 4
    threads: Annotated[int, Field(ge=1, le=1024)] = 1


class OuterSection(_Section):
    algorithm: Literal["noloco", "diloco", "none"] = "noloco"
    inner_steps: Annotated[int, Field(ge=1, lt=2**31)] = 50
    outer_lr: Annotated[float, Field(gt=0, le=10)] = 0.7
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.5
    nesterov: bool = False
    group_size: Annotated[int, Field(ge=2, le=1024)] = 2
    codec: Literal["fp32", "bf16", "int8"] = "bf16"


class AggregateSection(_Section):
    method: Literal["mean", "vc", "sybilwall", "median", "krum", "foolsgold"] = "mean"
    neighbours: Annotated[int, Field(ge=1, le=1024)] = 1


class CheckpointSection(_Section):
    every_steps: Annotated[int, Field(ge=1, lt=2**31)] = 500
    keep: Annotated[int, Field(ge=1, le=1000)] = 3


class NetworkSection(_Section):
    bootstrap: Annotated[list[str], Field(max_length=64)] = []
    admins: Annotated[list[str], Field(max_length=64)] = []

    @field_validator("bootstrap")
    @classmethod
    def _multiaddrs(cls, addrs: list[str]) -> list[str]:
        for a in addrs:
            if not a.startswith("/") or "/p2p/" not in a or len(a) > 512:
                raise ValueError(f"{a!r} is not a peer multiaddr (/ip4/.../tcp/.../p2p/<id>)")
        return addrs

    @field_validator("admins")
    @classmethod
    def _peer_ids(cls, ids: list[str]) -> list[str]:
        for p in ids:
            if not (46 <= len(p) <= 60 and _BASE58.match(p)):
                raise ValueError(f"{p!r} is not a libp2p peer id")
        return ids


class Manifest(_Section):
    schema_: Annotated[int, Field(alias="schema")] = SCHEMA
    run: RunSection
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    outer: OuterSection = OuterSection()
    aggregate: AggregateSection = AggregateSection()
    checkpoint: CheckpointSection = CheckpointSection()
    network: NetworkSection = NetworkSection()

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


def _explain(e: ValidationError, source: str) -> ManifestError:
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"] if p != "schema_") or "(root)"
        if err["loc"] and err["loc"][-1] == "schema_":
            path = "schema"
        kind, msg = err["type"], err["msg"]
        if kind == "extra_forbidden":
            parent = ".".join(str(p) for p in err["loc"][:-1]) or "the top level"
            msg = f"unknown field {err['loc'][-1]!r} in {parent}"
            path = ".".join(str(p) for p in err["loc"])
        elif kind == "missing":
            msg = "is required"
        else:
            msg = msg.removeprefix("Value error, ")
            if "input" in err and not isinstance(err["input"], dict | list):
                msg = f"{msg} (got {err['input']!r})"
        lines.append(f"{source}: {path}: {msg}")
    return ManifestError("\n".join(lines))


def _validate(doc: Any, source: str) -> Manifest:
    if not isinstance(doc, dict):
        raise ManifestError(f"{source}: a manifest is a table of sections")
    schema = doc.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise ManifestError(f"{source}: unsupported manifest schema {schema!r} "
                            f"(this peertrain reads {SCHEMA})")
    try:
        return Manifest.model_validate(doc)
    except ValidationError as e:
        raise _explain(e, source) from None


def parse_manifest(text: str | bytes, source: str = "<manifest>") -> Manifest:
    """Parse and validate a TOML manifest."""
    if isinstance(text, bytes):
        if len(text) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{source}: {len(text)} bytes; a manifest is at most "
                                f"{MAX_MANIFEST_BYTES}")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ManifestError(
                f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if len(text.encode("utf-8")) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{source}: a manifest is at most {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{source}: invalid TOML: {e}") from None
    return _validate(doc, source)


def load_manifest_file(path: str | Path) -> Manifest:
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    return parse_manifest(data, source=path.name)


def canonical_bytes(manifest: Manifest) -> bytes:
    doc = manifest.model_dump(mode="json", by_alias=True)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def run_id(canonical: bytes) -> str:
    return base58.b58encode(_MULTIHASH_SHA256 + hashlib.sha256(canonical).digest()).decode()


def validate_run_id(s: str) -> str:
    """Check a user-typed run-id is well formed; return it."""
    if not isinstance(s, str) or len(s) != 46 or not _BASE58.match(s):
        raise ManifestError(f"not a peertrain run-id: {s!r:.60} (expected 46 base58 characters,"
                            " as printed by `node run create`)")
    raw = base58.b58decode(s)
    if len(raw) != 34 or raw[:2] != _MULTIHASH_SHA256:
        raise ManifestError(f"not a peertrain run-id: {s!r} is not a sha2-256 multihash")
    return s


def parse_canonical(data: bytes, expected_run_id: str | None = None) -> Manifest:
    """Verify and parse manifest bytes fetched from a peer."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    if expected_run_id is not None:
        got = run_id(data)
        if got != expected_run_id:
            raise ManifestMismatch(f"manifest hashes to {got}, not to run {expected_run_id}")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ManifestError(f"manifest bytes are not canonical JSON: {e}") from None
    manifest = _validate(doc, "manifest")
    if canonical_bytes(manifest) != data:
        raise ManifestError("manifest bytes are not in canonical form")
    return manifest
