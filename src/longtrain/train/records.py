"""Reading ``--data``: which files a path names, and the records each one holds.

Text files are one document each and ``.jsonl`` files one JSON object per line, read
without any dependency. Everything else ``datasets`` reads locally — ``.json``,
``.parquet``, ``.arrow``, ``.csv`` and folders written by ``save_to_disk`` — goes through
it, imported only when such data is given (plain text training neither needs it nor
waits for it). Only local paths are handed to ``datasets``: nothing is downloaded.

A record comes with where it is (``"line 4 of FILE"``, ``"record 4 of FILE"``), so a bad
one is refused in one line naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import LongtrainError

__all__ = ["Record", "data_sources", "fingerprint", "fingerprint_change", "read_records"]

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
DATASETS_BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}  # suffix -> datasets builder
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes beside its .arrow shards
FORMATS = "text, .jsonl, .json, .parquet, .arrow or .csv files, directories of them, or a folder written by save_to_disk"


@dataclass
class Record:
    """One record: raw text (a whole text file) or a mapping of fields, and where it is."""

    value: str | dict
    where: str  # "line 4 of data.jsonl", "record 4 of chat.parquet", "data.txt"


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    return path.is_dir() and any((path / marker).is_file() for marker in SAVED_MARKERS)


def data_sources(path: Path) -> list[Path]:
    """The files (and saved-dataset folders) ``--data PATH`` names, in a fixed order.

    A directory is walked in sorted order for files of the known suffixes; a folder
    inside it written by ``save_to_disk`` counts as one source, its shards not read twice.
    A single file of another suffix is read as text."""
    if is_saved_dataset(path):
        return [path]
    if path.is_dir():
        sources = _walk(path)
        if not sources:
            raise LongtrainError(f"data directory {path} holds no data files; it takes {FORMATS}")
        return sources
    if not path.exists():
        raise LongtrainError(f"data file {path} does not exist; pass {FORMATS}")
    return [path]


def _walk(root: Path) -> list[Path]:
    known = TEXT_SUFFIXES | JSONL_SUFFIXES | DATASETS_BUILDERS.keys()
    sources = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        here = Path(folder)
        for name in list(dirs):
            if is_saved_dataset(here / name):
                sources.append(here / name)
                dirs.remove(name)
        sources += [here / f for f in sorted(files) if Path(f).suffix.lower() in known]
    return sorted(sources)


def uses_datasets(path: Path) -> bool:
    """Whether reading ``path`` needs the ``datasets`` library."""
    return path.is_dir() or path.suffix.lower() in DATASETS_BUILDERS


def read_records(path: Path) -> Iterator[Record]:
    """The records of one source: a text file is one, a record file one per row. An
    empty or unreadable record file is refused in one line naming it."""
    if uses_datasets(path):
        yield from _dataset_records(path)
    elif path.suffix.lower() in JSONL_SUFFIXES:
        yield from _jsonl_records(path)
    else:
        yield Record(_read_text(path), str(path))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark is no text
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise LongtrainError(f"cannot read data file {path}: {reason}") from None


def _jsonl_records(path: Path) -> Iterator[Record]:
    count = 0
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise LongtrainError(f"line {number} of {path} is not valid JSON; each line must be an object with a "
                                 "'text', 'messages' or 'prompt'/'completion' field") from None
        if not isinstance(record, dict):
            raise LongtrainError(f"line {number} of {path} is not a JSON object; each line must be an object with a "
                                 "'text', 'messages' or 'prompt'/'completion' field")
        count += 1
        yield Record(record, f"line {number} of {path}")
    if count == 0:
        raise LongtrainError(f"data file {path} holds no records; remove it or fill it")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise LongtrainError("reading .json, .parquet, .arrow, .csv and save_to_disk data needs the datasets library: "
                             "pip install datasets") from None
    return datasets


@contextlib.contextmanager
def _quiet(datasets):
    """``datasets`` without its progress bars and log lines: a bad file is reported in
    one line of ours."""
    verbosity = datasets.logging.get_verbosity()
    bars = not datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its readers log a bad file's error before raising it
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _dataset_records(path: Path) -> Iterator[Record]:
    """Rows of a record file or saved dataset, read by ``datasets`` (streamed from a
    file: nothing is copied into a cache)."""
    if path.is_file() and path.stat().st_size == 0:
        raise LongtrainError(f"data file {path} holds no records; remove it or fill it")
    datasets = _datasets()
    count = 0
    try:
        with _quiet(datasets):
            rows = _saved_rows(datasets, path) if path.is_dir() else datasets.load_dataset(
                DATASETS_BUILDERS[path.suffix.lower()], data_files=str(path.resolve()), split="train", streaming=True)
            for count, row in enumerate(rows, start=1):
                yield Record(row, f"record {count} of {path}")
    except LongtrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow, pandas and datasets each raise their own kinds
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        after = f" after record {count}" if count else ""
        raise LongtrainError(f"cannot read data file {path}{after} ({reason}); check that it is a valid "
                             f"{path.suffix or 'save_to_disk'} file") from None
    if count == 0:
        raise LongtrainError(f"data file {path} holds no records; remove it or fill it")


def _saved_rows(datasets, path: Path):
    """A ``save_to_disk`` folder's rows: a Dataset's, or a DatasetDict's ``train`` split
    (or its only split)."""
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        splits = list(saved)
        if "train" not in saved and len(splits) != 1:
            raise LongtrainError(f"data folder {path} holds the splits {', '.join(splits)} but no 'train'; "
                                 "pass --data the split's own folder")
        saved = saved["train" if "train" in saved else splits[0]]
    return saved


_SAMPLE = 1 << 20  # bytes hashed at each end of a file


def _files(path: Path) -> list[Path]:
    """The files --data PATH is read from: each source, a save_to_disk folder's files all."""
    files = []
    for source in data_sources(path):
        files += sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    return files


def fingerprint(path: str | Path) -> dict:
    """What ``--data PATH`` holds, cheaply enough for data of many GB: for each file it is
    read from (a ``save_to_disk`` folder's files all), its path relative to PATH, its size
    and the SHA-256 of its first and last MiB (the whole file up to 2 MiB), all hashed
    together. A file added, removed, renamed or resized, or changed within its first or
    last MiB, changes it; an edit that keeps the size inside a larger file's middle does
    not, and neither does a new modification time alone (a copy of the same data).
    ``{"files": n, "bytes": total, "sha256": hex}``, kept in each checkpoint: a resume on
    other data is refused."""
    path = Path(path)
    root = path if path.is_dir() else path.parent
    digest, total, files = hashlib.sha256(), 0, _files(path)
    for file in files:
        try:
            size = file.stat().st_size
            with open(file, "rb") as f:
                head = f.read(_SAMPLE if size > 2 * _SAMPLE else size)
                if size > 2 * _SAMPLE:
                    f.seek(size - _SAMPLE)
                    head += f.read(_SAMPLE)
        except OSError as exc:
            raise LongtrainError(f"cannot read data file {file}: {exc.strerror or exc}") from None
        digest.update(f"{file.relative_to(root).as_posix()}\0{size}\0".encode())
        digest.update(hashlib.sha256(head).digest())
        total += size
    return {"files": len(files), "bytes": total, "sha256": digest.hexdigest()}


def fingerprint_change(then: dict, now: dict) -> str:
    """How two fingerprints differ, in words: "1 file of 2,800 bytes then, 1 file of 3,000 bytes now"."""
    def size(fp: dict) -> str:
        n = fp.get("files", 0)
        return f"{n} file{'' if n == 1 else 's'} of {fp.get('bytes', 0):,} bytes"

    if (then.get("files"), then.get("bytes")) == (now.get("files"), now.get("bytes")):
        return f"the same {size(now)}, but other names or contents"
    return f"{size(then)} then, {size(now)} now"
