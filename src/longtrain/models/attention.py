"""Hugging Face attention backend ``longtrain_attn``: SDPA with flash-kernel memory on every device.

Registered through transformers' ``AttentionInterface`` (no model files are edited).
It computes what the stock ``sdpa`` backend computes, but grouped K/V heads never
force the s×s math kernel on CPU (see :mod:`longtrain.ops.sdpa`), so CPU training and
the simulator show the memory a GPU flash kernel would use.
"""

from __future__ import annotations

from transformers import AttentionInterface

from ..ops.sdpa import sdpa_gqa
from . import hf_compat

# The name must not contain "sdpa": transformers applies its SDPA support checks to any
# backend whose name does, and refuses models (Gemma-2) that our backend handles.
NAME = "longtrain_attn"


def longtrain_attn_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    if kwargs.get("softcap") is not None:
        raise ValueError("longtrain_attn does not support attention logit soft-capping; use attn_implementation='eager'")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]
    out = sdpa_gqa(
        query, key, value, attn_mask=attention_mask, is_causal=is_causal, scale=scaling,
        dropout_p=dropout if module.training else 0.0,
    )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    AttentionInterface.register(NAME, longtrain_attn_forward)
    try:  # transformers builds masks per backend; ours takes the same masks as sdpa
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(NAME, sdpa_mask)
        if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
            ALL_MASK_ATTENTION_FUNCTIONS[NAME] = sdpa_mask
    except ImportError:  # pragma: no cover - older transformers
        pass


def attention_backend(config) -> str:
    """The backend longtrain builds a model with: ours, or eager where the model needs
    attention logit soft-capping (Gemma-2), which no SDPA kernel implements."""
    if getattr(config, "attn_logit_softcapping", None):
        return "eager"
    return NAME


_register()
hf_compat.install()
