"""`node config path|show|init`, and the merge of flags, environment and config file that
`node join` and `node bootstrap` run before anything starts (node/config_file.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from cli.common import Json, fail, out, print_json
from node import config_file as cf

app = typer.Typer(no_args_is_help=True, help="The config file: where it is, what it sets.")

BOOTSTRAP_ENV = "PEERTRAIN_BOOTSTRAP"

ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", help=f"Config file (TOML). Default: ${cf.CONFIG_ENV}, else the user config dir.",
    show_default=False)]


def load(path: Path | None) -> tuple[cf.ConfigFile, Path | None]:
    try:
        return cf.load(path)
    except cf.ConfigFileError as e:
        raise fail(str(e), e.exit_code) from None


def env_bootstrap() -> list[str]:
    """PEERTRAIN_BOOTSTRAP: multiaddrs separated by commas and/or whitespace."""
    return [a for a in re.split(r"[,\s]+", os.environ.get(BOOTSTRAP_ENV, "")) if a]


def effective(command: Literal["join", "bootstrap"], config: Path | None,
              flags: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Each setting from the highest source that sets it: flag (not None), environment
    (bootstrap only), the config file's command table, its top level, the default.
    `bootstrap_from` names where the bootstrap list came from."""
    file, path = load(config)
    from_file = file.for_command(command)
    values: dict[str, Any] = {}
    for key, default in defaults.items():
        if flags.get(key) not in (None, []):
            values[key] = flags[key]
        elif key in from_file:
            values[key] = from_file[key]
        else:
            values[key] = default
    values["bootstrap_from"] = "--bootstrap"
    if not flags.get("bootstrap"):
        if env := env_bootstrap():
            values["bootstrap"], values["bootstrap_from"] = env, BOOTSTRAP_ENV
        elif from_file.get("bootstrap"):
            values["bootstrap_from"] = f"the config file {path}"
    return values


@app.command("path")
def config_path(config: ConfigOpt = None, as_json: Json = False) -> None:
    """Print the config file in effect (it may not exist yet)."""
    path, _ = cf.resolve_path(config)
    if as_json:
        print_json({"path": str(path), "exists": path.exists()})
    else:
        print(path)


@app.command("show")
def config_show(config: ConfigOpt = None, as_json: Json = False) -> None:
    """Validate the config file and print what it sets."""
    file, path = load(config)
    if as_json:  # what the file sets (keys left out take the built-in defaults)
        print_json({"path": str(path or cf.resolve_path(config)[0]), "exists": path is not None,
                    "settings": file.model_dump(mode="json", by_alias=True, exclude_none=True)})
        return
    if path is None:
        err_path, _ = cf.resolve_path(config)
        out.print(f"# no config file at {err_path}: built-in defaults", highlight=False)
        return
    print(f"# {path}")
    print(cf.render(file), end="")


@app.command("init")
def config_init(
    config: ConfigOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    as_json: Json = False,
) -> None:
    """Write a commented config file with every key (all commented out) to start from."""
    from node.files import atomic_write

    path, _ = cf.resolve_path(config)
    if path.exists() and not force:
        raise fail(f"{path} exists; edit it, or pass --force to replace it", 1)
    try:
        atomic_write(path, cf.TEMPLATE.encode())
    except OSError as e:
        raise fail(f"cannot write {path}: {e.strerror or e}", 1) from None
    if as_json:
        print_json({"path": str(path)})
    else:
        print(path)
