"""Causal language-model loss on full logits (the stock path; MsT replaces it with a
chunked head + loss that never materializes the logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .token_stats import active

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "logits_loss", "shift_labels"]

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with positions: position t predicts labels[t + 1]; the last
    position gets IGNORE_INDEX. Shifting labels (not logits) avoids copying the logits."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def logits_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    num_label_tokens: int | torch.Tensor,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Sum of cross-entropies of ``logits`` (..., V) against position-aligned ``targets``
    (already shifted; IGNORE_INDEX where no loss) divided by ``num_label_tokens``.

    The logits are multiplied by ``logit_scale`` and soft-capped ``c·tanh(z/c)`` first,
    as the heads of Granite/Cohere and Gemma-2 do. Half-precision logits are upcast to
    float32 (as Hugging Face does); float32 and float64 are used as they are, so
    float64 checks stay float64.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    flat, targets = logits.flatten(0, -2), targets.to(logits.device).flatten()
    stats = active()
    if stats is not None:  # TRL's training metrics (token_stats)
        valid = targets != IGNORE_INDEX
        stats.add(flat.detach(), None, torch.where(valid, targets, 0), valid)
    total = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / num_label_tokens


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_label_tokens: int | torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies of unshifted ``labels`` divided by ``num_label_tokens``."""
    return logits_loss(logits, shift_labels(labels), num_label_tokens)
