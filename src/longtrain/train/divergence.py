"""Stopping a run that diverged: the first step whose loss, gradient norm or weights are
not finite ends the run before anything of it is saved, with one line saying the step,
what was not finite, which checkpoint is kept and what to try.

Every rank must take the same decision (one rank stopping alone would leave the others
waiting in a collective), so a flag raised on any rank counts on all.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import LongtrainError
from . import checkpoint as ckpt
from .config import TrainConfig

__all__ = ["any_rank", "diverged", "not_finite"]


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


def diverged(what: str, step: int, config: TrainConfig, checkpoints: Path, compute_dtype: torch.dtype) -> LongtrainError:
    """One line: the step, what was not finite, what was kept and what to try."""
    c = config
    pointer = checkpoints / ckpt.LATEST
    at = ckpt.checkpoint_step(checkpoints / pointer.read_text().strip()) if pointer.is_file() else None
    kept = (f"{pointer} still names the last good checkpoint (step {at})" if at is not None
            else "no checkpoint was written")
    try_ = f"lower --lr (now {c.lr:g}) or lengthen --warmup-steps (now {c.warmup_steps})"
    if compute_dtype == torch.float16:
        try_ = "use --dtype bfloat16 or float32 (float16 without loss scaling overflows), or " + try_
    then = "then continue with --resume" if at is not None else "then start again"
    return LongtrainError(f"training diverged at step {step}: {what}; nothing of step {step} was saved and {kept}; "
                          f"{try_}, {then}")
