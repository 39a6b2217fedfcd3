"""The one device check: `--device auto|cpu|cuda|cuda:N`.

`parse` checks the spelling without importing torch (the CLI calls it before anything
starts); `precheck` refuses `cuda` on a machine that certainly has none, still without
torch (torch loads in the background while the node dials: node/process/preload.py, so the
refusal must not wait for it); `resolve` asks torch what exists (the daemon, in a worker
thread, and the trainer). All raise `DeviceError` with a sentence a user can act on.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from pathlib import Path
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


def torch_build() -> dict[str, str | None]:
    """The installed torch's version strings (`cuda`, `hip`) read from torch/version.py,
    without importing torch; both None when torch is missing or the file unreadable."""
    build: dict[str, str | None] = {"cuda": None, "hip": None}
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        for key in build:
            found = re.search(rf"^{key}\b[^=]*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
            build[key] = found.group(1) if found else None
    return build


def precheck(spec: str, *, build: dict[str, str | None] | None = None,
             nvidia_nodes: list[str] | None = None) -> None:
    """DeviceError when `spec` asks for CUDA and this machine certainly has none: a CPU-only
    torch build, or a CUDA build with no NVIDIA device node (/dev/nvidiaN) to run on.
    Anything else is left to `resolve` (a device index out of range, a driver that fails)."""
    wanted = parse(spec)
    if not wanted.startswith("cuda"):
        return
    build = torch_build() if build is None else build
    if build["hip"]:  # ROCm builds answer to "cuda" too; their devices are not /dev/nvidia*
        return
    if not build["cuda"]:
        raise DeviceError(f"device {spec!r} requested but the installed torch is a CPU-only "
                          "build (no CUDA); use --device cpu or auto, or install a CUDA build "
                          "of torch", requested=spec)
    nodes = ([n for n in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", n)]
             if nvidia_nodes is None else nvidia_nodes)
    if not nodes or os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        raise DeviceError(f"device {spec!r} requested but this machine shows no NVIDIA GPU "
                          "(no /dev/nvidiaN, or CUDA_VISIBLE_DEVICES hides them all); use "
                          "--device cpu or auto", requested=spec)


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
