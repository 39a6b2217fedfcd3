"""Typed errors raised by node/ml/trainer/.

Each carries the fields a caller needs to say what went wrong; only cli/ turns them into
sentences for the user and exit codes (STYLE.md point 5).
"""

from __future__ import annotations

from node.ml.device import DeviceError  # torch-free: the CLI checks a device before torch loads

__all__ = ["ConfigError", "DataError", "DeviceError", "DeviceMemoryError", "FactoryError",
           "TrainerError"]


class TrainerError(Exception):
    """Base class of every error raised by node/ml/trainer/."""


class DataError(TrainerError, ValueError):
    """The training data cannot be used: a missing file, a bad JSONL line, an empty corpus.

    `path` and `line` (1-based) point at the culprit when there is one.
    """

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.line = line


class FactoryError(TrainerError, ValueError):
    """A "pkg.module:callable" model factory cannot be imported, called, or returned junk."""

    def __init__(self, message: str, *, spec: str):
        super().__init__(f"model factory {spec!r}: {message}")
        self.spec = spec


class ConfigError(TrainerError, ValueError):
    """A configuration value is out of range or unknown (task name, sizes, schedule)."""


class DeviceMemoryError(TrainerError):
    """Training would not fit in the GPU's free memory (node/ml/trainer/memory_fit.py says why
    and what to try); raised before the model moves there, or for an out-of-memory error in
    a step."""
