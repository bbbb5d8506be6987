"""``checkpoint``: per-layer activation checkpointing (non-reentrant).

Each decoder block keeps only its input during the forward pass and recomputes its
internals in the backward pass. We patch the block's ``forward`` on the instance rather
than wrapping the module, so parameter names (and therefore checkpoints and LoRA
targets) are unchanged. Everything a block's attention needs arrives as an argument
(the engine's attention call), so the recomputation — which CUDA runs on autograd's
device thread — sees exactly what the forward saw.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..registry import register_technique


@dataclass
class CheckpointOptions:
    """Layer checkpointing has no knobs: every decoder block is checkpointed."""


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation, or a chunked engine's no-grad pass: nothing to save
        return forward(*args, **kwargs)
    # Non-reentrant: works with keyword arguments, frozen inputs (LoRA) and nested
    # autograd, and lets the recomputation stop early once the saved tensors exist.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@register_technique("checkpoint", CheckpointOptions, "per-layer activation checkpointing", order=50)
def install_checkpoint(context, options: CheckpointOptions) -> None:
    for layer in context.adapter.layers:
        layer.forward = functools.partial(_checkpointed_forward, layer.forward)
