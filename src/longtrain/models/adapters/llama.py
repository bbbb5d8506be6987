"""Decoders laid out as Llama: Llama, Mistral, Qwen2, Qwen3, Phi-3 (and Phi-3.5).

Their differences — grouped K/V heads, sliding windows, q/k norms (Qwen3), fused
projections (Phi-3), longrope and dynamic-NTK rotary tables — all live inside the
modules the adapter calls, so the base adapter serves them as it is.
"""

from __future__ import annotations

from .base import DecoderAdapter, register_adapter

__all__ = ["LlamaAdapter"]


@register_adapter
class LlamaAdapter(DecoderAdapter):
    families = ("llama", "mistral", "qwen2", "qwen3", "phi3")
