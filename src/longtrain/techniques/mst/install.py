"""What ``mst`` runs: every decoder layer's MLP (but those checkpointing leaves whole)
patched to run through :func:`~longtrain.ops.tiled_mlp.tiled_mlp` in chunks of
``mlp_chunk`` tokens; the chunked head is the engines' loss head, only checked here.

Shapes: N tokens, H hidden size; the MLP's input (..., H), run as one row (1, N, H).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ...errors import LongtrainError
from ...models.adapters import describe_model
from ...ops.tiled_mlp import tiled_mlp
from ..checkpoint.costs import whole_layers
from .options import MsTOptions


def _tiled_forward(original, module: nn.Module, chunk: int, copy_input: bool, pair: bool, x: torch.Tensor):
    params = [p for p in module.parameters() if p.requires_grad]
    out = tiled_mlp(functools.partial(_as_one_row, original, copy_input, pair), x, params, chunk, module=module)
    return (out, None) if pair else out


def _as_one_row(mlp, copy_input: bool, pair: bool, tokens: torch.Tensor) -> torch.Tensor:
    """The MLP on tokens (..., H) seen as a batch of one row (1, N, H): a mixture of
    experts reads (batch, sequence, hidden) where a dense MLP takes any leading shape.
    ``copy_input``: the MLP writes its input in place (Mixtral's router jitter), which here
    is a view of the tensor the tiled MLP keeps for its backward, so it gets a copy.
    ``pair``: the MLP returns ``(output, router scores)`` (gpt-oss); its output is taken."""
    row = tokens.reshape(1, -1, tokens.shape[-1])
    out = mlp(row.clone() if copy_input else row)
    if pair:
        out = out[0]
    return out.reshape(*tokens.shape[:-1], out.shape[-1])


def default_mlp_chunk(context) -> int:
    """The hidden size; under a chunked engine, half its chunk (FPDT runs the MLP in twice
    as many chunks as attention)."""
    engine_chunk = getattr(context.engine_options, "chunk", None)
    return max(1, engine_chunk // 2) if engine_chunk else describe_model(context.adapter.config).hidden


def install_mst(context, options: MsTOptions) -> None:
    adapter = context.adapter
    if options.head and adapter.head().linear is None:
        found = type(adapter.head().module).__name__
        raise LongtrainError(
            f"mst's chunked LM head needs the head as a plain linear layer, found {found} (LoRA on lm_head?); "
            "leave lm_head out of the LoRA targets, or use mst:head=false"
        )
    if not options.mlp:
        return
    chunk = options.mlp_chunk or default_mlp_chunk(context)
    whole = whole_layers(context.strategy, len(adapter.layers))
    for index, layer in enumerate(adapter.layers):
        if index in whole:
            continue
        mlp = adapter.mlp(layer)
        if mlp is not None:  # SSM-ResNet layers have no MLP
            mlp.forward = functools.partial(_tiled_forward, mlp.forward, mlp, chunk, adapter.mlp_writes_input(),
                                            adapter.mlp_returns_pair())
