"""The learning-rate schedule: linear warm-up, then cosine decay to 10% of --lr at --steps.

One definition for the scheduler a run starts with and the one a resumed run rebuilds
at its checkpoint's step, so both follow the same rule.
"""

from __future__ import annotations

import math

import torch

from .config import TrainConfig, warmup_steps

__all__ = ["WarmupCosine", "make_scheduler"]


class WarmupCosine:
    """Linear warm-up then cosine decay to 10% (a picklable LambdaLR factor)."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_scheduler(optimizer, config: TrainConfig, last_epoch: int = -1) -> torch.optim.lr_scheduler.LambdaLR:
    """``optimizer``'s schedule under ``config`` (--warmup-steps, --steps), at step
    ``last_epoch + 1`` (a resumed run sets each group's ``initial_lr`` first)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps(config), config.steps), last_epoch=last_epoch)
