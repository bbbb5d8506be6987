"""What a training step's LM head saw, for the metrics TRL's SFTTrainer logs: per label token
whether the top logit is its target (``mean_token_accuracy``) and the entropy of its
predicted distribution (``entropy``), summed over a step.

The loss ops add a tile's figures while its logits exist (no second pass over them), in
row blocks of at most :data:`ROWS` (two extra blocks of logits, not two extra tiles). Each
label token is counted once per step: an engine that runs the head again on the same tokens
(SeCO's and SpaCO's recomputation after their loss-only first pass) does it under
:func:`paused`. Sums stay tensors: no host sync per tile.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["ROWS", "TokenStats", "active", "counting", "paused"]

ROWS = 256  # logits rows whose entropy is formed at once


class TokenStats:
    """Sums over the label tokens of a step: their count, top-1 hits and entropies."""

    def __init__(self):
        self.tokens: torch.Tensor | int = 0
        self.correct: torch.Tensor | int = 0
        self.entropy: torch.Tensor | int = 0

    @torch.no_grad()
    def add(self, logits: torch.Tensor, lse: torch.Tensor | None, targets: torch.Tensor, valid: torch.Tensor) -> None:
        """A tile's (N, V) ``logits`` (after any scale and soft-cap), their log-sum-exp (N,)
        where known, targets (N,) and which of them carry a label (N,)."""
        if lse is None:
            lse = torch.logsumexp(logits, dim=-1)
        entropy = torch.empty_like(lse)
        for start in range(0, logits.shape[0], ROWS):
            rows = slice(start, start + ROWS)
            probs = (logits[rows] - lse[rows, None]).exp_()
            entropy[rows] = lse[rows] - probs.mul_(logits[rows]).sum(-1)  # −Σ p log p, with log p = z − lse
            del probs
        hit = logits.argmax(-1) == targets
        self.tokens = self.tokens + valid.sum()
        self.correct = self.correct + (hit & valid).sum()
        self.entropy = self.entropy + torch.where(valid, entropy, 0).sum()


_ACTIVE: list[TokenStats | None] = []


@contextlib.contextmanager
def counting(stats: TokenStats | None):
    """Within it, the loss ops add to ``stats`` (None: to nothing)."""
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.pop()


def paused():
    """Within it, the loss ops count nothing (a pass over tokens already counted)."""
    return counting(None)


def active() -> TokenStats | None:
    """The statistics the loss ops add to now, or None."""
    return _ACTIVE[-1] if _ACTIVE else None
