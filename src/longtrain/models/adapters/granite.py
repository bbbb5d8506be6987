"""Granite: the Llama layout with multipliers. The embedding multiplier is applied by
the model's forward (so here), the residual and attention multipliers inside the
layers, and the logits are divided by ``logits_scaling``."""

from __future__ import annotations

import torch

from .base import DecoderAdapter, Head, register_adapter

__all__ = ["GraniteAdapter"]


@register_adapter
class GraniteAdapter(DecoderAdapter):
    families = ("granite",)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings()(input_ids) * self.decoder.embedding_multiplier

    def head(self) -> Head:
        return Head(self.base.get_output_embeddings(), logit_scale=1.0 / self.config.logits_scaling)
