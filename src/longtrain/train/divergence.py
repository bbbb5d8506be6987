"""Stopping a run that diverged: the first step whose loss, gradient norm or weights are
not finite ends the run before anything of it is saved, with one line saying the step,
what was not finite, which checkpoint to continue from (if any) and what to try.

A checkpoint to continue from is one whose weights still trained sanely: the step after
it (from its weights) gave a finite loss and gradient norm, the loss at most twice the
run's first loss plus one. The latest checkpoint is often not one: its weights are the
ones whose loss was not finite (a lower --lr changes the updates, not the loss of given
weights), or already huge after a step with an absurd --lr.

Every rank must take the same decision (one rank stopping alone would leave the others
waiting in a collective), so a flag raised on any rank counts on all.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import LongtrainError
from . import run_checkpoints as ckpt
from .config import TrainConfig, warmup_steps

__all__ = ["any_rank", "continuable", "diverged", "not_finite", "sane"]


def any_rank(ranks, flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (every rank must call it)."""
    return bool(ranks.max(float(flag))) if ranks.distributed else flag


def not_finite(loss: float, grad_norm: float, ranks) -> str | None:
    """What of a step's loss and gradient norm is NaN or infinite (on any rank), or None
    (every rank must call it)."""
    bad_loss = any_rank(ranks, not math.isfinite(loss))
    if bad_loss or not math.isfinite(grad_norm):  # the norm is the same on every rank
        return f"the loss is {loss}" if bad_loss and not math.isfinite(loss) else \
            "the loss is not finite on another rank" if bad_loss else f"the gradient norm is {grad_norm}"
    return None


def sane(record: dict | None, first_loss: float | None) -> bool:
    """Whether a step's metrics ``record`` shows weights that train sanely: a finite loss,
    at most ``2 × first_loss + 1`` (``first_loss``: the run's first step's), and a finite
    gradient norm (a non-finite number is logged as null)."""
    if not record:
        return False
    loss, norm = record.get("loss"), record.get("grad_norm")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return False
    if not isinstance(norm, (int, float)) or not math.isfinite(norm):
        return False
    return first_loss is None or not math.isfinite(first_loss) or loss <= 2 * first_loss + 1


def continuable(checkpoints: Path, records: dict[int, dict]) -> Path | None:
    """The newest checkpoint under ``checkpoints`` that a run can continue from: the step
    after it (``records``: metrics by step) was :func:`sane`. None where none is kept."""
    first = records[min(records)].get("loss") if records else None
    first = first if isinstance(first, (int, float)) else None
    for path in ckpt.checkpoints_on_disk(checkpoints):
        step = ckpt.checkpoint_step(path)
        if step is not None and sane(records.get(step + 1), first):
            return path
    return None


def diverged(what: str, step: int, config: TrainConfig, checkpoints: Path, compute_dtype: torch.dtype,
             records: dict[int, dict] | None = None) -> LongtrainError:
    """One line: the step, what was not finite, which checkpoint to continue from (with
    ``records``, the run's metrics by step: the newest :func:`continuable` one; without,
    the latest) and what to try."""
    c = config
    pointer = checkpoints / ckpt.LATEST
    latest = checkpoints / pointer.read_text().strip() if pointer.is_file() else None
    at = ckpt.checkpoint_step(latest) if latest is not None else None
    good = (latest if at is not None else None) if records is None else continuable(checkpoints, records)
    try_ = f"lower --lr (now {c.lr:g}) or lengthen --warmup-steps (now {warmup_steps(c)})"
    if compute_dtype == torch.float16:
        try_ = "use --dtype bfloat16 or float32 (float16 without loss scaling overflows), or " + try_
    if good is not None and at is not None and good.resolve() == latest.resolve():
        kept = f"{pointer} still names the last good checkpoint (step {at})"
        then = "then continue with --resume"
    elif good is not None:
        last = f"the last checkpoint (step {at}) holds weights that already trained badly; " if at is not None else ""
        kept = f"{last}the newest good checkpoint is {good} (step {ckpt.checkpoint_step(good)})"
        then = f"then continue with --resume-from {good}"
    elif at is not None or ckpt.checkpoints_on_disk(checkpoints):
        kept = ("no checkpoint kept was saved while the run still trained sanely"
                + (f" (the last, step {at}, holds the weights that led here)" if at is not None else ""))
        then = "then start again with --overwrite (or --out NEW_DIR)"
    else:
        kept = "no checkpoint was written"
        then = "then start again"
    return LongtrainError(f"training diverged at step {step}: {what}; nothing of step {step} was saved and {kept}; "
                          f"{try_}, {then}")
