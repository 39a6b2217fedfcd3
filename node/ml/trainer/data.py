"""Byte-level text data: the default corpus, the user's own files, and a batch sampler.

The default corpus is the installed CPython standard library's own `.py` sources (about
11.8 MB without the test suites, per the team's stack notes, section 4): it is on every machine
that runs peertrain, needs no download, and is real text a byte-level model learns visibly
in a few hundred steps.

Every choice here is a pure function of file names and bytes, never of directory listing
order, Python's salted `hash()` or the clock, so two peers with the same files build the
same train/validation split:

- documents (a file, or one record of a JSONL file) are named by their path relative to
  the corpus root, in POSIX form;
- the split is by document: a document is in validation when the SHA-256 of its name,
  read as a number in [0, 1), is below `val_fraction`;
- the byte cap (`max_bytes`) is applied after the split, to each side in proportion
  (validation gets `val_fraction` of it); each side takes its documents in the order of a
  second, differently salted hash of their names (a representative sample, not the
  alphabetically first packages) and truncates the last one it takes;
- each split is its documents' bytes concatenated in name order.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .errors import DataError

DEFAULT_MAX_BYTES = 8_000_000
"""Cap on the default corpus: about 0.15 s to read, and still ~1,000 files."""

DEFAULT_VAL_FRACTION = 0.05

# Directory names never taken from the standard library: its own test suites (a third of
# its bytes, much of it generated data) and whatever pip installed next to it.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


@dataclass(frozen=True, slots=True)
class Document:
    """One unit of the train/validation split: a file, or one record of a JSONL file."""

    name: str
    data: bytes


@dataclass(frozen=True, slots=True)
class Corpus:
    """A byte corpus split into train and validation, each a 1-D uint8 tensor.

    `split` is "document" normally; "bytes" when splitting by document would leave one side
    empty (a single file, say) and the last `val_fraction` of the bytes became validation.
    """

    train: torch.Tensor
    val: torch.Tensor
    train_names: tuple[str, ...]
    val_names: tuple[str, ...]
    split: Literal["document", "bytes"]
    source: str

    def statistics(self) -> dict[str, object]:
        return {
            "source": self.source,
            "split": self.split,
            "train_bytes": int(self.train.numel()),
            "val_bytes": int(self.val.numel()),
            "train_documents": len(self.train_names),
            "val_documents": len(self.val_names),
        }


def unit_hash(name: str, salt: str = "split") -> float:
    """A stable number in [0, 1) from a name: SHA-256 (not Python's per-process `hash()`)."""
    digest = hashlib.sha256(f"peertrain/{salt}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_validation(name: str, val_fraction: float) -> bool:
    return unit_hash(name, "split") < val_fraction


# --------------------------------------------------------------------------------------------
# The default corpus: the standard library's sources


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Sorted POSIX paths, relative to `root`, of the stdlib's `.py` files minus test suites."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise DataError("standard library directory not found", path=str(root))
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        for filename in filenames:
            if filename.endswith(".py"):
                found.append(Path(dirpath, filename).relative_to(root).as_posix())
    return sorted(found)


def load_stdlib_corpus(
    *,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    root: Path | None = None,
) -> Corpus:
    """The default corpus; see the module docstring for how it is chosen and split."""
    root = stdlib_root() if root is None else Path(root)
    names = stdlib_files(root)
    sizes = {name: (root / name).stat().st_size for name in names}
    return build_corpus(
        sizes,
        lambda name: _read(root / name),
        val_fraction=val_fraction,
        max_bytes=max_bytes,
        source=f"stdlib:{root}",
    )


# --------------------------------------------------------------------------------------------
# The user's own files


def load_text_files(
    paths: Sequence[str | os.PathLike[str]],
    format: Literal["text", "jsonl"] = "text",
    jsonl_field: str = "text",
    *,
    max_bytes: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> Corpus:
    """Load the user's files as a byte corpus.

    `format="text"`: each file is one document, used byte for byte (no decoding).
    `format="jsonl"`: each non-blank line is a JSON object whose `jsonl_field` is a string;
    each record is one document, encoded as UTF-8.
    A directory stands for every regular, non-hidden file below it, in sorted order.
    Raises `DataError` naming the file (and line) for anything unusable.
    """
    if format not in ("text", "jsonl"):
        raise DataError(f"unknown data format {format!r}; use 'text' or 'jsonl'")
    files = _expand(paths)
    if not files:
        raise DataError("no data files given")
    root = _common_root(files)
    docs: list[Document] = []
    for file in files:
        rel = file.relative_to(root).as_posix()
        raw = _read(file)
        if format == "text":
            docs.append(Document(rel, raw))
        else:
            docs.extend(_jsonl_documents(raw, rel, str(file), jsonl_field))
    by_name = {d.name: d.data for d in docs}
    return build_corpus(
        {name: len(data) for name, data in by_name.items()},
        by_name.__getitem__,
        val_fraction=val_fraction,
        max_bytes=max_bytes,
        source=", ".join(str(p) for p in paths),
    )


def _expand(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            below = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not below:
                raise DataError("directory holds no files", path=str(path))
            files.extend(below)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise DataError("not a regular file", path=str(path))
        else:
            raise DataError("no such file", path=str(path))
    return list(dict.fromkeys(p.resolve() for p in files))  # same file twice: once


def _common_root(files: Sequence[Path]) -> Path:
    if len(files) == 1:
        return files[0].parent
    return Path(os.path.commonpath([str(f) for f in files]))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read: {exc.strerror or exc}", path=str(path)) from exc


def _jsonl_documents(raw: bytes, name: str, path: str, field: str) -> list[Document]:
    docs = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"not valid JSON ({exc})", path=path, line=lineno) from exc
        if not isinstance(record, dict):
            raise DataError(
                f"expected a JSON object, got {type(record).__name__}", path=path, line=lineno
            )
        if field not in record:
            raise DataError(f"record has no field {field!r}", path=path, line=lineno)
        text = record[field]
        if not isinstance(text, str):
            raise DataError(
                f"field {field!r} is {type(text).__name__}, not a string", path=path, line=lineno
            )
        docs.append(Document(f"{name}:{lineno}", text.encode("utf-8")))
    return docs


# --------------------------------------------------------------------------------------------
# Split and cap


def build_corpus(
    sizes: Mapping[str, int],
    read: Callable[[str], bytes],
    *,
    val_fraction: float,
    max_bytes: int | None,
    source: str,
) -> Corpus:
    """Split documents (named in `sizes`, fetched by `read`) into train and validation.

    Split first, cap second, so the split stays by document at any cap: validation takes
    up to `max_bytes * val_fraction` bytes of its documents, train the rest of the cap.
    Only documents that are needed are read. Falls back to a byte split ("bytes") when
    every document hashed to the same side (one file, say).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_bytes is not None and max_bytes < 2:
        raise DataError(f"max_bytes must be at least 2, got {max_bytes}")
    names = sorted(name for name, size in sizes.items() if size > 0)
    if not names:
        raise DataError(f"empty corpus: no bytes in {source}")
    val = [name for name in names if is_validation(name, val_fraction)]
    train = [name for name in names if not is_validation(name, val_fraction)]
    if train and val:
        val_cap = None if max_bytes is None else max(1, round(max_bytes * val_fraction))
        val_taken = _take_within_cap(val, sizes, val_cap)
        val_bytes = sum(keep for _, keep in val_taken)
        train_cap = None if max_bytes is None else max_bytes - val_bytes
        train_taken = _take_within_cap(train, sizes, train_cap)
        return Corpus(
            train=_concat(train_taken, read),
            val=_concat(val_taken, read),
            train_names=tuple(sorted(name for name, _ in train_taken)),
            val_names=tuple(sorted(name for name, _ in val_taken)),
            split="document",
            source=source,
        )
    taken = _take_within_cap(names, sizes, max_bytes)
    everything = _concat(taken, read)
    cut = max(1, min(len(everything) - 1, round(len(everything) * (1.0 - val_fraction))))
    used = tuple(sorted(name for name, _ in taken))
    return Corpus(
        train=everything[:cut],
        val=everything[cut:],
        train_names=used,
        val_names=used,
        split="bytes",
        source=source,
    )


def _take_within_cap(
    names: Sequence[str], sizes: Mapping[str, int], max_bytes: int | None
) -> list[tuple[str, int]]:
    """(name, bytes to keep) for the documents under the cap, chosen in hash order; the
    last one taken is truncated so the cap is met exactly."""
    if max_bytes is None:
        return [(name, sizes[name]) for name in names]
    taken, total = [], 0
    for name in sorted(names, key=lambda n: (unit_hash(n, "cap"), n)):
        if total >= max_bytes:
            break
        keep = min(sizes[name], max_bytes - total)
        taken.append((name, keep))
        total += keep
    return taken


def _concat(taken: Sequence[tuple[str, int]], read: Callable[[str], bytes]) -> torch.Tensor:
    """The documents' bytes, in name order, as one uint8 tensor."""
    return _as_tensor([read(name)[:keep] for name, keep in sorted(taken)])


def _as_tensor(chunks: Sequence[bytes]) -> torch.Tensor:
    joined = b"".join(chunks)
    # bytearray: torch.frombuffer wants a writable buffer, and this copy is the only one.
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else _EMPTY


_EMPTY = torch.zeros(0, dtype=torch.uint8)


# --------------------------------------------------------------------------------------------
# Batches


def get_batch(
    data: torch.Tensor, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows of a byte tensor: inputs and next-byte targets, int64 (B, T).

    Deterministic given the generator's state; uses only that generator, never the global RNG.
    """
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
    if data.numel() <= context:
        raise DataError(f"split has {data.numel()} bytes; needs more than the context ({context})")
    windows = data.unfold(0, context + 1, 1)  # a view: (N - context, context + 1)
    ix = torch.randint(windows.shape[0], (batch_size,), generator=generator)
    chunk = windows[ix].long()
    return chunk[:, :-1], chunk[:, 1:]
