"""What a training step's LM head saw, for the metrics TRL's SFTTrainer logs: per label token
whether the top logit is its target (``mean_token_accuracy``) and the entropy of its
predicted distribution (``entropy``), summed over a step.

The loss ops add a tile's figures while its logits exist (no second pass over them), in
the call that forms the loss's gradients — each label token once per step whatever the
engine (SeCO's first, loss-only pass is not counted). Sums stay tensors: no host sync per tile.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["TokenStats", "active", "counting"]


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
        probs = (logits - lse[:, None]).exp_()
        entropy = lse - (probs * logits).sum(-1)  # −Σ p log p, with log p = z − lse
        del probs
        hit = logits.argmax(-1) == targets
        self.tokens = self.tokens + valid.sum()
        self.correct = self.correct + (hit & valid).sum()
        self.entropy = self.entropy + torch.where(valid, entropy, 0).sum()


_ACTIVE: list[TokenStats] = []


@contextlib.contextmanager
def counting(stats: TokenStats):
    """Within it, the loss ops add to ``stats``."""
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


def active() -> TokenStats | None:
    """The statistics the loss ops add to now, or None."""
    return _ACTIVE[-1] if _ACTIVE else None
