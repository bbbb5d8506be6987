"""The run directory (``--out``): whether it can take this run, and making it ready.

A run refuses an ``--out`` it would damage (a path through a file, a run it neither
resumes nor replaces) before the model is built, touching nothing; only once the model
and data are known to be good does it create and lock the directory, look again (a run
may have ended there meanwhile) and clear what interrupted writes left. The lock itself
is :mod:`longtrain.train.lock`'s, the checkpoint files :mod:`longtrain.train.run_checkpoints`'s.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..errors import LongtrainError, writing
from . import run_checkpoints as ckpt
from .config import TrainConfig
from .lock import RunLock

__all__ = ["check_output_dir", "checkpoints_dir", "prepare_output_dir"]


def checkpoints_dir(out: Path) -> Path:
    """Where a run in ``out`` keeps its checkpoints."""
    return out / "checkpoints"


def check_output_dir(out: Path, config: TrainConfig) -> None:
    """Refuse an --out that cannot take this run, touching nothing: a path through a
    file, or a run with a checkpoint (or a final model) that this command neither
    resumes nor replaces. A start that stopped before its first checkpoint has
    nothing to continue: it is simply started again."""
    c = config
    checkpoints = checkpoints_dir(out)
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise LongtrainError(f"--out {out} cannot be a run directory: {blocker} is a file; pass --out a directory path")
    if c.overwrite:
        return
    latest = (checkpoints / ckpt.LATEST).is_file()
    if latest and not (c.resume or c.resume_from):
        step = ckpt.checkpoint_step(checkpoints / (checkpoints / ckpt.LATEST).read_text().strip())
        at = f"step {step}" if step is not None else "unreadable"
        raise LongtrainError(f"{out} already holds a run (last checkpoint: {at}); pass --resume to continue it, "
                             "--out NEW_DIR to start another beside it, or --overwrite to replace it")
    if not latest and not c.resume_from and ckpt.checkpoints_on_disk(checkpoints):
        # Checkpoints without the pointer to the latest: never started over them.
        newest = ckpt.newest_valid_checkpoint(checkpoints)
        if newest is None:
            raise LongtrainError(f"{out} holds checkpoints, none of them complete, and no {checkpoints / ckpt.LATEST}; "
                                 "pass --out NEW_DIR to start another run beside it, or --overwrite to replace it")
        others = "" if c.resume else ", --out NEW_DIR to start another run beside it, or --overwrite to replace it"
        raise LongtrainError(f"{out} holds checkpoints but no {checkpoints / ckpt.LATEST} naming the one to continue from; "
                             f"the newest valid one is {newest} (step {ckpt.checkpoint_step(newest)}): pass --resume-from "
                             f"{newest}{' instead of --resume' if c.resume else ''} to continue from it{others}")
    if (out / "final").exists() and not latest and not c.resume_from:
        raise LongtrainError(f"{out} holds a trained model (final/) but no checkpoint to continue from; "
                             "pass --out NEW_DIR, or --overwrite to replace it")


def prepare_output_dir(out: Path, config: TrainConfig, lock: RunLock) -> None:
    """Create --out and lock it (another run holding it is refused), check again what
    it holds (a run may have ended there since the first look), check it takes files,
    and clear what interrupted saves left. Rank 0's to call."""
    with writing("the run directory", out):
        out.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        check_output_dir(out, config)
        if config.overwrite:
            for child in ("checkpoints", "metrics.jsonl", "metrics.png", "summary.json", "final", "tensorboard"):
                path = out / child
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        tempfile.TemporaryFile(dir=out).close()  # writable? better now than at the first checkpoint
        ckpt.remove_leftovers(checkpoints_dir(out))
        for stale in [*out.glob(".*.tmp-*"), *out.glob(".final.old-*")]:  # interrupted atomic writes
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
