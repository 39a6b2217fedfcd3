"""The typer face of peertrain."""
