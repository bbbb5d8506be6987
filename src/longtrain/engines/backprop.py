"""The ``backprop`` engine: one forward and one backward over the whole sequence.

Memory-saving techniques (checkpointing, mini-sequence ops, chunked attention) act
inside the model; this engine only decides what the loss is normalized by.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.head import lm_loss
from ..registry import register_engine
from .batch import label_token_count, prepare_batch


@dataclass
class BackpropOptions:
    """Plain autograd has no knobs."""


def forward_loss(model, batch, num_label_tokens: int | None):
    """Forward pass returning the summed token loss divided by ``num_label_tokens``."""
    inputs = prepare_batch(batch)
    num_label_tokens = label_token_count(inputs.labels, num_label_tokens)
    return lm_loss(model, inputs.input_ids, inputs.attention_mask, inputs.labels, num_label_tokens)


@register_engine("backprop", BackpropOptions, "plain autograd over the whole sequence")
def backprop_step(model, batch, options: BackpropOptions, num_label_tokens: int | None = None):
    loss = forward_loss(model, batch, num_label_tokens)
    loss.backward()
    return loss.detach()
