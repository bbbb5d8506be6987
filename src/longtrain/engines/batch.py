"""Batch conventions shared by every engine (Hugging Face's: labels unshifted, -100 ignored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ..errors import LongtrainError

from ..ops.loss import IGNORE_INDEX


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, S) token ids
    attention_mask: torch.Tensor | None  # (B, S) 1 for real tokens, 0 for padding
    labels: torch.Tensor  # (B, S) unshifted targets, IGNORE_INDEX where no loss


def prepare_batch(batch: Mapping) -> Batch:
    """Validate a batch mapping and fill in labels (padding positions get no loss)."""
    if "input_ids" not in batch:
        raise LongtrainError("a batch needs 'input_ids' of shape (batch, seq_len)")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise LongtrainError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
    mask = batch.get("attention_mask")
    if mask is not None and mask.shape != input_ids.shape:
        raise LongtrainError(
            f"attention_mask shape {tuple(mask.shape)} differs from input_ids {tuple(input_ids.shape)}"
        )
    labels = batch.get("labels")
    if labels is None:
        labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    elif labels.shape != input_ids.shape:
        raise LongtrainError(f"labels shape {tuple(labels.shape)} differs from input_ids {tuple(input_ids.shape)}")
    return Batch(input_ids, mask, labels)


def label_token_count(labels: torch.Tensor, num_label_tokens: int | None) -> int:
    """The normalizer of a micro-batch's loss: the caller's count, or this batch's own;
    a clear error when there is nothing to learn from."""
    if num_label_tokens is None:
        num_label_tokens = count_label_tokens(labels)
    if num_label_tokens <= 0:
        raise LongtrainError(
            "the batch has no label tokens (all labels are -100 or padding); "
            "check the data and the attention mask"
        )
    return num_label_tokens


def count_label_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute a loss term: position t predicts labels[t + 1]."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())
