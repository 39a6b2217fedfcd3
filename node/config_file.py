"""The operator's config file: every flag of `node join` and `node bootstrap`, in TOML.

Where it is: `--config FILE`, else $PEERTRAIN_CONFIG, else `config.toml` under the
platform's user config dir (`~/.config/peertrain/config.toml` on Linux). The default file
may be absent (then nothing is set); a file named by `--config` or the variable must exist.

Shape: keys are the flags' long names without the dashes (`join-timeout = 60`); a
repeatable flag takes an array (`bootstrap = ["/ip4/.../p2p/..."]`). Top-level keys apply
to both commands; a `[join]` or `[bootstrap-node]` table sets a key for that command only and
wins over the top level. Precedence, highest first: the command line, the environment
(PEERTRAIN_BOOTSTRAP), the command's table, the top level, the built-in default.

Validation is the manifest's (protocols/manifest.py): strict types, unknown keys refused
by name with a suggestion, every problem a `<file>: <key.path>: <reason>` line. Values are
checked for shape here; what only the CLI can check (a listen address that binds, a data
file that reads as text) is checked there, as for the flag.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import platformdirs
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from node.errors import NodeError
from protocols.manifest import _kind, _show

CONFIG_ENV = "PEERTRAIN_CONFIG"
MAX_CONFIG_BYTES = 64 * 1024
MAX_ERRORS = 20


class ConfigFileError(NodeError):
    """An unreadable or invalid config file (exit 2, like a bad flag)."""

    exit_code = 2


def _multiaddr(addr: str) -> str:
    if not addr.startswith("/") or any(c.isspace() for c in addr):
        raise ValueError(f"must be a multiaddr like /ip4/<address>/tcp/<port> (got {_show(addr)})")
    return addr


def _peer_multiaddr(addr: str) -> str:
    _multiaddr(addr)
    if "/p2p/" not in addr:
        raise ValueError("must be a peer multiaddr like /ip4/<address>/tcp/<port>/p2p/<peer-id>"
                         f" (got {_show(addr)})")
    return addr


Addr = Annotated[str, Field(max_length=512), AfterValidator(_multiaddr)]
PeerAddr = Annotated[str, Field(max_length=512), AfterValidator(_peer_multiaddr)]
Addrs = Annotated[list[Addr], Field(max_length=64)]
PeerAddrs = Annotated[list[PeerAddr], Field(max_length=64)]
Path_ = Annotated[str, Field(min_length=1, max_length=4096)]
Seconds = Annotated[float, Field(gt=0, le=86400)]
# The scale keys (node/config.py): bounds an operator cannot mean past, checked again by the
# CLI (max-peers >= want-peers needs both values, so it is checked there).
PerSecond = Annotated[float, Field(gt=0, le=100_000)]
Peers = Annotated[int, Field(ge=0, le=100_000)]
LogLevel = Literal["debug", "info", "warning", "error"]


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True, frozen=True)


class CommonKeys(_Table):
    """Flags both `node join` and `node bootstrap` have."""

    state_dir: Path_ | None = Field(None, alias="state-dir")
    bootstrap: PeerAddrs | None = None
    listen: Addrs | None = None
    announce: Addrs | None = None
    mdns: bool | None = None
    log_level: LogLevel | None = Field(None, alias="log-level")
    metrics: Annotated[str, Field(min_length=1, max_length=300)] | None = None
    no_metrics: bool | None = Field(None, alias="no-metrics")
    no_upnp: bool | None = Field(None, alias="no-upnp")


class JoinKeys(CommonKeys):
    no_punch: bool | None = Field(None, alias="no-punch")
    device: Annotated[str, Field(min_length=1, max_length=32)] | None = None
    join_timeout: Seconds | None = Field(None, alias="join-timeout")
    heartbeat_target: PerSecond | None = Field(None, alias="heartbeat-target")
    want_peers: Peers | None = Field(None, alias="want-peers")
    max_peers: Annotated[int, Field(ge=1, le=100_000)] | None = Field(None, alias="max-peers")
    rundoc_horizon: Annotated[float, Field(gt=0, le=365 * 86400)] | None = Field(
        None, alias="rundoc-horizon")
    no_train: bool | None = Field(None, alias="no-train")
    data: Annotated[list[Path_], Field(max_length=4096)] | None = None
    attack: Literal["label-flip", "backdoor"] | None = None
    neighbour: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]],
                         Field(max_length=64)] | None = None


class BootstrapKeys(CommonKeys):
    pass


class ConfigFile(CommonKeys):
    """The whole file: shared keys at the top level, a table per command."""

    join: JoinKeys = JoinKeys()
    bootstrap_: BootstrapKeys = Field(BootstrapKeys(), alias="bootstrap-node")

    def for_command(self, command: Literal["join", "bootstrap"]) -> dict[str, Any]:
        """The keys set for `command`, by field name: the command's table over the top."""
        top = self.model_dump(exclude_none=True, include=set(CommonKeys.model_fields))
        table = (self.join if command == "join" else self.bootstrap_).model_dump(
            exclude_none=True)
        return {**top, **table}


# The file says [bootstrap] for the command's table; the top-level `bootstrap` key is the
# list of peers. TOML cannot hold both under one name, so the table is [bootstrap-node].
COMMAND_TABLES = {"join": "join", "bootstrap": "bootstrap-node"}


def default_path() -> Path:
    return Path(platformdirs.user_config_dir("peertrain", appauthor=False)) / "config.toml"


def resolve_path(explicit: Path | None) -> tuple[Path, bool]:
    """The config file in effect and whether it must exist (named by flag or variable)."""
    if explicit is not None:
        return explicit, True
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]), True
    return default_path(), False


def load(explicit: Path | None = None) -> tuple[ConfigFile, Path | None]:
    """The validated config and the file it came from (None: no file, all defaults)."""
    path, required = resolve_path(explicit)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        if required:
            raise ConfigFileError(f"cannot read config file {path}: no such file") from None
        return ConfigFile(), None
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {path}: {e.strerror or e}") from None
    return parse(data, str(path)), path


def parse(data: bytes | str, source: str = "<config>") -> ConfigFile:
    """Validate config text; every problem is a `source: key.path: reason` line."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigFileError(f"{source}: too large: a config file is at most "
                              f"{MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"{source}: not UTF-8 text (byte {e.start})") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"{source}: invalid TOML: {e}") from None
    except (ValueError, RecursionError) as e:  # huge integer literals, deep nesting
        raise ConfigFileError(f"{source}: invalid TOML: {type(e).__name__}") from None
    try:
        return ConfigFile.model_validate(doc)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        lines = [f"{source}: {_path(err['loc'])}: {_reason(err)}" for err in errors[:MAX_ERRORS]]
        if len(errors) > MAX_ERRORS:
            lines.append(f"{source}: ... and {len(errors) - MAX_ERRORS} more problems")
        raise ConfigFileError("; ".join(lines)) from None


def _keys_at(parent: tuple[Any, ...]) -> list[str]:
    cls: type[BaseModel] = ConfigFile
    if parent == ("join",):
        cls = JoinKeys
    elif parent == ("bootstrap-node",):
        cls = BootstrapKeys
    elif parent:
        return []
    return [f.alias or name for name, f in cls.model_fields.items()]


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "(top level)"


_TYPES = {"int_type": "must be an integer", "float_type": "must be a number",
          "bool_type": "must be true or false", "string_type": "must be a string",
          "list_type": "must be an array", "model_type": "must be a table",
          "model_attributes_type": "must be a table", "dict_type": "must be a table"}


def _reason(err: Any) -> str:
    kind, loc, ctx, value = err["type"], err["loc"], err.get("ctx", {}), err.get("input")
    if kind == "extra_forbidden":
        *parent, name = loc
        where = f"in [{_path(tuple(parent))}]" if parent else "at the top level"
        close = difflib.get_close_matches(str(name), _keys_at(tuple(parent)), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"unknown key '{name}' {where}{hint}"
    if kind in _TYPES:
        what = _kind(value) if isinstance(value, dict | list) else f"{_show(value)}, {_kind(value)}"
        return f"{_TYPES[kind]} (got {what})"
    if kind in ("greater_than", "less_than_equal", "greater_than_equal", "less_than"):
        op = {"greater_than": ">", "less_than_equal": "<=", "greater_than_equal": ">=",
              "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound} (got {_show(value)})"
    if kind == "literal_error":
        return f"must be {ctx.get('expected')} (got {_show(value)})"
    if kind == "finite_number":
        return f"must be a finite number (got {_show(value)})"
    if kind == "string_too_short":
        return "must not be empty"
    if kind in ("string_too_long", "too_long"):
        return f"too long (at most {ctx.get('max_length')})"
    if kind == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    return f"{err['msg']} (got {_show(value)})"


def render(config: ConfigFile) -> str:
    """The config as TOML (keys that are set only): what `node config show` prints."""
    lines: list[str] = []

    def emit(table: dict[str, Any]) -> None:
        for key, value in table.items():
            lines.append(f"{key} = {_toml_value(value)}")

    emit({k: v for k, v in config.model_dump(by_alias=True, exclude_none=True,
                                              include=set(CommonKeys.model_fields)).items()})
    for attr, name in (("join", "join"), ("bootstrap_", "bootstrap-node")):
        table = getattr(config, attr).model_dump(by_alias=True, exclude_none=True)
        if table:
            lines += ["", f"[{name}]"]
            emit(table)
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string


TEMPLATE = """\
# peertrain config: every key is a flag of `node join` / `node bootstrap` (docs/operator.md).
# Top-level keys apply to both commands; [join] and [bootstrap-node] override them for one.
# The command line wins over this file; PEERTRAIN_BOOTSTRAP wins over `bootstrap` here.

# state-dir = "/var/lib/peertrain"
# Peers to start from, tried before remembered peers and mDNS:
# bootstrap = ["/ip4/203.0.113.7/tcp/4101/p2p/12D3KooW..."]
# listen = ["/ip4/0.0.0.0/tcp/0"]
# Addresses others should dial (a public address or a port forward):
# announce = ["/ip4/203.0.113.7/tcp/4101"]
# mdns = true
# log-level = "info"
# Prometheus /metrics and the status page (default 127.0.0.1:9470), or no-metrics = true:
# metrics = "127.0.0.1:9470"
# Never ask the LAN's gateway for a UPnP port mapping (docs/nat.md):
# no-upnp = false

[join]
# device = "auto"
# Never hole-punch a relayed peer (docs/nat.md); the relay, or WebRTC, carries it:
# no-punch = false
# join-timeout = 30.0
# Large runs (docs/operator.md): heartbeats a second to receive at most, run members to
# keep connected, connections to keep at most, seconds a departed peer stays documented:
# heartbeat-target = 50.0
# want-peers = 8
# max-peers = 32
# rundoc-horizon = 3600.0
# no-train = false
# data = ["/path/to/my/texts"]

[bootstrap-node]
# listen = ["/ip4/0.0.0.0/tcp/4101"]
"""
