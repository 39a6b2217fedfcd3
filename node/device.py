"""The one device check: `--device auto|cpu|cuda|cuda:N`.

`parse` checks the spelling without importing torch (the CLI calls it before anything
starts); `resolve` asks torch what exists (the daemon, in a worker thread, and the
trainer). Both raise `DeviceError` with a sentence a user can act on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class DeviceError(ValueError):
    """The requested device is misspelled or does not exist on this machine."""

    def __init__(self, message: str, *, requested: str):
        super().__init__(message)
        self.requested = requested


def parse(spec: str) -> str:
    """The normalized spec ("auto", "cpu", "cuda" or "cuda:<i>"), or DeviceError."""
    wanted = spec.strip().lower()
    if wanted in ("auto", "cpu", "cuda") or (
            wanted.startswith("cuda:") and wanted.removeprefix("cuda:").isdigit()):
        return wanted
    raise DeviceError(f"unknown device {spec!r}; expected auto, cpu, cuda or cuda:<index>",
                      requested=spec)


def resolve(spec: str) -> torch.device:
    """`auto` is CUDA when torch sees a GPU, else the CPU; a CUDA device must exist."""
    import torch

    wanted = parse(spec)
    if wanted == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if wanted == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(f"device {spec!r} requested but CUDA is not available "
                          f"(torch {torch.__version__} is {build}); use --device cpu or auto",
                          requested=spec)
    if wanted == "cuda":
        return torch.device("cuda")
    index, count = int(wanted.removeprefix("cuda:")), torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {spec!r} requested but only {count} CUDA device(s) exist",
                          requested=spec)
    return torch.device("cuda", index)
