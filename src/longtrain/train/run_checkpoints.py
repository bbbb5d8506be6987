"""Atomic, verified training checkpoints.

A checkpoint is a directory ``step-00000123`` holding the files the trainer writes and
a ``manifest.json`` (sizes and SHA-256 of every file, plus metadata) written last. It
is assembled under a temporary name and renamed into place only when complete, then
the ``latest`` pointer is replaced atomically: a run killed at any instant leaves the
previous checkpoint as the one ``--resume`` uses. Loading verifies the manifest, so a
truncated or altered file is reported instead of silently resumed from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from ..errors import LongtrainError, writing

__all__ = [
    "LATEST",
    "MANIFEST",
    "checkpoint_step",
    "checkpoints_on_disk",
    "latest_checkpoint",
    "newest_valid_checkpoint",
    "remove_leftovers",
    "resolve_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
    "write_text_atomic",
]

MANIFEST = "manifest.json"
LATEST = "latest"
PREFIX = "step-"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent)


def save_checkpoint(root: str | Path, step: int, writers: dict[str, Callable[[Path], None]], meta: dict, keep: int = 2, ranks=None) -> Path:
    """Write a checkpoint for ``step`` under ``root`` atomically and return its path.

    ``writers`` maps file names to functions that write that file at the given path.
    Older checkpoints beyond the newest ``keep`` are removed once the new one is live.
    With several ``ranks`` (:class:`longtrain.train.ranks.Ranks`) every rank writes its
    own files into one temporary directory and rank 0 commits the manifest of all.
    """
    root = Path(root)
    distributed = ranks is not None and ranks.distributed
    commits = not distributed or ranks.main
    name = f"{PREFIX}{step:08d}"
    # Ranks share the temporary name; a lone process adds its pid.
    tmp = root / (f".tmp-{name}" if distributed else f".tmp-{name}-{os.getpid()}")
    # A write that fails (a full disk, a revoked permission) or is interrupted takes its
    # half-written directory with it: the previous checkpoint stays the one to resume from.
    then = "continue with --resume"
    with _discarded_on_failure(tmp), writing(f"checkpoint {name}", root, then):
        if commits:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        if distributed:
            ranks.barrier()
        files = _write_files(tmp, writers)
        if distributed:
            every = ranks.gather(files)
            if not commits:
                ranks.barrier()  # wait for rank 0 to commit
                return root / name
            files = {k: v for rank_files in every for k, v in rank_files.items()}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files, "meta": meta}, indent=1))
        _fsync_path(tmp / MANIFEST)
        _fsync_path(tmp)
    final = root / name
    with writing(f"checkpoint {name}", root, then):
        if final.exists():  # re-saving a step (e.g. after resuming from it): move the old one aside first
            old = root / f".old-{name}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_path(root)
        write_text_atomic(root / LATEST, name)
    _prune(root, keep)
    if distributed:
        ranks.barrier()
    return final


@contextlib.contextmanager
def _discarded_on_failure(tmp: Path):
    """Remove the half-written ``tmp`` if the block fails or is interrupted."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_files(tmp: Path, writers: dict[str, Callable[[Path], None]]) -> dict:
    """Run each writer into ``tmp``; the sizes and checksums for the manifest."""
    files = {}
    for filename, write in writers.items():
        path = tmp / filename
        write(path)
        _fsync_path(path)
        files[filename] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    return files


def remove_leftovers(root: str | Path) -> None:
    """Clear what an interrupted save left under ``root``: half-written ``.tmp-*``
    checkpoints and pointer files go; a complete checkpoint moved aside (``.old-*``) while
    a step was re-saved returns to its place if nothing took it."""
    root = Path(root)
    if not root.is_dir():
        return
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.tmp-*"):
        stale.unlink(missing_ok=True)
    for old in root.glob(f".old-{PREFIX}*"):
        name = old.name[len(".old-"):].rsplit("-", 1)[0]
        if not (root / name).exists():
            os.rename(old, root / name)
        else:
            shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by runs killed mid-write
        shutil.rmtree(stale, ignore_errors=True)


def checkpoint_step(path: str | Path) -> int | None:
    """The step a checkpoint directory holds, from its manifest (None if unreadable)."""
    try:
        return int(json.loads((Path(path) / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_checkpoint(path: str | Path) -> Path:
    """``--resume-from``: a checkpoint directory, or a run directory (or its
    ``checkpoints/``) standing for its latest checkpoint."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    for root in (path / "checkpoints", path):
        if (root / LATEST).is_file():
            return latest_checkpoint(root)
    for root in (path / "checkpoints", path):
        newest = newest_valid_checkpoint(root)
        if newest is not None:  # checkpoints, but no pointer to the latest
            raise LongtrainError(f"--resume-from {path} holds checkpoints but no {LATEST} pointer naming one; the newest "
                                 f"valid one is {newest} (step {checkpoint_step(newest)}): pass --resume-from {newest}")
    raise LongtrainError(f"--resume-from {path} is neither a checkpoint (no {MANIFEST}) nor a run with one "
                         f"(no checkpoints/{LATEST}); pass a run directory or one of its checkpoints/{PREFIX}* directories")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` points to, or None if there is none."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not path.is_dir():
        newest = newest_valid_checkpoint(root)
        fix = (f"the newest valid checkpoint is {newest} (step {checkpoint_step(newest)}): pass --resume-from {newest}"
               if newest is not None else "no other valid checkpoint is there: start again with --overwrite or --out NEW_DIR")
        raise LongtrainError(f"{pointer} names {path.name}, which is missing; {fix}")
    return path


def checkpoints_on_disk(root: str | Path) -> list[Path]:
    """The ``step-*`` directories under ``root`` with a readable manifest, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and (step := checkpoint_step(p)) is not None]
    return [p for _, p in sorted(found, key=lambda pair: pair[0], reverse=True)]


def newest_valid_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under ``root`` whose files match their manifest (whatever
    ``latest`` says), or None: where the pointer was lost, what --resume-from can take."""
    for path in checkpoints_on_disk(root):
        try:
            verify_checkpoint(path)
        except LongtrainError:
            continue
        return path
    return None


def verify_checkpoint(path: str | Path) -> dict:
    """Check every file against the manifest; return the manifest's metadata."""
    path = Path(path)
    fix = f"pass --resume-from with an earlier checkpoint (ls {path.parent})"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise LongtrainError(f"checkpoint {path} is incomplete or corrupt (no readable {MANIFEST}); {fix}") from None
    for filename, expected in files.items():
        file = path / filename
        if not file.is_file():
            raise LongtrainError(f"checkpoint {path} is corrupt: {filename} is missing; {fix}")
        if file.stat().st_size != expected["bytes"] or _sha256(file) != expected["sha256"]:
            raise LongtrainError(f"checkpoint {path} is corrupt: {filename} does not match its checksum; {fix}")
    return manifest.get("meta", {})
