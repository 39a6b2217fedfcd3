"""Run manifests (TOML) and run-ids.

A run is defined by its manifest: model, data, algorithms and their hyperparameters, admin
keys, bootstrap addresses (schema and defaults: docs/manifest.md). A manifest is validated
(wrong types, out-of-range values and unknown keys refused, every error naming its field),
defaults are filled in, and the result is serialized canonically:

    canonical = JSON(sort_keys, separators (",", ":"), UTF-8 not escaped) of the validated
                manifest, every default written out
    run-id    = base58btc(multihash sha2-256(canonical))        -> "Qm..." (46 chars)

So comments, key order and formatting of the TOML do not change the run-id; any semantic
change does, including leaving a field out where the default differs. A joiner fetches
canonical bytes from any peer and checks they hash to the run-id it asked for, then that
they are valid and really canonical (`parse_canonical`), so nobody can feed it another run.

Limits: a manifest is at most MAX_MANIFEST_BYTES, checked before parsing; an error message
lists at most MAX_ERRORS problems. Every failure is a `ManifestError` whose message reads
`<source>: <field.path>: <reason>`, one problem per line; any other exception is a bug.

Sans-IO except `load_manifest_file`, which only reads the file and hands the bytes on.
"""

from __future__ import annotations

import datetime
import difflib
import json
import keyword
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from protocols import multihash

SCHEMA = 1  # the manifest format this module reads and writes
MAX_MANIFEST_BYTES = 64 * 1024  # the demo manifest is ~2 KiB; 64 KiB leaves room for prose
MAX_ERRORS = 20  # problems listed per error; the rest are counted
RUN_ID_LENGTH = multihash.ID_LENGTH  # "Qm...": base58 of a sha2-256 multihash
RELAY_EXCHANGE_MB = 64.0  # network.relay_exchange_mb: its default
TOPK_MAX_DENSITY = 0.0625  # outer.topk_*: the defaults, left out of the canonical bytes
TOPK_MAX_BITS = 4
TOPK_MAX_ANCHOR_BITS = 8
_BASE58 = multihash.BASE58_ALPHABET
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the source, field and reason."""


class ManifestMismatch(ManifestError):
    """Bytes that do not hash to the run-id they were fetched for."""


# -- field checks (raise ValueError with a human reason; the field path is added later) ----


def _show(value: Any, limit: int = 40) -> str:
    """A value as the manifest author would write it, cut short."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= limit else text[: limit - 2] + '..."'
    if isinstance(value, int):
        return str(value) if value.bit_length() < 128 else f"a {value.bit_length()}-bit integer"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return _kind(value)


def _kind(value: Any) -> str:
    """The TOML name of a value's type, with its article."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, datetime.date | datetime.time):
        return "a date/time"
    return f"a {type(value).__name__}"


def _run_name(name: str) -> str:
    if not set(name) <= _NAME_CHARS:
        raise ValueError(f"may use only letters, digits, '.', '_' and '-' (got {_show(name)})")
    return name


def _factory(spec: str) -> str:
    """"" or "package.module:callable" (the attribute may be dotted, like an entry point)."""
    if spec == "":
        return spec
    module, sep, attr = spec.partition(":")
    parts = [*module.split("."), *attr.split(".")]
    if not sep or not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise ValueError(f'must be "package.module:callable" or "" (got {_show(spec)})')
    return spec


def _peer_multiaddr(addr: str) -> str:
    if not addr.startswith("/") or "/p2p/" not in addr or any(c.isspace() for c in addr):
        raise ValueError("must be a peer multiaddr like /ip4/<address>/tcp/<port>/p2p/<peer-id> "
                         f"(got {_show(addr)})")
    return addr


def _peer_id(peer_id: str) -> str:
    if not (46 <= len(peer_id) <= 60 and set(peer_id) <= _BASE58):
        raise ValueError("must be a libp2p peer id: 46 to 60 base58 characters, like "
                         f"12D3KooW... (got {_show(peer_id)})")
    return peer_id


def _plus_zero(x: float) -> float:
    return x + 0.0  # -0.0 -> 0.0: one value, one spelling, one run-id


def _tuple(value: Any) -> Any:
    """TOML and JSON give lists; the manifest holds tuples (immutable, hashable)."""
    return tuple(value) if isinstance(value, list) else value


Float = Annotated[float, AfterValidator(_plus_zero)]
RunName = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_run_name)]
Multiaddr = Annotated[str, Field(max_length=512), AfterValidator(_peer_multiaddr)]
PeerId = Annotated[str, AfterValidator(_peer_id)]
DataPath = Annotated[str, Field(min_length=1, max_length=4096)]


# -- the schema ---------------------------------------------------------------------------


class _Section(BaseModel):
    # strict: "16" is not 16 and true is not 1. An int is accepted where a float is
    # expected (lr = 1 means 1.0) and stored as a float, so it serializes as 1.0.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class RunSection(_Section):
    name: RunName
    description: Annotated[str, Field(max_length=2000)] = ""
    seed: Annotated[int, Field(ge=0, lt=2**63)] = 0


class ModelSection(_Section):
    task: Literal["bytes-gpt", "digits-mlp"] = "bytes-gpt"
    factory: Annotated[str, Field(max_length=256), AfterValidator(_factory)] = ""
    d_model: Annotated[int, Field(ge=1, le=16384)] = 128
    n_layers: Annotated[int, Field(ge=1, le=512)] = 4
    n_heads: Annotated[int, Field(ge=1, le=1024, validate_default=True)] = 4
    context: Annotated[int, Field(ge=1, le=65536)] = 128

    @field_validator("n_heads")
    @classmethod
    def _divides_d_model(cls, n_heads: int, info: ValidationInfo) -> int:
        d_model = info.data.get("d_model")  # absent when d_model itself was invalid
        if d_model is not None and d_model % n_heads:
            raise ValueError(f"must divide d_model = {d_model} evenly (got {n_heads})")
        return n_heads


class DataSection(_Section):
    source: Literal["stdlib", "digits", "files"] = "stdlib"
    paths: Annotated[tuple[DataPath, ...], BeforeValidator(_tuple),
                     Field(max_length=1024, validate_default=True)] = ()
    format: Literal["text", "jsonl"] = "text"
    jsonl_field: Annotated[str, Field(min_length=1, max_length=128)] = "text"
    val_fraction: Annotated[Float, Field(gt=0, lt=0.5)] = 0.05
    # digits only: each peer's class mix ~ Dirichlet(label_skew); 0 = every peer IID
    label_skew: Annotated[Float, Field(ge=0, le=1000)] = 0.0

    @field_validator("paths")
    @classmethod
    def _paths_for_files(cls, paths: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if info.data.get("source") == "files" and not paths:
            raise ValueError('must list at least one file or directory when source = "files"')
        return paths


class TrainSection(_Section):
    batch_size: Annotated[int, Field(ge=1, le=65536)] = 16
    lr: Annotated[Float, Field(gt=0, le=1)] = 2e-3
    warmup_steps: Annotated[int, Field(ge=0, lt=2**31)] = 50  # 0: no warm-up
    total_steps: Annotated[int, Field(ge=1, lt=2**40)] = 100_000
    weight_decay: Annotated[Float, Field(ge=0, le=10)] = 0.1
    grad_clip: Annotated[Float, Field(ge=0, le=1e6)] = 1.0  # 0: no clipping
    eval_every: Annotated[int, Field(ge=1, lt=2**31)] = 50
    eval_batches: Annotated[int, Field(ge=1, le=10_000)] = 4
    threads: Annotated[int, Field(ge=1, le=1024)] = 1
    # torch.compile of the model, beside training (eager until it is ready): "auto" = on
    # CUDA only. Left out of the canonical bytes at "auto": run-ids from before it stay.
    compile: Literal["auto", "on", "off"] = "auto"


class OuterSection(_Section):
    algorithm: Literal["noloco", "gossip", "diloco", "none"] = "noloco"
    inner_steps: Annotated[int, Field(ge=1, lt=2**31)] = 50
    outer_lr: Annotated[Float, Field(gt=0, le=10)] = 0.7
    momentum: Annotated[Float, Field(ge=0, lt=1)] = 0.5
    nesterov: bool = False
    group_size: Annotated[int, Field(ge=2, le=1024)] = 2
    # "auto": bf16, or int8 to a partner behind a relay or on a slow link (node/averaging/adapt.py);
    # "topk": sparse error-fed frames of the pseudo-gradient (protocols/sparse.py), for
    # outer.algorithm "noloco" or "diloco" only, within the topk_max_* bounds below
    codec: Literal["fp32", "bf16", "int8", "auto", "topk"] = "bf16"
    # Bounds on a peer's "topk" frames (protocols/sparse.py): denser frames, or wider value
    # or anchor codes, are refused. Left out of the canonical bytes at their defaults.
    topk_max_density: Annotated[Float, Field(gt=0, le=1)] = TOPK_MAX_DENSITY
    topk_max_bits: Annotated[int, Field(ge=2, le=8)] = TOPK_MAX_BITS
    topk_max_anchor_bits: Annotated[int, Field(ge=0, le=16)] = TOPK_MAX_ANCHOR_BITS


class AggregateSection(_Section):
    method: Literal["mean", "vc", "sybilwall", "median", "krum", "foolsgold"] = "mean"
    neighbours: Annotated[int, Field(ge=1, le=1024)] = 1


class CheckpointSection(_Section):
    every_steps: Annotated[int, Field(ge=1, lt=2**31)] = 500
    keep: Annotated[int, Field(ge=1, le=1000)] = 3


def _layers(value: Any) -> Any:
    return _tuple(value)


class PipelineSection(_Section):
    """Pipeline stages (docs/pipeline.md). Absent from a manifest: no pipeline, and the
    canonical bytes (so the run-id) of every manifest written before it are unchanged."""

    stages: Annotated[int, Field(ge=2, le=256)]
    # layers per stage, first to last; () = an even split of model.n_layers. A 0 is allowed
    # only at the ends: a stage holding only the embedding, or only the final norm + head.
    layers: Annotated[tuple[Annotated[int, Field(ge=0, le=512)], ...],
                      BeforeValidator(_layers), Field(max_length=256)] = ()
    micro_batches: Annotated[int, Field(ge=1, le=4096)] = 4
    routing: Literal["random", "fixed"] = "random"
    recovery: Literal["checkfree", "checkfree+", "none"] = "checkfree"
    lr_boost: Annotated[Float, Field(ge=1, le=10)] = 1.1  # lr x this, kept, on a rebuilt stage


class NetworkSection(_Section):
    bootstrap: Annotated[tuple[Multiaddr, ...], BeforeValidator(_tuple),
                         Field(max_length=64)] = ()
    admins: Annotated[tuple[PeerId, ...], BeforeValidator(_tuple), Field(max_length=64)] = ()
    # The largest averaging exchange, in MB each way on the wire, sent through a circuit
    # relay: a relay is a volunteer's uplink with a byte budget per circuit (docs/nat.md).
    # Partners reached only through a relay average when the codec's payload fits, else
    # both take a local step. 0: never through a relay. Left out of the canonical bytes
    # at its default, so every run-id from before it stays the same.
    relay_exchange_mb: Annotated[Float, Field(ge=0, le=1e6)] = RELAY_EXCHANGE_MB


class Manifest(_Section):
    """A validated run manifest, immutable: `m.model.d_model`, `m.outer.algorithm`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False,
                              populate_by_name=True)

    # "schema" in TOML and JSON; the attribute name avoids BaseModel's deprecated .schema()
    schema_version: Annotated[int, Field(alias="schema", ge=SCHEMA, le=SCHEMA)] = SCHEMA
    run: RunSection
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    outer: OuterSection = OuterSection()
    aggregate: AggregateSection = AggregateSection()
    checkpoint: CheckpointSection = CheckpointSection()
    network: NetworkSection = NetworkSection()
    pipeline: PipelineSection | None = None  # left out of the canonical bytes when None

    @model_validator(mode="after")
    def _aggregate_needs_gossip(self) -> Manifest:
        # NoLoCo averages its pair by its own rule; the aggregators replace the model with
        # what they compute from k neighbours, which is gossip learning.
        if self.aggregate.method != "mean" and self.outer.algorithm != "gossip":
            raise ValueError(
                f'aggregate.method = "{self.aggregate.method}" needs outer.algorithm = "gossip"'
                f' (it is "{self.outer.algorithm}")'
            )
        return self

    @model_validator(mode="after")
    def _topk_needs_an_outer_step(self) -> Manifest:
        # topk frames carry a pseudo-gradient with error feedback: NoLoCo's or DiLoCo's
        # outer step consumes them (node/ml/optim/compress.py); gossip learning and a
        # pipeline's stage replicas average whole weights
        if self.outer.codec == "topk" and (self.outer.algorithm not in ("noloco", "diloco")
                                           or self.pipeline is not None):
            raise ValueError('outer.codec = "topk" needs outer.algorithm = "noloco" or '
                             '"diloco" and no [pipeline]')
        return self

    @model_validator(mode="after")
    def _pipeline_fits(self) -> Manifest:
        if self.pipeline is not None:
            problem = pipeline_problem(self)
            if problem:
                raise ValueError(problem)
        return self


def stage_layers(n_layers: int, stages: int, layers: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Transformer blocks per stage: `layers` as written, or an even split of `n_layers`
    (the first `n_layers % stages` stages take one more)."""
    if layers:
        return tuple(layers)
    base, extra = divmod(n_layers, stages)
    return tuple(base + (i < extra) for i in range(stages))


def pipeline_problem(m: Manifest) -> str | None:
    """Why `m`'s [pipeline] cannot cut its model, as one `pipeline.<field>: reason` line."""
    p = m.pipeline
    if p is None:
        return None
    if m.model.task != "bytes-gpt" or m.model.factory:
        return ('pipeline.stages: a pipeline cuts the built-in byte-level GPT; it needs '
                'model.task = "bytes-gpt" and model.factory = ""')
    if p.layers and len(p.layers) != p.stages:
        return (f"pipeline.layers: must list one count per stage ({p.stages}), "
                f"got {len(p.layers)}")
    if p.layers and sum(p.layers) != m.model.n_layers:
        return (f"pipeline.layers: must add up to model.n_layers = {m.model.n_layers} "
                f"(got {sum(p.layers)})")
    if not p.layers and m.model.n_layers < p.stages:
        return (f"pipeline.stages: an even split of model.n_layers = {m.model.n_layers} "
                f"needs at most that many stages (got {p.stages})")
    layers = stage_layers(m.model.n_layers, p.stages, p.layers)
    inner = [i for i, n in enumerate(layers[1:-1], start=1) if n == 0]
    if inner:
        return (f"pipeline.layers: only the first and last stage may hold 0 layers "
                f"(stage {inner[0]} holds 0)")
    if m.train.batch_size % p.micro_batches:
        return (f"pipeline.micro_batches: must divide train.batch_size = "
                f"{m.train.batch_size} (got {p.micro_batches})")
    blocks = [n for n in layers if n]
    if p.recovery != "none" and len(set(blocks)) > 1:
        return (f'pipeline.recovery: "{p.recovery}" rebuilds a stage from its neighbours, '
                f"so every stage with layers must hold as many (got {list(layers)}); "
                'list pipeline.layers or set recovery = "none"')
    if p.recovery == "checkfree" and len(blocks) < 3:
        return ('pipeline.recovery: "checkfree" needs an interior stage between two stages '
                f"with layers (got {list(layers)})")
    if p.recovery == "checkfree+" and len(blocks) < 4:
        return ('pipeline.recovery: "checkfree+" swaps the first two and the last two stages '
                f"with layers, so it needs at least 4 of them (got {list(layers)})")
    return None


# -- turning pydantic's errors into sentences -------------------------------------------------

_TYPES = {
    "int_type": "must be an integer", "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number", "float_parsing": "must be a number",
    "bool_type": "must be true or false", "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "tuple_type": "must be an array", "list_type": "must be an array",
    "model_type": "must be a table", "model_attributes_type": "must be a table",
    "dict_type": "must be a table",
}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def _section_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class a location inside the manifest points to, if it is a section."""
    cls: type[BaseModel] = Manifest
    for part in loc:
        field = _fields(cls).get(part)
        # an optional section ([pipeline]) is annotated "Section | None"
        field = next((a for a in get_args(field) if isinstance(a, type)
                      and issubclass(a, BaseModel)), field) if get_args(field) else field
        if field is None or not (isinstance(field, type) and issubclass(field, BaseModel)):
            return None
        cls = field
    return cls


def _fields(cls: type[BaseModel]) -> dict[str, Any]:
    """Field names as written in a manifest (aliases), with their annotations."""
    return {f.alias or name: f.annotation for name, f in cls.model_fields.items()}


def _key(name: str) -> str:
    """A key as TOML would accept it in a dotted path: bare if it can be, else quoted."""
    if name and len(name) <= 40 and set(name) <= _NAME_CHARS - {"."}:
        return name
    return _show(name)


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{_key(part)}" if out else _key(part)
    return out or "(top level)"


def _suggest(word: str, options: list[str], show: Any = repr) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {show(close[0])}?)" if close else ""


def _reason(err: Any) -> str:
    kind, loc, ctx = err["type"], err["loc"], err.get("ctx", {})
    value = err.get("input")
    got = f"got {_show(value)}"
    if kind == "extra_forbidden":
        *parent, name = loc
        where = f"in [{_path(tuple(parent))}]" if parent else "at the top level"
        cls = _section_at(tuple(parent))
        hint = _suggest(str(name), list(_fields(cls))) if cls else ""
        shown = _key(name) if _key(name) == name else _show(name)[1:-1]
        return f"unknown field '{shown}' {where}{hint}"
    if kind == "missing":
        if loc == ("run",):
            return "missing section [run] (every manifest needs one, with at least a name)"
        return "is required"
    if kind in _TYPES:
        what = _kind(value) if isinstance(value, dict | list | tuple) else (
            f"{_show(value)}, {_kind(value)}")
        return f"{_TYPES[kind]} (got {what})"
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return f"must be {op} {ctx[key]} ({got})"
    if kind == "finite_number":
        return f"must be a finite number ({got})"
    if kind == "literal_error":
        section = _section_at(tuple(loc[:-1]))
        options = [str(o) for o in get_args(_fields(section).get(loc[-1]))] if section else []
        if options:
            listed = ", ".join(_show(o) for o in options)
            return f"must be one of {listed} ({got}){_suggest(str(value), options, _show)}"
        return f"must be {ctx.get('expected')} ({got})"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters (got {len(value)})"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} entries (got {ctx['actual_length']})"
    if kind == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    return f"{err['msg']} ({got})"  # a kind this table has not met yet: still names the field


def _line(source: str, loc: tuple[Any, ...], reason: str) -> str:
    # A check across sections (a model validator) names its own field: "pipeline.layers: ..."
    named = not loc and reason.partition(": ")[0] in _CROSS_FIELDS
    return f"{source}: {reason}" if named else f"{source}: {_path(loc)}: {reason}"


_CROSS_FIELDS = frozenset(f"pipeline.{f}" for f in PipelineSection.model_fields)


def _explain(e: ValidationError, source: str) -> ManifestError:
    errors = e.errors(include_url=False)
    lines = [_line(source, tuple(err["loc"]), _reason(err)) for err in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        lines.append(f"{source}: ... and {len(errors) - MAX_ERRORS} more problems")
    return ManifestError("\n".join(lines))


def _validate(doc: Any, source: str) -> Manifest:
    if not isinstance(doc, dict):
        raise ManifestError(f"{source}: a manifest is a table of sections (got {_kind(doc)})")
    schema = doc.get("schema", SCHEMA)
    if type(schema) is int and schema != SCHEMA:  # a newer format: its fields mean nothing here
        raise ManifestError(f"{source}: unsupported manifest schema {_show(schema)} "
                            f"(this peertrain reads {SCHEMA})")
    try:
        return Manifest.model_validate(doc)
    except ValidationError as e:
        raise _explain(e, source) from None


# -- the public API ----------------------------------------------------------------------


def _too_large(source: str, got: str) -> ManifestError:
    return ManifestError(f"{source}: too large: a manifest is at most {MAX_MANIFEST_BYTES} "
                         f"bytes (got {got})")


def _text(data: str | bytes | bytearray | memoryview, source: str) -> str:
    """Size check first, then UTF-8; a leading byte-order mark is dropped."""
    if isinstance(data, str):
        if len(data) > MAX_MANIFEST_BYTES:  # every character is at least one byte
            raise _too_large(source, f"{len(data)} characters")
        try:
            size = len(data.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ManifestError(f"{source}: not valid Unicode text ({e.reason} at "
                                f"{_line_col(data[:e.start])})") from None
        if size > MAX_MANIFEST_BYTES:
            raise _too_large(source, f"{size} bytes")
        text = data
    else:
        raw = memoryview(data).cast("B")
        if len(raw) > MAX_MANIFEST_BYTES:
            raise _too_large(source, f"{len(raw)} bytes")
        try:
            text = str(raw, "utf-8")
        except UnicodeDecodeError as e:
            before = str(raw[:e.start], "utf-8")  # decodes: the bad byte is the first one
            raise ManifestError(f"{source}: not UTF-8 text ({e.reason} at "
                                f"{_line_col(before)})") from None
    return text.removeprefix("\ufeff")


def _line_col(before: str) -> str:
    """Where the character after `before` is, 1-based, as tomllib's messages count."""
    line = before.count("\n") + 1
    column = len(before) - before.rfind("\n")
    return f"line {line}, column {column}"


def parse_manifest(text: str | bytes, source: str = "<manifest>") -> Manifest:
    """Parse and validate a TOML manifest; `source` names it in error messages.

    Raises ManifestError: oversized, not UTF-8, invalid TOML (with line and column), or
    invalid fields (one line per problem, each naming its field path).
    """
    doc = _toml(_text(text, source), source)
    return _validate(doc, source)


def _toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{source}: invalid TOML: {e}") from None
    except ValueError as e:  # an integer literal over Python's 4300-digit limit
        raise ManifestError(f"{source}: invalid TOML: {str(e).split(':')[0]}") from None
    except RecursionError:  # arrays nested ~1000 deep; 64 KiB allows 32,000
        raise ManifestError(f"{source}: invalid TOML: arrays or tables nested too deeply"
                            ) from None


def load_manifest_file(path: str | Path) -> Manifest:
    """Read a TOML manifest file (at most MAX_MANIFEST_BYTES + 1 bytes of it) and parse it.

    Errors name the path as given. OSError (missing file, no permission) is the caller's.
    """
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise _too_large(str(path), f"at least {len(data)} bytes")
    return parse_manifest(data, source=str(path))


def canonical_bytes(manifest: Manifest) -> bytes:
    """The manifest with every default filled in, as sorted, whitespace-free UTF-8 JSON."""
    doc = manifest.model_dump(mode="json", by_alias=True)
    for key, default in (("topk_max_density", TOPK_MAX_DENSITY), ("topk_max_bits", TOPK_MAX_BITS),
                         ("topk_max_anchor_bits", TOPK_MAX_ANCHOR_BITS)):
        if doc["outer"].get(key) == default:  # left out at their defaults: run-ids stay
            doc["outer"].pop(key)
    if doc.get("pipeline") is None:  # no pipeline: the bytes every manifest had before it
        doc.pop("pipeline", None)
    if doc["network"].get("relay_exchange_mb") == RELAY_EXCHANGE_MB:  # likewise
        doc["network"].pop("relay_exchange_mb")
    if doc["train"].get("compile") == "auto":  # likewise
        doc["train"].pop("compile")
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def run_id(canonical: bytes) -> str:
    """base58btc(multihash sha2-256(canonical)): a 46-character "Qm..." string."""
    return multihash.sha256_id(canonical)


def validate_run_id(s: str) -> str:
    """Check a user-typed run-id is well formed; return it without surrounding whitespace."""
    if not isinstance(s, str):
        raise ManifestError(f"not a peertrain run-id: expected a string, got {_kind(s)}")
    text = s.strip()
    shown = _show(text, limit=70)
    if len(text) != RUN_ID_LENGTH or not set(text) <= _BASE58:
        hint = " (that looks like a peer id)" if text.startswith("12D3Koo") else ""
        raise ManifestError(f"not a peertrain run-id: {shown}{hint}; expected {RUN_ID_LENGTH} "
                            "base58 characters starting with Qm, as `node run create` prints")
    if not multihash.is_sha256_id(text):
        raise ManifestError(f"not a peertrain run-id: {shown} is not a sha2-256 multihash")
    return text


def parse_canonical(data: bytes, expected_run_id: str | None = None,
                    source: str | None = None) -> Manifest:
    """Verify and parse canonical manifest bytes, typically fetched from a stranger.

    In this order: size; the hash against `expected_run_id` (ManifestMismatch, before any
    parsing); UTF-8 JSON; the schema; and that the bytes are exactly the canonical form of
    what they hold (else two byte strings, so two run-ids, would name one run).
    """
    src = source or (f"manifest of run {expected_run_id}" if expected_run_id
                     else "canonical manifest")
    view = memoryview(data).cast("B")
    if len(view) > MAX_MANIFEST_BYTES:
        raise _too_large(src, f"{len(view)} bytes")
    data = bytes(view)
    if expected_run_id is not None:
        got = run_id(data)
        if got != expected_run_id:
            raise ManifestMismatch(f"{src}: the bytes hash to run-id {got}, not to "
                                   f"{expected_run_id}")
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ManifestError(f"{src}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ManifestError(f"{src}: not a manifest: JSON nested too deeply") from None
    except ValueError as e:
        raise ManifestError(f"{src}: not JSON: {e}") from None
    manifest = _validate(doc, src)
    if canonical_bytes(manifest) != data:
        raise ManifestError(f"{src}: not in canonical form (sorted keys, no whitespace, every "
                            "default written out, floats as floats); refused")
    return manifest


__all__ = [
    "MAX_MANIFEST_BYTES", "RUN_ID_LENGTH", "SCHEMA", "AggregateSection", "CheckpointSection",
    "DataSection", "Manifest", "ManifestError", "ManifestMismatch", "ModelSection",
    "NetworkSection", "OuterSection", "PipelineSection", "RunSection", "TrainSection",
    "canonical_bytes", "load_manifest_file", "parse_canonical", "parse_manifest",
    "pipeline_problem", "run_id",
    "stage_layers", "validate_run_id",
]
