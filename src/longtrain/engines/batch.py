"""A micro-batch as every engine sees it (Hugging Face's conventions: labels unshifted,
-100 ignored), with its masking settled once.

``prepare_batch`` validates the mapping and derives, once per step:

- the targets (labels shifted once: position t predicts labels[t + 1]);
- the position ids (given, or 0…S−1) and, when they restart inside a row, the packed
  documents (:func:`~longtrain.ops.masking.segments_from_positions`), so attention
  stays inside each document on every path;
- the padding keys attention must skip. Right padding whose positions carry no target
  is left unmasked: under a causal mask no real token ever sees a later position, so
  such padding is a dead end that changes no loss and no gradient, and attention keeps
  its fast unmasked kernels. Any other padding (left, or with targets on it) is masked.

Deciding this reads a few flags from the device once per step; under fake tensors
(simulation) nothing can be read and masks are kept, which never underestimates memory.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Mapping

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import LongtrainError
from ..ops.loss import IGNORE_INDEX, shift_labels
from ..ops.masking import SequenceMask, segments_from_positions

__all__ = ["PreparedBatch", "Shard", "prepare_batch", "shard_sequence", "count_label_tokens"]


@dataclass
class PreparedBatch:
    """A validated micro-batch (:func:`prepare_batch`); B rows of S tokens."""

    input_ids: torch.Tensor  # (B, S) token ids
    labels: torch.Tensor  # (B, S) unshifted targets, IGNORE_INDEX where no loss
    targets: torch.Tensor  # (B, S) labels shifted: what each position predicts
    position_ids: torch.Tensor  # (B, S) or (1, S)
    mask: SequenceMask  # packed documents and the padding attention must skip
    num_label_tokens: int  # the loss normalizer
    count_given: bool = False  # the caller passed num_label_tokens (else this batch's own count)
    rows: torch.Tensor | None = None  # (B, S) the attention mask as given: 1 real token, 0 padding (None: all real)

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


def _check_shape(name: str, tensor, input_ids: torch.Tensor, rows_may_broadcast: bool = False) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise LongtrainError(f"{name} must be a tensor, got {type(tensor).__name__}")
    ok = tensor.shape == input_ids.shape or (rows_may_broadcast and tensor.shape == (1, input_ids.shape[1]))
    if not ok:
        raise LongtrainError(f"{name} shape {tuple(tensor.shape)} differs from input_ids {tuple(input_ids.shape)}")


def prepare_batch(batch: Mapping, num_label_tokens: int | None = None) -> PreparedBatch:
    """Validate a batch mapping (``input_ids`` and optional ``attention_mask``,
    ``labels``, ``position_ids``) and settle its masking; see the module docstring."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise LongtrainError("a batch is a mapping with 'input_ids' of shape (batch, seq_len)")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise LongtrainError(f"input_ids must be a (batch, seq_len) tensor, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise LongtrainError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_shape("attention_mask", mask, input_ids)
    labels = batch.get("labels")
    if labels is None:
        labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    else:
        _check_shape("labels", labels, input_ids)
    positions = batch.get("position_ids")
    if positions is not None:
        _check_shape("position_ids", positions, input_ids, rows_may_broadcast=True)
    targets = shift_labels(labels)
    count = label_token_count(targets, num_label_tokens)
    seq_mask, positions = _settle_masking(input_ids, mask, targets, positions)
    return PreparedBatch(input_ids, labels, targets, positions, seq_mask, count, num_label_tokens is not None, mask)


def _settle_masking(input_ids, attention_mask, targets, position_ids):
    segments = None
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    else:
        segments = segments_from_positions(position_ids.expand(input_ids.shape[0], -1))
    valid = None if attention_mask is None else attention_mask.bool()
    if is_fake(input_ids):
        return SequenceMask(segments, valid), position_ids
    flags = [torch.zeros((), dtype=torch.bool, device=input_ids.device)] * 3
    if segments is not None:
        flags[0] = (segments[:, -1] != 0).any()  # a document restarts somewhere
    if valid is not None:
        right_padded = (valid[:, 1:] <= valid[:, :-1]).all() & valid[:, 0].all()
        dead_ends = right_padded & (targets.masked_select(~valid) == IGNORE_INDEX).all()
        flags[1], flags[2] = ~valid.all(), ~dead_ends
    packed, padded, pads_matter = torch.stack(flags).tolist()  # one host read
    return SequenceMask(segments if packed else None, valid if padded and pads_matter else None), position_ids


def label_token_count(targets: torch.Tensor, num_label_tokens: int | None) -> int:
    """The normalizer of a micro-batch's loss: the caller's count, or this batch's own;
    a clear error when there is nothing to learn from."""
    if num_label_tokens is None:
        if is_fake(targets):
            raise LongtrainError("pass num_label_tokens when stepping on fake tensors (the count cannot be read)")
        num_label_tokens = int((targets != IGNORE_INDEX).sum())
    elif isinstance(num_label_tokens, bool) or not isinstance(num_label_tokens, numbers.Integral):
        raise LongtrainError(f"num_label_tokens must be an integer count of label tokens, got {num_label_tokens!r}")
    elif num_label_tokens <= 0:
        raise LongtrainError(f"num_label_tokens={num_label_tokens} divides the loss: pass the positive count of the "
                             "step's label tokens, or leave it out (this micro-batch's own count)")
    num_label_tokens = int(num_label_tokens)
    if num_label_tokens <= 0:
        raise LongtrainError(
            "the batch has no label tokens (all labels are -100 or padding); "
            "check the data and the attention mask"
        )
    return num_label_tokens


def count_label_tokens(labels: torch.Tensor) -> int:
    """Tokens of unshifted ``labels`` that contribute a loss term: position t predicts labels[t + 1]."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


@dataclass
class Shard:
    """The tokens this rank computes on — the whole sequence without sequence parallelism —
    and what attention, which sees the whole sequence, needs."""

    input_ids: torch.Tensor  # (B, S_local) this rank's tokens
    targets: torch.Tensor  # (B, S_local) what each of them predicts (shifted on the whole sequence)
    position_ids: torch.Tensor  # (B or 1, S_local) their global positions
    mask: SequenceMask  # documents and padding of the whole (padded) sequence
    num_label_tokens: int  # the loss normalizer of the whole step
    rotary_positions: torch.Tensor  # position ids of the whole (padded) sequence: the rotary tables' input
    local_index: torch.Tensor | None = None  # this rank's tokens among the padded sequence (None: all of them)
    attention_bounds: list[tuple[int, int]] | None = None  # the token ranges attention sees at once per chunk
    rows: torch.Tensor | None = None  # (B, S_local) 1 for this rank's real tokens, 0 for padding (None: all real)

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def local(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's rows (dim 1) of a table over the whole padded sequence."""
        return table if self.local_index is None else table[:, self.local_index]


def shard_sequence(seq: PreparedBatch, sp=None, chunk: int | None = None, rank: int | None = None) -> Shard:
    """This rank's :class:`Shard` of ``seq``: all of it without sequence parallelism
    (``sp`` None); otherwise ``sp``'s layout (contiguous shards, or global chunks
    r, r+P, … of ``chunk`` tokens), after padding the sequence at its end to fill the
    layout with tokens that carry no loss — a dead end no real token attends to."""
    if sp is None:
        return Shard(seq.input_ids, seq.targets, seq.position_ids, seq.mask, seq.num_label_tokens, seq.position_ids,
                     rows=seq.rows)
    layout = sp.layout(seq.length, chunk)
    pad = layout.padded - seq.length
    positions, segments, valid = seq.position_ids, seq.mask.segments, seq.mask.key_valid
    input_ids = torch.nn.functional.pad(seq.input_ids, (0, pad))
    targets = torch.nn.functional.pad(seq.targets, (0, pad), value=IGNORE_INDEX)
    if pad:
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)], dim=1)
        if segments is not None:  # the padding joins the last document
            segments = torch.cat([segments, segments[:, -1:].expand(-1, pad)], dim=1)
        if valid is not None:
            valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    rows = seq.rows
    if pad:  # the layout's padding is no token of the batch
        rows = torch.ones_like(seq.input_ids) if rows is None else rows
        rows = torch.nn.functional.pad(rows, (0, pad), value=0)
    index = layout.local_positions(sp.rank, device=input_ids.device)
    bounds = layout.gathered_bounds() if chunk is not None else None
    return Shard(input_ids[:, index], targets[:, index], positions[:, index], SequenceMask(segments, valid),
                 seq.num_label_tokens, positions, index, bounds, None if rows is None else rows[:, index])
