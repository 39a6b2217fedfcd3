"""Refuse training data that cannot train, before the node joins a run.

Two checks, each ending in one line that names the file and what to do:

- `check_text_files(paths)` (the CLI, before anything starts): every file exists, is
  readable, is not empty and is UTF-8 text. The trainer reads bytes as they are, so a
  binary file would otherwise be trained on silently.
- `check_training_data(manifest, paths)` (the daemon, once the manifest is known, before
  it announces itself): builds the run's corpus from those files exactly as the trainer
  will and checks that both splits are longer than the model's context. Without it the
  node joins and its trainer dies at once ("train split ... needs more than the context").

Both raise `DataRefused` (exit 2: a bad `--data` value, or a bad `data.paths`).
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node.errors import NodeError

READ_CHUNK = 1 << 20


class DataRefused(NodeError):
    exit_code = 2


def _files(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and not any(
                part.startswith(".") for part in p.relative_to(path).parts)))
        elif path.exists() and not path.is_file():
            raise DataRefused(f"--data {given}: not a regular file or directory")
        elif not path.exists():
            raise DataRefused(f"--data {given}: no such file or directory")
        else:
            files.append(path)
    return files


def check_text_files(paths: Sequence[str]) -> None:
    """Each file readable, non-empty UTF-8 text without NUL bytes; raises DataRefused."""
    files = _files(paths)
    if paths and not files:
        raise DataRefused(f"--data {paths[0]}: the directory holds no files")
    for file in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        size = offset = 0
        try:
            with open(file, "rb") as f:
                while chunk := f.read(READ_CHUNK):
                    offset = size
                    size += len(chunk)
                    if b"\0" in chunk:
                        raise DataRefused(f"--data {file}: binary data (a NUL byte at offset "
                                          f"{offset + chunk.index(0)}); give text or JSONL")
                    decoder.decode(chunk)
                decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise DataRefused(f"--data {file}: not UTF-8 text ({e.reason} near byte "
                              f"{offset + e.start}); give text or JSONL") from None
        except OSError as e:
            raise DataRefused(f"--data {file}: cannot read: {e.strerror or e}") from None
        if size == 0:
            raise DataRefused(f"--data {file}: the file is empty")


def check_training_data(manifest: Any, paths: Sequence[str]) -> None:
    """The corpus the trainer will build from `paths` (or the manifest's files) is usable
    for this run's model. Loads the files: call it from a worker thread."""
    m = manifest
    files = list(paths) or (list(m.data.paths) if m.data.source == "files" else [])
    if m.model.task != "bytes-gpt" or not files:
        return  # the built-in corpora are always long enough
    from node.ml.trainer.data import load_text_files
    from node.ml.trainer.errors import TrainerError
    from node.ml.trainer.tasks import TaskConfig

    flag = "--data" if paths else "data.paths"
    try:
        corpus = load_text_files(files, format=m.data.format, jsonl_field=m.data.jsonl_field,
                                 max_bytes=TaskConfig().max_bytes,
                                 val_fraction=m.data.val_fraction)
    except TrainerError as e:
        raise DataRefused(f"{flag}: {e}") from None
    context = m.model.context
    for split, tensor in (("training", corpus.train), ("validation", corpus.val)):
        n = int(tensor.numel())
        if n <= context:
            total = int(corpus.train.numel() + corpus.val.numel())
            raise DataRefused(
                f"{flag} {', '.join(files)}: {total} bytes leave the {split} split "
                f"{n} bytes, and this run's model reads {context}-byte contexts: give at "
                f"least {_needed(context, m.data.val_fraction)} bytes of text")


def _needed(context: int, val_fraction: float) -> int:
    """About the fewest bytes whose smaller split still exceeds the context."""
    return math.ceil((context + 1) / min(val_fraction, 1.0 - val_fraction)) + 1
