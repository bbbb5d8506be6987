"""Decoders laid out as Llama: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo, SmolLM3, GLM-4 and
the other families named below, each checked exact by ``longtrain families``.

Their differences — grouped K/V heads, sliding windows, q/k norms, norms after attention
and MLP instead of before (OLMo-2), partial rotary (GLM-4, StableLM), biases, fused
projections (Phi-3), longrope and dynamic-NTK rotary tables — all live inside the modules
the adapter calls, so the base adapter serves them as it is.
"""

from __future__ import annotations

from .base import DecoderAdapter, register_adapter

__all__ = ["LlamaAdapter", "UngatedMLPAdapter"]


@register_adapter
class LlamaAdapter(DecoderAdapter):
    families = ("llama", "mistral", "ministral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "olmo3", "smollm3", "glm",
                "glm4", "stablelm", "helium", "seed_oss", "ernie4_5", "exaone", "exaone4", "internlm3", "hunyuan_v1_dense", "hyperclovax", "iquestcoder", "cwm", "bitnet", "gemma")


@register_adapter
class UngatedMLPAdapter(DecoderAdapter):
    """Decoders laid out as Llama whose MLP has two weight matrices (up, down) and no gate:
    only their cost facts differ."""

    families = ("starcoder2", "nemotron", "arcee", "apertus", "apertus1p5_text")
    mlp_matrices = 2
