"""Gemma-2: embeddings scaled by √d inside its embedding module, alternating sliding and
full attention (each attention module passes its own window), attention logit
soft-capping (passed by the attention module) and a soft-capped LM head."""

from __future__ import annotations

from .base import DecoderAdapter, Head, register_adapter

__all__ = ["Gemma2Adapter"]


@register_adapter
class Gemma2Adapter(DecoderAdapter):
    families = ("gemma2",)
    mlp_output_saved = True  # its post-feed-forward norm saves the MLP output

    def head(self) -> Head:
        return Head(self.base.get_output_embeddings(), softcap=self.config.final_logit_softcapping)
