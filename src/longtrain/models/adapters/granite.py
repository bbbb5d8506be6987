"""Granite: the Llama layout with multipliers. The embedding multiplier is applied by
the model's forward (so here), the residual and attention multipliers inside the
layers, and the logits are divided by ``logits_scaling``."""

from __future__ import annotations

import torch
from torch import nn

from ..description import FeedForward
from .base import DecoderAdapter, Head, register_adapter

__all__ = ["GraniteAdapter", "GraniteMoEAdapter"]


@register_adapter
class GraniteAdapter(DecoderAdapter):
    families = ("granite",)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings()(input_ids) * self.decoder.embedding_multiplier

    def head(self) -> Head:
        return Head(self.base.get_output_embeddings(), logit_scale=1.0 / self.config.logits_scaling)


@register_adapter
class GraniteMoEAdapter(GraniteAdapter):
    """GraniteMoE (and GraniteMoE with a shared MLP beside the experts): Granite's
    multipliers; each layer's ``block_sparse_moe`` is its token-wise feed-forward block (a
    shared MLP runs beside it, untiled)."""

    families = ("granitemoe", "granitemoeshared")

    @classmethod
    def layer_feed_forward(cls, config, index: int) -> FeedForward:
        return FeedForward(config.intermediate_size, experts=config.num_local_experts, active=config.num_experts_per_tok,
                           shared_width=getattr(config, "shared_intermediate_size", 0) or 0)

    def mlp(self, layer: nn.Module) -> nn.Module | None:
        return layer.block_sparse_moe
