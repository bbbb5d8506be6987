"""Decoders laid out as Llama: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo, SmolLM3, GLM-4 and
the other families named below, each checked exact by ``longtrain families``.

Their differences — grouped K/V heads, sliding windows, q/k norms, norms after attention
and MLP instead of before (OLMo-2), partial rotary (GLM-4, StableLM), biases, fused
projections (Phi-3), longrope and dynamic-NTK rotary tables — all live inside the modules
the adapter calls, so the base adapter serves them as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import DecoderAdapter, register_adapter

__all__ = ["LlamaAdapter", "PostNormAdapter", "Starcoder2Adapter", "UngatedMLPAdapter"]


@register_adapter
class LlamaAdapter(DecoderAdapter):
    families = ("llama", "mistral", "ministral", "qwen2", "qwen3", "phi3", "olmo", "smollm3", "glm", "stablelm",
                "helium", "seed_oss", "ernie4_5", "exaone", "internlm3", "hunyuan_v1_dense", "iquestcoder", "cwm", "bitnet", "gemma")


@register_adapter
class UngatedMLPAdapter(DecoderAdapter):
    """Decoders laid out as Llama whose MLP has two weight matrices (up, down) and no gate:
    only their cost facts differ."""

    families = ("nemotron", "arcee", "apertus", "apertus1p5_text")
    mlp_matrices = 2


@register_adapter
class Starcoder2Adapter(UngatedMLPAdapter):
    """StarCoder2: an ungated MLP, and dropout on the embeddings (``embedding_dropout``)."""

    families = ("starcoder2",)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        return nn.functional.dropout(hidden, p=self.decoder.embedding_dropout, training=self.decoder.training)


@register_adapter
class PostNormAdapter(DecoderAdapter):
    """Decoders laid out as Llama with norms after attention and after the MLP
    (``residual + norm(mlp(x))``): a recomputed layer's MLP output is saved by that norm."""

    families = ("olmo2", "olmo3", "glm4", "exaone4", "hyperclovax")

    @classmethod
    def mlp_output_saved(cls, config) -> bool:
        return bool(getattr(config, "use_post_norm", True))  # HyperCLOVAX can turn its post-norms off
