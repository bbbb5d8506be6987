"""Cohere (Command-R) and Cohere-2: attention and MLP in parallel on one layer norm,
interleaved rotary tables, optional q/k norms, Cohere-2's sliding layers — all inside the
modules — and logits multiplied by ``logit_scale``."""

from __future__ import annotations

from .base import DecoderAdapter, Head, register_adapter

__all__ = ["CohereAdapter"]


@register_adapter
class CohereAdapter(DecoderAdapter):
    families = ("cohere", "cohere2")

    def head(self) -> Head:
        return Head(self.base.get_output_embeddings(), logit_scale=float(self.base.logit_scale))
