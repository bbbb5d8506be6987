"""The ``backprop`` engine's step: one forward and one backward over the whole sequence.

The forward runs the model piece by piece through its adapter — embeddings, rotary
tables for the whole sequence and its position ids, each decoder layer (with whatever
techniques patched into it: checkpointing, tiled MLPs), final norm — and the loss head
the strategy asks for (stock full logits, or MsT's chunked head). Attention gets the
batch's packed documents and padding as one :class:`~longtrain.models.attention.WholeSequenceAttention`.
"""

from __future__ import annotations

import torch

from ...models.attention import WholeSequenceAttention
from ..base import EngineContext
from ..batch import prepare_batch

__all__ = ["backprop_step", "forward_loss"]


def forward_loss(context: EngineContext, batch, num_label_tokens: int | None = None) -> torch.Tensor:
    """This rank's summed token loss of ``batch`` divided by the step's label count, with
    autograd's graph when gradients are enabled (under sequence parallelism, over this
    rank's tokens, attention seeing them all)."""
    shard = context.shard(prepare_batch(batch, num_label_tokens))
    adapter = context.adapter
    hidden = adapter.embed(shard.input_ids)
    position_embeddings = context.rotary_tables(shard, hidden)
    attention = context.attention(WholeSequenceAttention(shard.mask, shard.rows))
    for layer in adapter.layers:
        hidden = adapter.run_layer(layer, hidden, position_embeddings, attention)
    hidden = adapter.final_norm(hidden)
    return context.head_loss(per_chunk=False)(hidden, shard.targets, shard.num_label_tokens)


def backprop_step(context: EngineContext, batch, num_label_tokens: int | None = None):
    with context.forward_pass():
        loss = forward_loss(context, batch, num_label_tokens)
    loss.backward()
    return context.finish(loss)
