"""The ``backprop`` engine: one forward and one backward over the whole sequence.

Memory-saving techniques (checkpointing, mini-sequence ops, chunked attention) act
inside the model; this engine only decides what the loss is normalized by.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LongtrainError
from ..models.head import lm_loss
from ..registry import register_engine
from .batch import count_label_tokens, prepare_batch


@dataclass
class BackpropOptions:
    """Plain autograd has no knobs."""


def forward_loss(model, batch, num_label_tokens: int | None):
    """Forward pass returning the summed token loss divided by ``num_label_tokens``."""
    inputs = prepare_batch(batch)
    if num_label_tokens is None:
        num_label_tokens = count_label_tokens(inputs.labels)
    if num_label_tokens <= 0:
        raise LongtrainError(
            "the batch has no label tokens (all labels are -100 or padding); "
            "check the data and the attention mask"
        )
    return lm_loss(model, inputs.input_ids, inputs.attention_mask, inputs.labels, num_label_tokens)


@register_engine("backprop", BackpropOptions, "plain autograd over the whole sequence")
def backprop_step(model, batch, options: BackpropOptions, num_label_tokens: int | None = None):
    loss = forward_loss(model, batch, num_label_tokens)
    loss.backward()
    return loss.detach()
