"""``mst``: mini-sequence MLP and LM-head + loss (Mini-Sequence Transformer).

In long-sequence training the MLP and the LM head create intermediates far larger than
their inputs (2·I/d ≈ 7× and V/d ≈ 32× for Llama-3). MsT processes both in
mini-sequences so only one chunk's intermediates are alive, in forward and backward:

- every decoder layer's MLP (the adapter names it) is patched to run through
  :func:`~longtrain.ops.tiled_mlp.tiled_mlp`, in chunks of ``mlp_chunk`` tokens —
  by default the hidden size (the paper's rule), or half the chunk of a chunked engine
  (FPDT's rule, which keeps attention the memory peak); layers that checkpointing leaves
  whole (``checkpoint:except_last``) keep their MLP whole, since a tiled MLP recomputes its
  forward and those layers are there to recompute nothing;
- the head and the loss run through
  :func:`~longtrain.ops.chunked_loss.chunked_causal_lm_loss` in ``loss_chunks``
  mini-sequences (default V/d, the paper's rule), so the logits never exist in full.
  That is a choice of loss head every engine reads from the strategy
  (:meth:`~longtrain.engines.base.EngineContext.head_loss`); it needs the head as a
  plain linear layer, which is checked here, once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from .. import validate
from ..costs import StepWork, TechniqueCosts
from ..errors import LongtrainError
from ..models.adapters import describe_model
from ..ops.tiled_mlp import tiled_mlp
from ..registry import TechniqueSpec, register
from .checkpoint import whole_layers

__all__ = ["MsTOptions"]


@dataclass
class MsTOptions:
    """Knobs of the mini-sequence technique."""

    mlp_chunk: int | None = None  # tokens per MLP chunk; default: the hidden size (half a chunked engine's chunk)
    loss_chunks: int | None = None  # LM-head mini-sequences; default: vocab / hidden
    mlp: bool = True  # tile the MLPs
    head: bool = True  # chunk the LM head + loss

    def __post_init__(self):
        validate.positive_int("mst", "mlp_chunk", self.mlp_chunk, allow_none=True)
        validate.positive_int("mst", "loss_chunks", self.loss_chunks, allow_none=True)
        validate.flag("mst", "mlp", self.mlp)
        validate.flag("mst", "head", self.head)


def _tiled_forward(original, module: nn.Module, chunk: int, copy_input: bool, x: torch.Tensor) -> torch.Tensor:
    params = [p for p in module.parameters() if p.requires_grad]
    return tiled_mlp(functools.partial(_as_one_row, original, copy_input), x, params, chunk, module=module)


def _as_one_row(mlp, copy_input: bool, tokens: torch.Tensor) -> torch.Tensor:
    """The MLP on tokens (..., H) seen as a batch of one row (1, N, H): a mixture of
    experts reads (batch, sequence, hidden) where a dense MLP takes any leading shape.
    ``copy_input``: the MLP writes its input in place (Mixtral's router jitter), which here
    is a view of the tensor the tiled MLP keeps for its backward, so it gets a copy."""
    row = tokens.reshape(1, -1, tokens.shape[-1])
    out = mlp(row.clone() if copy_input else row)
    return out.reshape(*tokens.shape[:-1], out.shape[-1])


def default_mlp_chunk(context) -> int:
    """The hidden size; under a chunked engine, half its chunk (FPDT runs the MLP in twice
    as many chunks as attention)."""
    engine_chunk = getattr(context.engine_options, "chunk", None)
    return max(1, engine_chunk // 2) if engine_chunk else describe_model(context.adapter.config).hidden


class MsTCosts(TechniqueCosts):
    """MsT: the tiled MLP's backward runs its forward once more (where nothing else recomputes
    it) at a measured efficiency; the chunked head's weight gradient at its own rate. Same
    memory or less for every strategy, so a plan adds it to every candidate."""

    in_every_candidate = True

    def describe(self, work: StepWork, options: MsTOptions) -> None:
        work.tiled_mlp, work.chunked_head = options.mlp, options.head

    def add_work(self, work: StepWork, options: MsTOptions) -> None:
        if work.tiled_mlp and not work.mlp_forward_charged:
            work.matmul += work.mlp_fwd


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
            mlp.forward = functools.partial(_tiled_forward, mlp.forward, mlp, chunk, adapter.mlp_writes_input())


register(TechniqueSpec("mst", MsTOptions, install_mst, "mini-sequence MLP and LM-head + loss (exact)", costs=MsTCosts()))
