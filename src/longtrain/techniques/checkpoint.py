"""``checkpoint``: per-layer activation checkpointing (non-reentrant).

Each decoder block keeps only its input during the forward pass and recomputes its
internals in the backward pass. We patch the block's ``forward`` on the instance rather
than wrapping the module, so parameter names (and therefore checkpoints and LoRA
targets) are unchanged, and so it works for any model whose blocks
:func:`~longtrain.models.layers.decoder_layers` can find, not only Hugging Face ones.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..models.layers import decoder_layers, unwrap
from ..registry import register_technique
from .chunked_attention import PIPELINE_ATTR


@dataclass
class CheckpointOptions:
    """Layer checkpointing has no knobs: every decoder block is checkpointed."""


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to save, run plainly
        return forward(*args, **kwargs)
    # Non-reentrant: works with keyword arguments, frozen inputs (LoRA) and nested
    # autograd, and lets the recomputation stop early once the saved tensors exist.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@register_technique("checkpoint", CheckpointOptions, "per-layer activation checkpointing", order=50)
def install_checkpoint(model, options: CheckpointOptions) -> None:
    if getattr(model, PIPELINE_ATTR, None) is not None:
        return  # chunked attention already recomputes every layer, chunk by chunk
    for layer in decoder_layers(model):
        layer.forward = functools.partial(_checkpointed_forward, layer.forward)
    config = getattr(unwrap(model), "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # a KV cache is useless in training and costs memory
