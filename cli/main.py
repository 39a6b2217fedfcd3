"""The `node` / `peertrain` command line."""

import typer

app = typer.Typer(no_args_is_help=True, help="peertrain: contribute a CPU or GPU to a shared training run.")
