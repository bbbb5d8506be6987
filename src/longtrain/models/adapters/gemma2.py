"""Gemma-2 and Gemma-3: embeddings scaled by √d inside the embedding module, sliding and
full attention layers (each attention module passes its own window), Gemma-2's attention
logit soft-capping (passed by the attention module) and soft-capped LM head, Gemma-3's
q/k norms and two rotary tables (one per kind of layer, served by the base adapter)."""

from __future__ import annotations

from .base import DecoderAdapter, Head, register_adapter

__all__ = ["Gemma2Adapter"]


@register_adapter
class Gemma2Adapter(DecoderAdapter):
    families = ("gemma2", "gemma3_text")

    @classmethod
    def mlp_output_saved(cls, config) -> bool:
        return True  # its post-feed-forward norm saves the MLP output

    def head(self) -> Head:
        return Head(self.base.get_output_embeddings(), softcap=self.config.final_logit_softcapping)
