"""What ``memo`` runs: every decoder layer's ``forward`` patched to run through
:class:`~longtrain.techniques.memo.layers.MemoLayers` while gradients are enabled
(evaluation saves nothing, so it runs the layer as it is)."""

from __future__ import annotations

import functools

import torch

from ...errors import LongtrainError
from .layers import MemoLayers
from .options import MemoOptions


def _memo_forward(memo: MemoLayers, index: int, layer, layer_forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing is saved
        return layer_forward(*args, **kwargs)
    return memo.forward(index, layer, layer_forward, args, kwargs)


def install_memo(context, options: MemoOptions) -> None:
    adapter = context.adapter
    if not adapter.has_attention:
        raise LongtrainError("memo keeps attention outputs; this model has no attention (use the adjoint engine)")
    if adapter.description.is_moe and options.alpha != 1:
        raise LongtrainError("memo recomputes part of each layer's tokens, and a mixture of experts saves its "
                             "activations in groups of tokens routed to each expert, not token by token; use "
                             "memo:alpha=1 (every activation swapped, nothing recomputed) or checkpoint")
    memo = MemoLayers(context, options)
    for index, layer in enumerate(adapter.layers):
        layer.forward = functools.partial(_memo_forward, memo, index, layer, layer.forward)
